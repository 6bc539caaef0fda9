"""Pure snapshot logic: the watermark window rule (a scripted K1..K6 sequence), COPY text
parsing, event keys, and the read encoding against the reference codec."""

from __future__ import annotations

import itertools

import orjson
import pytest

from producer.codec import CaptureFilter, EncodedEvent, EventEncoder, Relation, text_converter
from producer.incremental import ChunkWindow, Position, RecentChanges, snapshot_xip
from producer.snapshot import _deletes, emitted_read_key, snapshot_key
from producer.tablescan import ScanTable, convert_line, convert_row, copy_field, str_converters
from walbus.contract import RowImage, decode_event, encode_event, event_key


def _relation(columns: list[str], pk: list[str], replident: str = "d") -> Relation:
    types = ["int4" if c != "b" else "text" for c in columns]
    return Relation(1, "public", "t", columns, types, [c in pk for c in columns], pk, replident).prepare(CaptureFilter())


T = _relation(["id", "v"], ["id"])


def change(op: str, key: int, *, new_key: int | None = None, v: str = "x") -> EncodedEvent:
    """A streamed change of ``public.t (id pk, v)`` as the producer hands it to the window."""
    enc = EventEncoder()
    enc.begin(100, 1, "2024-01-01T00:00:00.000000+00:00")
    new = None if op == "delete" else [key if new_key is None else new_key, v]
    old = [key, None] if op in ("update", "delete") else None
    return enc.encode(T, op, 90, new, old=old)


def test_window_rule_k1_to_k6() -> None:
    """The chunk reads K1..K6. Changes inside the window win over the chunk's rows; changes
    before the low or after the high watermark do not touch it."""
    chunk = [((k,), f"read K{k}") for k in range(1, 7)]
    w = ChunkWindow()
    for key in change("update", 1).primary_keys():  # before the low watermark: K1's read is current
        w.observe(key)
    w.low()
    script = [
        change("update", 2, v="K2 updated"),  # emitted once, as this update; its read is dropped
        change("delete", 3),  # the delete stands; a read of K3 would resurrect it
        change("insert", 7),  # a key outside the chunk: nothing to drop
        change("update", 4, new_key=8),  # key change: the old key K4 is gone, its read must not come back
    ]
    for ev in script:
        for key in ev.primary_keys():
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


def test_a_transaction_before_the_window_the_snapshot_did_not_see_drops_its_keys() -> None:
    """Transactions the stream passed before the low watermark: the keys of those the chunk's
    snapshot listed as in progress (committed in the WAL, not yet visible) are dropped too."""
    now = [100.0]
    recent = RecentChanges("public.t", keep_s=10, clock=lambda: now[0])
    recent.note(501, [(3,)])  # deleted K3; committed, not yet visible to the snapshot
    recent.note(502, [(4,)])  # updated K4; visible to the snapshot: its read is current
    recent.note(501, [(6,)])  # more of 501
    w = ChunkWindow()
    w.low()
    mark = recent.mark
    recent.note(503, [(5,)])  # in the window: the window drops K5 itself
    w.observe((5,))
    invisible = snapshot_xip("499:504:501,503")
    unseen = recent.keys_before(invisible, mark)
    assert unseen == {(3,), (6,)}
    assert w.high([((k,), f"read K{k}") for k in range(1, 8)], unseen) == ["read K1", "read K2", "read K4", "read K7"]


def test_recent_changes_keep_a_while_and_a_bounded_number() -> None:
    now = [0.0]
    recent = RecentChanges("public.t", keep_s=5, max_keys=4, clock=lambda: now[0])
    recent.note(1, [(1,), (2,)])
    now[0] = 3
    recent.note(2, [(3,)])
    now[0] = 6
    recent.prune()  # 1 is older than 5 s
    assert len(recent) == 1 and recent.keys_before({1, 2}, recent.mark) == {(3,)}
    recent.note(3, [(4,), (5,), (6,)])
    recent.note(3, [(7,)])  # five keys: the oldest transaction goes
    assert len(recent) == 1 and recent.keys_before({2, 3}, recent.mark) == {(4,), (5,), (6,), (7,)}
    assert snapshot_xip("10:10:") == frozenset()
    assert snapshot_xip("4294967296:4294967310:4294967297,4294967300") == {1, 4}  # epoch 1: the stream's 32-bit xids
    with pytest.raises(ValueError):
        snapshot_xip("nonsense")


def test_event_keys_composite_and_full_identity() -> None:
    rel = _relation(["a", "b", "c"], ["a", "b"], "f")
    enc = EventEncoder()
    enc.begin(100, 1, "2024-01-01T00:00:00.000000+00:00")
    ev = enc.encode(rel, "update", 90, [1, "x", 3], old=[1, "y", 2], old_is_full=True)
    assert ev.primary_keys() == [(1, "x"), (1, "y")]
    assert ev.table == "public.t" and ev.row() == {"a": 1, "b": "x", "c": 3}
    assert enc.encode(rel, "delete", 91, None, old=[4, "z", None]).primary_keys() == [(4, "z")]
    assert enc.truncate(rel, 92).primary_keys() == [] and enc.truncate(rel, 92).operation == "truncate"


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


def test_resumed_snapshot_keys_of_a_table_with_an_excluded_key_column() -> None:
    """A snapshot redone after an interruption deletes the rows its first attempt read that are
    gone. The keys it reads back from the topic must be whole: a read event of a table whose key
    column is excluded from events carries a partial key, which used to be collected and then
    crash _deletes (zip strict: 1 value for 2 key columns) on every restart. Such reads give no
    key now; whole keys still make deletes naming the row."""
    capture = CaptureFilter(exclude_columns=("public.t.b",))
    rel = Relation(1, "public", "t", ["a", "b", "c"], ["int4", "int4", "text"], [True, True, False], ["a", "b"]).prepare(capture)
    enc = EventEncoder()
    enc.begin(500, 0, "2024-01-01T00:00:00.000000+00:00")
    assert emitted_read_key(enc.read(rel, 500, [1, 2, "x"]).value) is None  # "b" is not in the event
    assert emitted_read_key(enc.encode(rel, "delete", 500, None, old=[1, 2, None]).value) is None  # not a read

    whole = _relation(["a", "b", "c"], ["a", "b"])
    read = emitted_read_key(enc.read(whole, 500, [1, 2, "x"]).value)
    assert read == ("public.t", b"[1,2]")
    table = ScanTable(whole, "r", ["int4", "text", "int4"])
    (gone,) = _deletes(enc, table, {read[1]}, 500)
    assert decode_event(gone.value).identity == RowImage(("a", "b"), ("int4", "text"), (1, 2))


def test_a_redone_snapshot_keeps_rows_whose_key_column_is_masked() -> None:
    """The redo compares each row it reads with the keys the interrupted attempt emitted, as
    read back from the topic. A masked key column is '****' there: compared with the raw
    value, no row matched and the redo emitted a delete for every row it had just read."""
    rel = Relation(1, "public", "t", ["code", "v"], ["text", "int4"], [True, False], ["code"]).prepare(
        CaptureFilter(mask_columns=("public.t.code",))
    )
    enc = EventEncoder()
    enc.begin(500, 0, "2024-01-01T00:00:00.000000+00:00")
    row = ["secret", 1]
    read = emitted_read_key(enc.read(rel, 500, list(row)).value)
    assert read is not None
    assert read == ("public.t", b'["****"]')
    assert snapshot_key(rel, row) == read[1]
    plain = _relation(["id", "v"], ["id"])
    assert snapshot_key(plain, [7, "x"]) == emitted_read_key(enc.read(plain, 500, [7, "x"]).value)[1]  # type: ignore[index]
