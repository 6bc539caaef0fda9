"""One table matcher: the producer's include/exclude lists, its column lists and the client's
filter read a pattern the same way (walbus.contract.NameMatcher, docs/contract.md)."""

from __future__ import annotations

import pytest

from producer.codec import CaptureFilter, Relation
from producer.setup import column_patterns, table_patterns
from walbus.client import EventFilter
from walbus.config import ConfigError
from walbus.contract import ContractError, NameMatcher, qualify_table, split_pattern

NAMES = [("public", "orders"), ("public", "a.b"), ("my.app", "orders"), ("billing", "big_orders"), ('we"ird', "t")]
PATTERNS = ["orders", "public.*", "public.a*", "*.orders", '"my.app".*', "my.*", "*orders", '"we""ird".t', '"a.b"', "b*.*"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_producer_and_client_select_the_same_tables(pattern: str) -> None:
    capture, wanted = CaptureFilter(tables=(pattern,)), EventFilter([pattern])
    for name in NAMES:
        q = qualify_table(*name)
        assert capture.captures(q) == wanted.wants_table(q) == NameMatcher([pattern]).matches(*name), (pattern, name)


def test_parts_match_exact_names_and_missing_leading_parts_match_anything() -> None:
    m = NameMatcher(["public.a*", "orders"])
    assert m.matches("public", "a.b")  # a part's '*' may cover a dot inside the name
    assert m.matches("my.app", "orders") and not m.matches("public", "b")
    assert not NameMatcher(["my.*"]).matches("my.app", "orders")  # schema "my" only
    assert m.matches_table('public."a.b"') and not NameMatcher([]).matches("public", "t")


def test_column_patterns_name_the_last_parts() -> None:
    rel = Relation(1, "app.x", "users", ["id", "password", "note"], ["int4", "text", "text"], [True, False, False], ["id"])
    rel.prepare(CaptureFilter(mask_columns=("password",), exclude_columns=('"app.x".users.note',)))
    assert [rel.columns[i] for i in rel.keep] == ["id", "password"]
    assert [rel.columns[i] for i in sorted(rel.masked)] == ["password"]


@pytest.mark.parametrize("bad", ["a.b.c", "", "a..b", ".a", "a.", '"open'])
def test_a_malformed_table_pattern_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ContractError):
        split_pattern(bad, 2)
    with pytest.raises(ValueError):
        EventFilter([bad])
    with pytest.raises(ConfigError, match="--tables"):
        table_patterns([bad.replace("a", "a*", 1) if bad else bad], "--tables")


def test_column_patterns_have_at_most_three_parts() -> None:
    assert column_patterns(["*.password", "s.t.c"], "--mask-columns") == ("*.password", "s.t.c")
    with pytest.raises(ConfigError, match="--mask-columns"):
        column_patterns(["a.b.c.d"], "--mask-columns")


def test_exclude_entries_may_name_last_parts_and_lists_keep_quoted_commas() -> None:
    # The contract says `orders` is the table in any schema; --exclude-tables refused it
    # ("not schema.table"), and a quoted name with a comma was cut at the comma (a fuzz).
    from walbus.config import split_list

    excluded = table_patterns(split_list("orders, audit.*"), "--exclude-tables", exact=False)
    capture = CaptureFilter(exclude_tables=excluded)
    assert not capture.captures("public.orders") and not capture.captures('"my.app".orders')
    assert not capture.captures("audit.log") and capture.captures("public.orders_2024")
    with pytest.raises(ConfigError):
        table_patterns(["orders"], "--tables")  # an include entry without wildcards names one table
    assert split_list('public."a,b", public.c ,, "x""y".z') == ['public."a,b"', "public.c", '"x""y".z']
    (named,) = table_patterns(split_list('public."a,b"'), "--tables")
    assert named == "public.a,b" and CaptureFilter(tables=(named,)).captures(qualify_table("public", "a,b"))
