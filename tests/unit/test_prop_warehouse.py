"""Properties of the warehouse's pure logic (no Spark session).

The warehouse's dedup by (commit_lsn, seq) (warehouse/history.py: dropDuplicates + an anti
join on the table), its latest-by-position selection (warehouse/current.py: max_by over the
position struct) and its TOAST fill (warehouse/toast.py: windows) exist only as Spark
expressions; they have no pure-Python core to test here and are covered by the Spark tests
(tests/integration/test_warehouse_load.py). What is pure: the path layout of a table and its view names.
"""

from __future__ import annotations

import re

from hypothesis import assume, given
from hypothesis import strategies as st

from tests.support.prop import identifiers
from warehouse import layout


@given(identifiers)
def test_path_segment_round_trips_and_is_safe(name: str) -> None:
    segment = layout.escape_segment(name)
    assert re.fullmatch(r"[A-Za-z0-9_~-]+", segment)
    assert layout.unescape_segment(segment) == name


@given(identifiers, identifiers)
def test_table_directory_round_trips(schema: str, table: str) -> None:
    segment = layout.table_dir_name(schema, table)
    assert "/" not in segment and segment.count(".") == 1
    assert layout.table_from_dir_name(segment) == (schema, table)


@given(identifiers, identifiers, identifiers, identifiers)
def test_distinct_tables_get_distinct_directories(s1: str, t1: str, s2: str, t2: str) -> None:
    assume((s1, t1) != (s2, t2))
    a = layout.table_paths("/w", "walbus.shop", s1, t1)
    b = layout.table_paths("/w", "walbus.shop", s2, t2)
    assert a.history != b.history and a.current != b.current


def _views(schema: str, table: str) -> set[str]:
    paths = layout.table_paths("/w", "walbus.shop", schema, table)
    return {paths.view(kind) for kind in ("", "history", "all")}


_plain_names = st.text(st.sampled_from("abc_019"), min_size=1, max_size=8)
_other_chars = st.sampled_from(list(".-ö ä\"$"))
# Pairs of distinct tables whose view names could meet: '.' and other characters become '_',
# and the views add suffixes.
_near_pairs = st.one_of(
    st.builds(lambda a, b, c: ((a, f"{b}_{c}"), (f"{a}_{b}", c)), _plain_names, _plain_names, _plain_names),
    st.builds(lambda a, b, x, y: ((a, b + x), (a, b + y)), _plain_names, _plain_names, _other_chars, _other_chars),
    st.builds(lambda a, b: ((a, b), (a, b + "_all")), _plain_names, _plain_names),
)


@given(_near_pairs)
def test_distinct_tables_get_distinct_view_names(pair: tuple[tuple[str, str], tuple[str, str]]) -> None:
    a, b = pair
    assume(a != b)
    assert not _views(*a) & _views(*b)
