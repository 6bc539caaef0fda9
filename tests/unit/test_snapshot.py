"""Pure snapshot logic: the watermark window rule (a scripted K1..K6 sequence), COPY text
parsing, event keys, and the read encoding against the reference codec."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from producer.codec import CaptureFilter, EventEncoder, Relation, text_converter
from producer.incremental import ChunkWindow, Position, _event_keys
from producer.tablescan import convert_line, convert_row, copy_field, str_converters
from walbus.contract import decode_event, encode_event, event_key


def change(op: str, key: int, *, new_key: int | None = None, v: str = "x") -> dict[str, Any]:
    """A streamed change of ``public.t (id pk, v)`` as the decoded JSON the window sees."""
    ev: dict[str, Any] = {"table": "public.t", "operation": op, "pk": ["id"]}
    if op != "delete":
        ev["columns"], ev["values"] = ["id", "v"], [key if new_key is None else new_key, v]
    if op in ("update", "delete"):
        ev["identity"] = {"columns": ["id"], "types": ["int4"], "values": [key]}
    return ev


def test_window_rule_k1_to_k6() -> None:
    """The chunk reads K1..K6. Changes inside the window win over the chunk's rows; changes
    before the low or after the high watermark do not touch it."""
    chunk = [((k,), f"read K{k}") for k in range(1, 7)]
    w = ChunkWindow()
    for key in _event_keys(change("update", 1)):  # before the low watermark: K1's read is current
        w.observe(key)
    w.low()
    script = [
        change("update", 2, v="K2 updated"),  # emitted once, as this update; its read is dropped
        change("delete", 3),  # the delete stands; a read of K3 would resurrect it
        change("insert", 7),  # a key outside the chunk: nothing to drop
        change("update", 4, new_key=8),  # key change: the old key K4 is gone, its read must not come back
    ]
    for ev in script:
        for key in _event_keys(ev):
            w.observe(key)
    emitted = w.high(chunk)
    assert emitted == ["read K1", "read K5", "read K6"]
    assert w.keys_seen == 5  # K2, K3, K7, K4 and K8; only those in the chunk drop a read
    w.observe((5,))  # after the high watermark: the window is closed
    assert w.closed and not w.is_open


def test_window_truncate_and_order_errors() -> None:
    w = ChunkWindow()
    w.truncate()  # before the window: ignored
    w.low()
    w.truncate()
    assert w.high([((1,), "r1")]) == []  # rows read before the truncate are stale
    with pytest.raises(RuntimeError):
        ChunkWindow().high([])
    w2 = ChunkWindow()
    w2.low()
    assert w2.high([((1,), "r1"), ((2,), "r2")]) == ["r1", "r2"]  # a quiet window drops nothing


def test_event_keys_composite_and_full_identity() -> None:
    ev = {
        "pk": ["a", "b"], "columns": ["a", "b", "c"], "values": [1, "x", 3],
        "identity": {"columns": ["a", "b", "c"], "types": [], "values": [1, "y", 2]},
    }
    assert _event_keys(ev) == [(1, "x"), (1, "y")]
    assert _event_keys({"pk": ["a"], "identity": {"columns": ["a"], "values": [4]}}) == [(4,)]


def test_copy_text_fields() -> None:
    convs = [text_converter(t) for t in ("int4", "text", "bool", "float8", "numeric")]
    values, raw = convert_row(b"1\tplain\tt\tNaN\t1.10\n", convs)
    assert values == [1, "plain", True, "NaN", "1.10"] and raw[0] == b"1"
    values, raw = convert_row(b"2\ttab\\there\\\\back\\nline\t\\N\t-Infinity\t\\N\n", convs)
    assert values == [2, "tab\there\\back\nline", None, "-Infinity", None]
    strs = str_converters(["int4", "text", "bool", "float8", "numeric"])
    assert convert_line(b"1\tplain\tt\tNaN\t1.10\n", convs, strs) == [1, "plain", True, "NaN", "1.10"]
    assert convert_line(b"2\t\\N\tf\t2.5\t\\N\n", convs, strs) == [2, None, False, 2.5, None]
    assert copy_field(b"\\N") is None and copy_field(b"a\\rb\\x") == b"a\rbx"


def test_read_events_match_the_reference_codec() -> None:
    rel = Relation(1, "public", "t", ["id", "v"], ["int4", "text"], [True, False], ["id"]).prepare(CaptureFilter())
    enc = EventEncoder()
    enc.begin(0x1234, 0, "2024-01-02T03:04:05.000001+00:00")
    evs = [enc.read(rel, 0x1234, [i, f"v{i}"]) for i in range(3)]
    for i, ev in enumerate(evs):
        assert ev.key == event_key(0x1234, i)
        ref = encode_event(
            lsn=0x1234, commit_lsn=0x1234, seq=i, xid=0, operation="read", table="public.t",
            timestamp="2024-01-02T03:04:05.000001+00:00", pk=["id"],
            new={"columns": ["id", "v"], "types": ["int4", "text"], "values": [i, f"v{i}"]}, identity=None,
        )
        assert ev.value == ref
        assert decode_event(ev.value).operation == "read"
    # An insert in the same transaction keeps its own cached head.
    assert orjson.loads(enc.insert(rel, 0x1234, [9, "z"]).value)["operation"] == "insert"


def test_position_round_trip() -> None:
    pos = Position("sig-1", ["public.a", "public.b"], ["10"], ["99"], 2, "2024-01-01T00:00:00+00:00", 11)
    from dataclasses import asdict

    assert Position.load(orjson.loads(orjson.dumps(asdict(pos)))) == pos
    assert Position.load(None) is None


def test_plan_parts_splits_large_tables() -> None:
    from producer.snapshot import SPLIT_MIN_PAGES, plan_parts
    from producer.tablescan import ScanTable

    def table(name: str, pages: int) -> ScanTable:
        rel = Relation(1, "public", name, ["id"], ["int4"], [True], ["id"]).prepare(CaptureFilter())
        return ScanTable(rel, "r", ["integer"], 0, pages)

    big, small = table("big", SPLIT_MIN_PAGES * 4 + 3), table("small", 10)
    assert [(p.table.relation.name, p.pages) for p in plan_parts([small, big], 1)] == [("big", None), ("small", None)]
    parts = plan_parts([small, big], 2)
    ranges = [p.pages for p in parts if p.table is big]
    assert len(ranges) == 4 and ranges[0] is not None and ranges[0][0] == 0 and ranges[-1] is not None and ranges[-1][1] is None
    assert all(a is not None and b is not None and a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert parts[-1].table is small and parts[-1].pages is None
