"""--key-columns (Debezium's message.key.columns), pure parts: parsing and the events' pk."""

from __future__ import annotations

import orjson
import pytest

from producer.codec import CaptureFilter, EventEncoder, Relation
from producer.setup import key_column_rules
from walbus.config import ConfigError
from walbus.contract import decode_event


def test_rules_use_debeziums_separators_and_walbus_quoting() -> None:
    assert key_column_rules("public.orders:a,b; *.logs:ts") == (("public.orders", ("a", "b")), ("*.logs", ("ts",)))
    # a name holding a separator, a dot or a quote is double-quoted, as in every table pattern
    assert key_column_rules('public."a.b;c":"x,y","q""t"') == (('public."a.b;c"', ("x,y", 'q"t')),)
    assert key_column_rules("") == () and key_column_rules(None) == ()
    assert key_column_rules("public.t*:id") == (("public.t*", ("id",)),)


@pytest.mark.parametrize("text", ["public.t", "public.t:", "public.t:a,,b", "a.b.c:id", "t:id", 'public."t:id', "public.t:a,a", "public.t:a:b"])
def test_bad_rules_are_configuration_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="--key-columns"):
        key_column_rules(text)


def rel(pk: list[str], capture: CaptureFilter) -> Relation:
    cols = ["id", "code", "v"]
    return Relation(7, "public", "logs", cols, ["int4", "text", "text"], [True] * 3, pk, "f").prepare(capture)


def test_key_columns_become_the_events_pk() -> None:
    capture = CaptureFilter(key_columns=key_column_rules("public.other:id;public.l*:code,id"))
    keyless = rel([], capture)
    assert keyless.pk == ["code", "id"]
    enc = EventEncoder()
    enc.begin(0x10, 3, "2026-11-23T00:00:00.000000+00:00")
    ev = decode_event(enc.insert(keyless, 0x10, [1, "a", "x"]).value)
    assert ev.pk == ("code", "id") and ev.key_values() == {"code": "a", "id": 1}
    # a primary key is overridden too; a table no rule names keeps its own
    assert rel(["id"], capture).pk == ["code", "id"]
    assert rel(["id"], CaptureFilter(key_columns=key_column_rules("public.other:code"))).pk == ["id"]


def test_a_rule_naming_a_missing_column_keeps_the_tables_key() -> None:
    capture = CaptureFilter(key_columns=key_column_rules("public.logs:nope"))
    r = rel(["id"], capture)
    assert r.pk == ["id"]
    assert orjson.loads(EventEncoder().insert(r, 1, [1, "a", "x"]).value)["pk"] == ["id"]


def _capture(key_columns: str | None, signal_table: str | None = None) -> dict[str, object]:
    from producer.config import ProducerConfig
    from producer.service import Producer, capture_settings

    cfg = ProducerConfig(pg_dsn="dbname=x", kafka_bootstrap="k:1", key_columns=key_columns, signal_table=signal_table)
    return capture_settings(cfg, Producer(cfg).capture, False)


def test_the_recorded_capture_holds_the_signal_table_and_key_rules_in_any_order() -> None:
    # Two slots on one topic, one with --signal-table: the signal table is captured whatever the
    # filters say, so one position named the signal row in one and a row of another table in
    # the other, and consumers dropped one (a re-fuzz). And --key-columns rules for distinct
    # whole names were refused when given in another order, which the docs say does not count.
    assert _capture(None, "public.signals")["signal_table"] == ["public", "signals"]
    assert _capture(None, "public.signals") != _capture(None)
    assert _capture("public.a:x;public.b:x") == _capture('public.b:x;public."a":x')
    # Rules that may overlap keep their order: the first match wins.
    assert _capture("public.*:x;public.b:y") != _capture("public.b:y;public.*:x")
