"""Pure logic: the fast encoder against the reference codec, pgoutput bytes, progress, config."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import orjson
import pytest

from producer.catalog import TableInfo
from producer.codec import CaptureFilter, EncodedEvent, EventEncoder, Relation, pg_timestamp_iso
from producer.decoders import TxnBegin, TxnEnd, flat
from producer.decoders.pgoutput import PgoutputDecoder
from producer.progress import Progress
from tests.support.catalog import StaticCatalog
from walbus.config import ConfigError, load_config
from walbus.contract import ContractError, Lsn, decode_event, encode_event, event_key
from walbus.logs import redact_dsn


def rel(**kw: Any) -> Relation:
    base: dict[str, Any] = dict(
        relid=1, schema="public", name="t", columns=["id", "a", "big"], types=["int4", "text", "text"],
        identity=[True, False, False], pk=["id"],
    )
    base.update(kw)
    return Relation(**base).prepare(CaptureFilter())


def test_fast_encoder_matches_reference_codec() -> None:
    enc = EventEncoder()
    enc.begin(0x16B374D848, 7, "2024-01-02T03:04:05.000001+00:00")
    r = rel()
    cases = [
        (enc.encode(r, "insert", 10, [1, "x", "y"]), dict(new=[1, "x", "y"], identity=None, unchanged=None)),
        (enc.encode(r, "update", 11, [1, "x", None], unchanged=[2]), dict(new=[1, "x"], cols=2, identity=[1], unchanged=["big"])),
        (enc.encode(r, "delete", 12, None, old=[1, None, None]), dict(new=None, identity=[1], unchanged=None)),
    ]
    for seq, (ev, want) in enumerate(cases):
        assert ev.key == event_key(0x16B374D848, seq)
        n = want.get("cols", 3)
        new = want["new"]
        ref = encode_event(
            lsn=10 + seq, commit_lsn=0x16B374D848, seq=seq, xid=7,
            operation=["insert", "update", "delete"][seq], table="public.t",
            timestamp="2024-01-02T03:04:05.000001+00:00", pk=["id"],
            new=None if new is None else {"columns": r.columns[:n], "types": r.types[:n], "values": new},
            identity=None if want["identity"] is None else {"columns": ["id"], "types": ["int4"], "values": want["identity"]},
            unchanged=want["unchanged"],
        )
        assert ev.value == ref
        assert decode_event(ev.value).position == (0x16B374D848, seq)


def test_unchanged_toast_filled_from_full_old_row_and_masking() -> None:
    enc = EventEncoder()
    enc.begin(5, 1, "t")
    r = Relation(1, "s", "t", ["id", "secret", "big"], ["int4", "text", "text"], [True, True, True], ["id"], "f").prepare(
        CaptureFilter(mask_columns=("s.t.secret",))
    )
    ev = enc.encode(r, "update", 3, [1, "new", None], unchanged=[2], old=[1, "old", "B" * 5], old_is_full=True)
    m = orjson.loads(ev.value)
    assert m["values"] == [1, "****", "BBBBB"] and "unchanged" not in m
    assert m["identity"]["values"] == [1, "****", "BBBBB"]


def _tuple(values: list[bytes | None]) -> bytes:
    out = struct.pack(">H", len(values))
    for v in values:
        out += b"n" if v is None else b"t" + struct.pack(">I", len(v)) + v
    return out


def three_column_catalog() -> StaticCatalog:
    """Type names of a few built-in OIDs; every table is (id int4, t text, f float8)."""
    return StaticCatalog(
        {23: "int4", 25: "text", 701: "float8"},
        lambda schema, name: TableInfo(schema, name, ("id", "t", "f"), (23, 25, 701), ("id",), "d", ("id",)),
    )


def test_pgoutput_decoder_from_bytes() -> None:
    dec = PgoutputDecoder(three_column_catalog(), CaptureFilter())
    relation = b"R" + struct.pack(">I", 99) + b"public\0t\0d" + struct.pack(">H", 3)
    for flag, name, oid in [(1, b"id", 23), (0, b"t", 25), (0, b"f", 701)]:
        relation += bytes([flag]) + name + b"\0" + struct.pack(">Ii", oid, -1)
    ts = 757_000_000_123_456  # µs since 2000-01-01
    begin = b"B" + struct.pack(">QqI", 0x200, ts, 42)
    insert = b"I" + struct.pack(">I", 99) + b"N" + _tuple([b"1", "é".encode(), b"NaN"])
    update = b"U" + struct.pack(">I", 99) + b"K" + _tuple([b"1", None, None]) + b"N" + _tuple([b"2", None, b"1.5"])
    commit = b"C" + struct.pack(">bQQq", 0, 0x200, 0x230, ts)
    out = list(flat(dec.decode([(0x100, begin), (0x100, relation), (0x110, insert), (0x120, update), (0x200, commit)])))
    assert isinstance(out[0], TxnBegin) and out[0].timestamp == pg_timestamp_iso(ts) == "2023-12-27T13:46:40.123456+00:00"
    ins, upd = out[1], out[2]
    assert isinstance(ins, EncodedEvent) and isinstance(upd, EncodedEvent)
    assert orjson.loads(ins.value)["values"] == [1, "é", "NaN"]
    u = orjson.loads(upd.value)
    assert u["values"] == [2, None, 1.5] and u["identity"]["values"] == [1] and u["commit_lsn"] == 0x200
    end = out[3]
    assert isinstance(end, TxnEnd) and end.end_lsn == 0x230 and end.counts == {("public.t", "insert"): 1, ("public.t", "update"): 1}


def test_progress_confirms_only_fully_acknowledged_commits() -> None:
    p = Progress(2, confirmed_lsn=100)
    p.appended = [3, 1]
    p.commit(200)  # txn A: 3 events on p0, 1 on p1
    p.appended = [5, 1]
    p.commit(300)  # txn B
    p.ack(0, 3)
    assert p.confirmed_lsn == 100  # p1 not acked yet
    p.ack(1, 1)
    assert p.confirmed_lsn == 200
    p.ack(0, 5)
    assert p.confirmed_lsn == 300 and p.idle()
    assert p.advance_idle(400) and p.confirmed_lsn == 400
    p.appended = [6, 1]
    assert not p.advance_idle(500)


def test_contract_rejects_bad_records() -> None:
    with pytest.raises(ContractError, match="not JSON"):
        decode_event(b"\xff{")
    with pytest.raises(ContractError, match="version"):
        decode_event(b'{"v":2}')
    with pytest.raises(ContractError, match="table"):
        decode_event(b'{"v":1,"operation":"insert","lsn":1,"commit_lsn":1,"seq":0,"xid":1,"timestamp":"t"}')
    assert str(Lsn.parse("16/B374D848")) == "16/B374D848" and Lsn.parse("0/10") == 16


def test_config_precedence_flags_env_file(tmp_path: Path) -> None:
    from producer.config import ProducerConfig

    toml = tmp_path / "w.toml"
    toml.write_text('pg-dsn = "dbname=fromfile"\nkafka_bootstrap = "file:9092"\n[produce]\ntables = ["public.a", "public.b"]\npartitions = 3\n')
    env = {"WALBUS_KAFKA_BOOTSTRAP": "env:9092", "WALBUS_PARTITIONS": "5"}
    cfg = load_config(ProducerConfig, ["--config", str(toml), "--partitions", "7"], prog="t", env=env, section="produce")
    assert cfg.pg_dsn == "dbname=fromfile" and cfg.kafka_bootstrap == "env:9092" and cfg.partitions == 7
    assert cfg.tables == ["public.a", "public.b"] and cfg.database == "fromfile" and cfg.topic_name == "walbus.fromfile"
    with pytest.raises(ConfigError, match="WALBUS_PG_DSN"):
        load_config(ProducerConfig, [], prog="t", env={"WALBUS_KAFKA_BOOTSTRAP": "x"})
    with pytest.raises(ConfigError, match="not a valid int"):
        load_config(ProducerConfig, ["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k", "--partitions", "many"], prog="t", env={})


def test_passwords_never_logged() -> None:
    assert redact_dsn("postgresql://u:s3cret@h/db") == "postgresql://u:***@h/db"
    assert "s3cret" not in redact_dsn("host=h password=s3cret dbname=x")


@pytest.mark.parametrize(
    ("database", "expected"),
    [("shop", "walbus_shop"), ("shop_eu", "walbus_shop_eu")],
)
def test_default_slot_name_keeps_plain_names(database: str, expected: str) -> None:
    from producer.config import default_slot_name

    assert default_slot_name(database) == expected


def test_default_slot_name_is_valid_and_distinct_for_unusual_names() -> None:
    import re

    from producer.config import default_slot_name

    names = ["shop.eu", "shop_eu", "Shop-EU", "shop-eu", "ö", "o", "x" * 63, "x" * 64, "ü" * 40]
    slots = [default_slot_name(n) for n in names]
    for s in slots:
        assert re.fullmatch(r"[a-z0-9_]{1,63}", s), s
        assert len(s.encode()) <= 63
    assert len(set(slots)) == len(slots)
    assert default_slot_name("Shop").startswith("walbus_shop_")  # lower-cased, not '_hop'


def test_slot_flag_must_be_a_valid_slot_name() -> None:
    from producer.config import load

    with pytest.raises(ConfigError, match="--slot"):
        load(["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--slot", "Shop.EU"])


def test_replication_options_are_quoted() -> None:
    from producer.decoders.pgoutput import PgoutputDecoder
    from producer.replication import quote_ident, quote_literal

    assert quote_literal(quote_ident("My'Pub\"x")) == "'\"My''Pub\"\"x\"'"
    opts = PgoutputDecoder(None, CaptureFilter()).start_options("MyPub")  # type: ignore[arg-type]
    assert opts["publication_names"] == '"MyPub"'
