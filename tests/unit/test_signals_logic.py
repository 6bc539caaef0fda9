"""Snapshot signals without services: additional-conditions, pause/resume and the Kafka
signal channel's records, as the incremental snapshot takes them."""

from __future__ import annotations

from dataclasses import asdict

import orjson
import pytest
from prometheus_client import CollectorRegistry

from producer.codec import CaptureFilter, Relation
from producer.config import ProducerConfig, load
from producer.decoders import LogicalMessage
from producer.incremental import WATERMARK_PREFIX, Chunk, IncrementalSnapshot, LogLimit, Position
from producer.metrics import SnapshotMetrics
from producer.offsets import OffsetStore
from producer.signal_topic import read_signal
from producer.tablescan import ScanTable, max_key_query, null_key_query, select_chunk

OWN = b"walbus.shop"


def _snapshot(doc: dict[str, object] | None = None, *, signal_topic: str = "sigs") -> tuple[IncrementalSnapshot, CollectorRegistry]:
    registry = CollectorRegistry()
    offsets = OffsetStore({}, "walbus.shop", "walbus_shop")  # never started: no I/O here
    offsets.doc = dict(doc or {})
    cfg = ProducerConfig(pg_dsn="postgresql://u@h/shop", kafka_bootstrap="k:9092", signal_table="public.walbus_signal",
                         signal_topic=signal_topic)
    capture = CaptureFilter(signal_table="public.walbus_signal")
    return IncrementalSnapshot(cfg, capture, offsets=offsets, metrics=SnapshotMetrics(registry)), registry


def _ignored(registry: CollectorRegistry, kind: str) -> float:
    return registry.get_sample_value("walbus_snapshot_ignored_signals_total", {"kind": kind}) or 0.0


def _scan() -> ScanTable:
    rel = Relation(1, "public", "orders", ["id", "color"], ["int4", "text"], [True, False], ["id"], "d").prepare(CaptureFilter())
    return ScanTable(rel, "r", ["integer", "text"])


def test_chunk_query_carries_the_filter_in_parentheses() -> None:
    q = select_chunk(_scan(), ["10"], ["99"], 5, "color = 'blue' OR color = 'red'").as_string(None)
    assert "AND (color = 'blue' OR color = 'red') ORDER BY" in q
    assert '("id") > (\'10\'::integer)' in q  # the key bounds stay outside the filter's OR
    assert "WHERE (" in select_chunk(_scan(), None, ["99"], 5).as_string(None)
    assert "color" not in select_chunk(_scan(), None, ["99"], 5).as_string(None).split("WHERE")[1]


def test_max_key_query_is_filtered_too() -> None:
    q = max_key_query(_scan(), "color = 'blue'").as_string(None)
    assert "WHERE true AND (color = 'blue') ORDER BY" in q
    assert "(color" not in max_key_query(_scan()).as_string(None)


def test_additional_conditions_reach_the_position() -> None:
    inc, registry = _snapshot()
    inc.signal("s1", "execute-snapshot", {
        "data-collections": ["public.orders", "public.items"],
        "additional-conditions": [
            {"data-collection": "public.orders", "filter": " color = 'blue' "},
            {"data-collection": "public.other", "filter": "x = 1"},  # not snapshotted: ignored
        ],
    })
    pos = inc.position
    assert pos is not None and pos.tables == ["public.orders", "public.items"]
    assert pos.filters == {"public.orders": "color = 'blue'"}
    assert Position.load(asdict(pos)) == pos  # saved and resumed with its filters
    # A table already queued keeps its filter; a new one gets its own.
    inc.signal("s2", "execute-snapshot", {
        "data-collections": ["public.orders", "public.more"],
        "additional-conditions": [{"data-collection": "public.orders", "filter": "true"},
                                  {"data-collection": "public.more", "filter": "id < 5"}],
    })
    assert pos.filters == {"public.orders": "color = 'blue'", "public.more": "id < 5"}
    inc.signal("s3", "stop-snapshot", {"data-collections": ["public.more"]})
    assert pos.filters == {"public.orders": "color = 'blue'"}
    assert _ignored(registry, "signal") == 0


def test_debezium_2_0_additional_condition_applies_to_every_table() -> None:
    inc, registry = _snapshot()
    inc.signal("s1", "execute-snapshot", {
        "data-collections": ["public.a", "public.b"], "additional-condition": "n > 1",
        "additional-conditions": [{"data-collection": "public.b", "filter": "n > 2"}],  # the specific one wins
    })
    assert inc.position is not None and inc.position.filters == {"public.a": "n > 1", "public.b": "n > 2"}
    inc.signal("s2", "execute-snapshot", {"data-collections": ["public.c"], "additional-condition": 5})
    assert inc.position.tables == ["public.a", "public.b"] and _ignored(registry, "signal") == 1


def test_malformed_additional_conditions_are_ignored_and_counted() -> None:
    inc, registry = _snapshot()
    bad: list[object] = [
        "color = 'blue'",
        [{"data-collection": "public.orders"}],
        [{"data-collection": "public.orders", "filter": 7}],
        [{"data-collection": "no_schema.", "filter": "true"}],
        [{"data-collection": "public.orders", "filter": "x" * 70_000}],
    ]
    for i, conditions in enumerate(bad):
        inc.signal(f"b{i}", "execute-snapshot", {"data-collections": ["public.orders"], "additional-conditions": conditions})
    assert inc.position is None
    assert _ignored(registry, "signal") == len(bad)


async def test_pause_and_resume_are_saved_and_stop_chunks() -> None:
    inc, registry = _snapshot()
    inc.signal("p0", "pause-snapshot", {})  # nothing to pause: a warning, no position
    assert inc.position is None
    inc.signal("s1", "execute-snapshot", {"data-collections": ["public.orders"]})
    assert inc.take_eager()
    inc.signal("p1", "pause-snapshot", {})
    assert inc.position is not None and inc.position.paused
    assert inc.take_eager()  # saved before its transaction may be confirmed
    assert registry.get_sample_value("walbus_snapshot_paused", {"kind": "incremental"}) == 1
    saved = inc._pending[-1][1]
    assert saved["incremental"]["paused"] is True
    await inc.tick(0)
    assert inc._chunk is None  # paused: no chunk started
    # A restart while paused stays paused.
    again, registry2 = _snapshot(saved)
    assert again.position is not None and again.position.paused
    assert registry2.get_sample_value("walbus_snapshot_paused", {"kind": "incremental"}) == 1
    inc.signal("p2", "pause-snapshot", {})
    assert not inc.take_eager()  # already paused: nothing changed
    inc.signal("r1", "resume-snapshot", {})
    assert not inc.position.paused and inc.take_eager()
    assert registry.get_sample_value("walbus_snapshot_paused", {"kind": "incremental"}) == 0


async def test_a_transactions_signals_apply_together_before_a_chunk_starts() -> None:
    """execute-snapshot and pause-snapshot in one transaction: a batch boundary between the two
    rows started the first chunk before the pause was read (CI met it: the table read at once,
    though the snapshot was "started and paused")."""
    inc, _ = _snapshot()
    inc.signal("s1", "execute-snapshot", {"data-collections": ["public.orders"]})
    await inc.tick(0)  # between batches, inside the signals' transaction
    assert inc._chunk is None
    inc.signal("p1", "pause-snapshot", {})
    assert inc.on_commit(100)
    await inc.tick(0)
    assert inc._chunk is None and inc.position is not None and inc.position.paused


def test_signal_topic_records() -> None:
    sig = read_signal("sigs", 4, OWN, orjson.dumps({"type": "execute-snapshot", "data": {"data-collections": ["public.t"]}}), own_key=OWN)
    assert (sig.sig_id, sig.type, sig.payload, sig.problem, sig.foreign) == (
        "sigs@4", "execute-snapshot", {"data-collections": ["public.t"]}, None, False)
    as_text = read_signal("sigs", 5, OWN, orjson.dumps({"type": "stop-snapshot", "data": '{"data-collections": []}'}), own_key=OWN)
    assert as_text.payload == {"data-collections": []} and as_text.problem is None
    assert read_signal("sigs", 6, OWN, orjson.dumps({"type": "pause-snapshot"}), own_key=OWN).payload == {}
    assert read_signal("sigs", 7, b"walbus.other", b"{}", own_key=OWN).foreign
    assert read_signal("sigs", 8, None, b"{}", own_key=OWN).foreign
    for value in (None, b"", b"not json", b"[1]", b'{"data": {}}', b'{"type": 3}', b'{"type": "x", "data": [1]}',
                  b'{"type": "x", "data": "{oops"}'):
        assert read_signal("sigs", 9, OWN, value, own_key=OWN).problem is not None, value


def test_topic_signals_save_their_offset_with_their_effect() -> None:
    assert _snapshot({"signal_offset": 3, "signal_topic": "old.signals"})[0].signal_offset is None  # another topic's
    inc, registry = _snapshot({"signal_offset": 3, "signal_topic": "sigs"})
    assert inc.signal_offset == 3
    records = [
        read_signal("sigs", 3, OWN, b"garbage", own_key=OWN),
        read_signal("sigs", 4, OWN, orjson.dumps({"type": "execute-snapshot", "data": {"data-collections": ["public.t"]}}), own_key=OWN),
        read_signal("sigs", 5, b"walbus.other", orjson.dumps({"type": "stop-snapshot"}), own_key=OWN),
    ]
    inc.topic_signals(records)
    assert inc.position is not None and inc.position.signal_id == "sigs@4"
    assert inc.take_eager()
    assert inc._pending[-1][1]["signal_offset"] == 6 and inc._pending[-1][1]["signal_topic"] == "sigs"
    started = [doc for _, doc in inc._pending if doc["incremental"] is not None]
    assert started[0]["signal_offset"] == 5  # the execute's own save already counts it consumed
    assert _ignored(registry, "signal-topic") == 1
    inc.reset()  # a new session before anything was saved: back to the saved offset
    assert inc.signal_offset == 3 and inc.position is None


def test_signal_topic_option(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--pg-dsn", "postgresql://u@h/shop", "--kafka-bootstrap", "k:9092"]
    assert load(base).signal_topic is None
    assert load([*base, "--signal-topic", "ops.signals"]).signal_topic == "ops.signals"
    monkeypatch.setenv("WALBUS_PRODUCE_SIGNAL_TOPIC", "env.signals")
    assert load(base).signal_topic == "env.signals"


def test_a_replayed_second_signal_does_not_queue_finished_tables_again() -> None:
    """A second execute-snapshot joins the running one. After a restart the stream replays from
    the confirmed position, which can lie before that signal while the saved position already
    holds its effect: replayed, it must not queue again a table the snapshot has finished."""
    inc, _ = _snapshot()
    inc.signal("s1", "execute-snapshot", {"data-collections": ["public.orders"]})
    inc.signal("s2", "execute-snapshot", {"data-collections": ["public.items", "public.more"]})
    pos = inc.position
    assert pos is not None and pos.tables == ["public.orders", "public.items", "public.more"]
    inc._next_table()
    inc._next_table()  # orders and items are done
    resumed, _ = _snapshot({"incremental": asdict(pos)})
    resumed.signal("s2", "execute-snapshot", {"data-collections": ["public.items", "public.more"]})  # the replay
    assert resumed.position is not None and resumed.position.tables == ["public.more"]
    # Once finished, both signals count as done: a replay of either starts nothing.
    resumed._next_table()
    resumed._finish(aborted=False)
    for sig in ("s1", "s2"):
        resumed.signal(sig, "execute-snapshot", {"data-collections": ["public.items"]})
        assert resumed.position is None


def test_a_replayed_stop_pause_or_resume_is_applied_once() -> None:
    """A stop, then an execute, both saved before the stop's transaction is confirmed: after a
    restart the stream replays the stop, which stopped the newer execute's tables (and the
    execute, done already, was not applied again): the snapshot was lost. Likewise a replayed
    pause paused a snapshot resumed since. (Found by reading the code, after a fuzz.)"""
    inc, _ = _snapshot()
    inc.signal("s1@A", "execute-snapshot", {"data-collections": ["public.orders"]})
    inc.signal("stop@B", "stop-snapshot", {})
    inc.signal("s2@C", "execute-snapshot", {"data-collections": ["public.items"]})
    inc.signal("pause@D", "pause-snapshot", {})
    inc.signal("resume@E", "resume-snapshot", {})
    assert inc.take_eager()
    saved = inc._pending[-1][1]
    resumed, _ = _snapshot(saved)
    for sig_id, kind in (("stop@B", "stop-snapshot"), ("s2@C", "execute-snapshot"), ("pause@D", "pause-snapshot")):
        resumed.signal(sig_id, kind, {"data-collections": ["public.items"]})  # the replay
    assert resumed.position is not None and resumed.position.tables == ["public.items"] and not resumed.position.paused


def test_a_table_asked_for_again_says_it_keeps_its_filter(caplog: pytest.LogCaptureFixture) -> None:
    """An execute-snapshot of a queued table joins the running one: the table keeps its place
    and its first filter. That was silent, so an unfiltered request after a filtered one got
    the filtered snapshot without a word (noted by a fuzz)."""
    inc, _ = _snapshot()
    inc.signal("s1", "execute-snapshot", {"data-collections": ["public.orders"],
                                          "additional-conditions": [{"data-collection": "public.orders", "filter": "id > 5"}]})
    with caplog.at_level("WARNING", logger="walbus.producer.incremental"):
        inc.signal("s2", "execute-snapshot", {"data-collections": ["public.orders"]})
    assert inc.position is not None and inc.position.filters == {"public.orders": "id > 5"}
    (record,) = [r for r in caplog.records if "already queued" in r.getMessage()]
    assert record.filter_not_taken == ["public.orders"]  # type: ignore[attr-defined]


def test_a_change_without_its_key_in_the_window_reads_the_chunk_again(caplog: pytest.LogCaptureFixture) -> None:
    # An update that leaves a TOASTed key column unchanged carries no key (REPLICA IDENTITY
    # DEFAULT: "unchanged", no old key). The window could not drop that row from the chunk, so a
    # read of its older value came after the update and undid it. Now no row of such a chunk is
    # emitted and the chunk is read again; a table that never gets a clean window is given up.
    from producer.codec import EventEncoder
    from producer.decoders import LogicalMessage
    from producer.incremental import CHUNK_REREADS, Chunk, RecentChanges

    inc, registry = _snapshot()
    inc.signal("s1", "execute-snapshot", {"data-collections": ["public.orders"]})
    scan = _scan()
    enc = EventEncoder()
    enc.begin(0x500, 7, "2024-01-01T00:00:00.000000+00:00")

    def chunk_with(change: str) -> list[object]:
        chunk = Chunk("c1", "public.orders", None, scan=scan, rows=[((1,), [1, "old"]), ((2,), [2, "b"])], last_key=["2"])
        inc._chunk = chunk
        inc._recent = inc._recent or RecentChanges("public.orders")
        inc.on_message(LogicalMessage(0x400, WATERMARK_PREFIX, b'{"id":"c1","kind":"low"}', True), False)
        if change == "unknown key":
            inc.observe(enc.encode(scan.relation, "update", 0x450, [None, "new"], unchanged=[0]), 7)
        elif change == "known key":
            inc.observe(enc.encode(scan.relation, "update", 0x450, [1, "new"]), 7)
        high = LogicalMessage(0x600, WATERMARK_PREFIX, b'{"id":"c1","kind":"high"}', True, commit_lsn=0x600, xid=8)
        return list(inc.on_message(high, False))

    assert len(chunk_with("known key")) == 1  # row 1 dropped, row 2 read
    pos = inc.position
    assert pos is not None and pos.last_key == ["2"]
    pos.last_key = None
    assert chunk_with("unknown key") == []  # neither row: row 1 might be the one changed
    assert pos.last_key is None and pos.tables == ["public.orders"]  # the same chunk comes again
    assert "read again" in caplog.text
    assert len(chunk_with("none")) == 2
    for _ in range(CHUNK_REREADS + 1):
        chunk_with("unknown key")
    assert pos.tables == [] and registry.get_sample_value("walbus_snapshot_tables_failed_total", {"kind": "incremental", "table": "public.orders"}) == 1


def test_a_saved_key_of_another_key_type_or_table_reads_the_table_again() -> None:
    """Saved keys are text: under another key type (or in a table created again) they mean
    other rows, so the table is read again from its first key; a position saved before the
    key's identity was kept (no table_oid, no key_types) resumes as it is."""
    old = {"signal_id": "s1", "tables": ["public.orders"], "last_key": ["100"], "max_key": ["5000"], "total_tables": 1}
    inc, registry = _snapshot({"incremental": old})
    pos = inc.position
    assert pos is not None and pos.table_oid is None and pos.key_types is None
    scan = _scan()
    scan.oid = 42
    assert scan.key_types == ["id integer"]
    chunk = Chunk("c", "public.orders", pos.last_key, max_key=pos.max_key, table_oid=pos.table_oid, key_types=pos.key_types)
    inc._check_identity(chunk, scan)
    assert (chunk.after, chunk.max_key, chunk.table_oid, chunk.key_types) == (["100"], ["5000"], 42, ["id integer"])
    labels = {"kind": "incremental", "table": "public.orders"}
    for oid, types in ((42, ["id text"]), (43, ["id integer"])):
        changed = ScanTable(scan.relation, "r", [types[0].split(" ", 1)[1], "text"], oid=oid)
        chunk = Chunk("c", "public.orders", ["100"], max_key=["5000"], table_oid=42, key_types=["id integer"])
        inc._check_identity(chunk, changed)
        assert (chunk.after, chunk.max_key, chunk.table_oid, chunk.key_types) == (None, None, oid, types)
    assert registry.get_sample_value("walbus_snapshot_tables_restarted_total", labels) == 2
    pos.table_oid, pos.key_types = 42, ["id integer"]
    assert Position.load(asdict(pos)) == pos


def test_malformed_watermarks_are_a_warning_a_minute_and_all_counted(caplog: pytest.LogCaptureFixture) -> None:
    """Any login role may emit logical messages with the watermark prefix: they were an error
    line each (550 in one fuzz run). Now a warning, at most one a minute, saying how many
    were held back; the counter counts them all."""
    now = [1000.0]
    inc, registry = _snapshot()
    inc._watermark_log = LogLimit(60.0, clock=lambda: now[0])
    bad = LogicalMessage(1, WATERMARK_PREFIX, b"not json", True)
    with caplog.at_level("INFO", logger="walbus.producer.incremental"):
        for _ in range(550):
            assert inc.on_message(bad, False) == []
            now[0] += 0.1  # 55 s in all
        now[0] += 10
        inc.on_message(bad, False)
    lines = [r for r in caplog.records if r.getMessage().startswith("watermark ignored")]
    assert [(r.levelname, getattr(r, "suppressed", None)) for r in lines] == [("WARNING", 0), ("WARNING", 549)]
    assert _ignored(registry, "watermark") == 551


@pytest.mark.parametrize(("given", "name"), [('public."sig*"', "sig*"), ('public."s[1]"', "s[1]"), ("public.sig?", "sig?"),
                                             ('"my.app"."a.b*"', "a.b*")])
def test_a_signal_table_whose_name_holds_a_wildcard_character_is_that_table(given: str, name: str) -> None:
    # --signal-table 'public."sig*"' was kept as a pattern, text that no event's table field
    # (public.sig*) equals: the producer started (the table exists) and never took a signal.
    from producer.service import Producer
    from walbus.contract import qualify_table

    cfg = ProducerConfig(pg_dsn="dbname=x", kafka_bootstrap="k:1", signal_table=given)
    schema = "my.app" if given.startswith('"my.app"') else "public"
    rel = Relation(1, schema, name, ["id", "type", "data"], ["varchar", "varchar", "text"], [True, False, False], ["id"], "d")
    capture = Producer(cfg).capture
    assert capture.signal_table == rel.qualified == qualify_table(schema, name)
    inc = IncrementalSnapshot(cfg, capture, offsets=OffsetStore({}, "walbus.x", "walbus_x"),
                              metrics=SnapshotMetrics(CollectorRegistry()))
    assert inc.watches(rel.prepare(capture))


def test_a_nullable_key_is_checked_for_nulls_and_left_out_of_the_largest_key() -> None:
    rel = Relation(1, "public", "t", ["id", "code"], ["int4", "text"], [False, False], ["code"], "d",
                   not_null=[True, False]).prepare(CaptureFilter())
    table = ScanTable(rel, "r", ["integer", "text"])
    q = null_key_query(table, "id > 1")
    assert q is not None and q.as_string(None).endswith('WHERE ("public"."t"."code" IS NULL) AND (id > 1) LIMIT 1')
    assert 'WHERE true AND "public"."t"."code" IS NOT NULL ORDER BY' in max_key_query(table).as_string(None)
    assert null_key_query(_scan()) is None  # a primary key: never NULL
