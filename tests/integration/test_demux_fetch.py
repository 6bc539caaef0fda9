"""The demux' shortcuts through aiokafka's internals (walbus.aiokafka_shortcuts) and its version guard.

The unit tests fail when an aiokafka upgrade changes what the adapter relies on;
runs of aiokafka's records equal its ConsumerRecords against the real broker, on a
topic that mixes plain batches with committed, aborted and interleaved transactions,
read from the start and from inside a batch.
"""

from __future__ import annotations

import asyncio
import time
import types
import uuid
from pathlib import Path
from typing import Any

import aiokafka
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.consumer import fetcher
from aiokafka.errors import ProducerFenced
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.producer.transaction_manager import TransactionState
from aiokafka.record.memory_records import MemoryRecords

import demux.service
from demux.config import DemuxConfig
from demux.service import Demux
from tests.support.demux import ev
from tests.support.kafka import create_topic, end_offsets, produce, read_records
from walbus import aiokafka_shortcuts as adapter
from walbus.metrics import new_registry

Row = tuple[int, bytes | None, bytes | None]


def test_the_installed_aiokafka_is_checked_and_every_shortcut_fits() -> None:
    """Fails on an aiokafka upgrade until its internals are checked again (then CHECKED_VERSIONS grows)."""
    assert adapter.version_checked(aiokafka.__version__), aiokafka.__version__
    assert adapter.Shortcuts(aiokafka.__version__, runs=True, direct_append=True, fenced=True, flat_produce=True,
                             enqueue=True) == adapter.SHORTCUTS
    assert adapter._probe_runs() and adapter._probe_direct_append() and adapter._probe_fenced() and adapter._probe_enqueue()
    assert adapter._sender.ProduceRequest is adapter.FlatProduceRequest  # installed: every producer sends flat requests


def test_version_guard() -> None:
    assert adapter.version_checked("0.14.0") and adapter.version_checked("0.14.3")
    assert not adapter.version_checked("0.15.0") and not adapter.version_checked("0.13.1")
    assert not adapter.version_checked("1.0") and not adapter.version_checked("garbage")
    # Outside the checked versions every shortcut is off, whatever the probes would say.
    assert adapter._decide("0.15.0") == adapter.Shortcuts("0.15.0", runs=False, direct_append=False, fenced=False)


def test_runs_touch_no_module_of_aiokafka() -> None:
    """Runs are per consumer: aiokafka's fetcher module keeps its own PartitionRecords."""
    assert fetcher.PartitionRecords is not adapter.RunRecords
    assert fetcher.PartitionRecords is adapter._PartitionRecords


def test_flatten_takes_runs_and_records_alike() -> None:
    a, b, c = types.SimpleNamespace(offset=1), types.SimpleNamespace(offset=2), types.SimpleNamespace(offset=3)
    assert adapter.flatten([[a, b], [c]]) == [a, b, c]
    assert adapter.flatten([a, b, c]) == [a, b, c]
    assert adapter.flatten([]) == []


def _filled(batch: adapter.OutputBatch) -> list[tuple[int, bytes | None, bytes | None]]:
    built = MemoryRecords(bytes(batch.for_send()._build())).next_batch()
    return [(r.offset, r.key, r.value) for r in built]


def test_direct_append_fills_a_batch_as_aiokafkas_append_does() -> None:
    direct, public = adapter.OutputBatch(2048), BatchBuilder(2048, 0, is_transactional=1)
    assert direct.records is not None  # the direct path, as in the demux' hot loop
    n = 0
    while direct.records.append(direct.count, None, f"k{n}".encode(), b"x" * 100, adapter.NO_HEADERS) is not None:
        direct.count = n = n + 1
    m = 0
    while public.append(timestamp=None, key=f"k{m}".encode(), value=b"x" * 100) is not None:
        m += 1
    assert direct.append(b"k99", b"x" * 100) is False  # full, through append() too
    sent = direct.for_send()
    assert 10 <= n == m == sent.record_count() and sent.closed()  # full at the same record, counted alike


def test_output_batch_mixes_direct_and_general_appends() -> None:
    batch = adapter.OutputBatch(16384)
    assert batch.append(b"k0", b"v0")
    assert batch.records.append(batch.count, None, b"k1", None, adapter.NO_HEADERS) is not None
    batch.count += 1
    assert batch.append(None, b"v2", [("h", b"x")])
    assert _filled(batch) == [(0, b"k0", b"v0"), (1, b"k1", None), (2, None, b"v2")]


def test_output_batch_without_the_shortcut_uses_the_public_append(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "SHORTCUTS", adapter._decide("0.99.0"))
    batch = adapter.OutputBatch(16384)
    assert batch.records is None
    assert batch.append(b"k0", b"v0") and batch.append(None, b"v1")
    assert batch.for_send().record_count() == 2
    assert _filled(adapter.OutputBatch(16384)) == []


@pytest.mark.parametrize("direct", [True, False])
def test_output_batch_extend_takes_records_until_full_from_where_it_is_told(direct: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's insert runs: extend() appends from ``start`` until the batch is full, and
    counts what it took as append() one by one does (the shortcut and the public path alike)."""
    if not direct:
        monkeypatch.setattr(adapter, "SHORTCUTS", adapter._decide("0.99.0"))
    keys = [f"k{i}".encode() for i in range(100)]
    values = [b"x" * 100] * 100
    first = adapter.OutputBatch(2048)
    assert (first.records is not None) is direct
    assert first.append(b"before", b"v")
    took = first.extend(keys, values, 3)
    one_by_one = adapter.OutputBatch(2048)
    assert one_by_one.append(b"before", b"v")
    n = 3
    while one_by_one.append(keys[n], values[n]):
        n += 1
    assert 5 <= took == n - 3 and first.count == one_by_one.count == took + 1
    assert _filled(first) == [(0, b"before", b"v"), *[(i - 2, keys[i], values[i]) for i in range(3, n)]]
    rest = adapter.OutputBatch(2048)
    assert rest.extend(keys, values, 3 + took) > 0  # the next batch goes on from there
    assert _filled(rest)[0] == (0, keys[3 + took], values[3 + took])
    assert adapter.OutputBatch(2048).extend(keys, values, 100) == 0


async def test_fenced_probe_reads_the_transaction_manager() -> None:
    """A fenced producer is seen as such (no abort is tried); its parked error does not go unretrieved."""
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", transactional_id="probe")  # never started
    plain = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
    try:
        assert adapter.fenced(producer) is False and adapter.fenced(plain) is False
        txn = producer._txn_manager
        txn.state = TransactionState.READY  # as after InitProducerId
        txn.begin_transaction()
        txn.fatal_error(ProducerFenced())
        assert adapter.fenced(producer) is True
        waiter = txn.wait_for_transaction_end()
        assert waiter.done() and isinstance(waiter.exception(), ProducerFenced)
    finally:
        await producer.stop()
        await plain.stop()


async def _write_mixed(bootstrap: str, topic: str) -> None:
    """Plain batches, committed and aborted transactions, one interleaved with plain records."""
    def recs(tag: str, n: int) -> list[tuple[bytes, bytes]]:
        return [(f"{tag}-{i}".encode(), f"value {tag} {i}".encode() * (1 + i % 3)) for i in range(n)]

    await produce(bootstrap, topic, recs("plain-a", 60), partition=0)
    plain = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    txn = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"fetch-test-{uuid.uuid4().hex[:8]}")
    await plain.start()
    await txn.start()
    try:
        for tag, commit in (("t-commit-1", True), ("t-abort-1", False), ("t-abort-2", False), ("t-commit-2", True)):
            await txn.begin_transaction()
            for k, v in recs(tag, 25):
                await txn.send(topic, key=k, value=v, partition=0)
            # Plain records while the transaction is open: they stay, whatever it becomes.
            for k, v in recs(f"plain-during-{tag}", 7):
                await (await plain.send(topic, key=k, value=v, partition=0))
            if commit:
                await txn.commit_transaction()
            else:
                await txn.abort_transaction()
        await (await plain.send(topic, key=None, value=b"keyless", partition=0))
        await (await plain.send(topic, key=b"tombstone", value=None, partition=0))
    finally:
        await txn.stop()
        await plain.stop()
    # Compressed batches last (a walbus producer may compress): the batch decompresses when iterated.
    gzipped = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", compression_type="gzip", linger_ms=20)
    await gzipped.start()
    try:
        await asyncio.gather(*[await gzipped.send(topic, key=k, value=v, partition=0) for k, v in recs("gzip", 40)])
    finally:
        await gzipped.stop()


async def _read(bootstrap: str, topic: str, *, runs: bool, isolation: str, start: int, lazy: bool = False) -> list[Row]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation, enable_auto_commit=False,
                                max_partition_fetch_bytes=2048)  # small fetches: many of them
    await consumer.start()
    assert adapter.read_in_runs(consumer, lazy=lazy) if runs else True
    # Lazy batches are iterated only at the end, long after the fetches that brought them.
    held: list[Any] = []
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, start)
        end = (await consumer.end_offsets([tp]))[tp]  # read_committed: the last stable offset
        out: list[Row] = []
        deadline = time.monotonic() + 30
        while await consumer.position(tp) < end:
            assert time.monotonic() < deadline, f"reading {topic} timed out at {await consumer.position(tp)} < {end}"
            got = await consumer.getmany(timeout_ms=500)
            items = got.get(tp, [])
            if lazy:
                held += items
                continue
            if runs and items:
                assert all(isinstance(run, list) for run in items), "runs asked for, records returned"
            out += [(r.offset, r.key, r.value) for r in adapter.flatten(items)]
        if lazy:
            # iterators only, a seek inside a batch too: the Feed takes a few records at a time
            assert held and not any(isinstance(run, list) for run in held), "a lazy consumer was handed a list"
            out = [(r.offset, r.key, r.value) for run in held for r in run]
        return out
    finally:
        await consumer.stop()


@pytest.mark.integration
async def test_runs_equal_aiokafkas_records(kafka_bootstrap: str, unique_name: str) -> None:
    topic = f"fetch.{unique_name}"
    await create_topic(kafka_bootstrap, topic)
    await _write_mixed(kafka_bootstrap, topic)
    for isolation in ("read_committed", "read_uncommitted"):
        for start in (0, 17, 75):  # 17: inside the first batch; 75: inside the transactions
            want = await _read(kafka_bootstrap, topic, runs=False, isolation=isolation, start=start)
            got = await _read(kafka_bootstrap, topic, runs=True, isolation=isolation, start=start)
            assert got == want, (isolation, start)
            lazy = await _read(kafka_bootstrap, topic, runs=True, isolation=isolation, start=start, lazy=True)
            assert lazy == want, (isolation, start, "lazy")
            values = [v for _, _, v in want]
            assert want[0][0] >= start and b"keyless" in values and None in values
            aborted = [k for _, k, _ in want if k is not None and k.startswith(b"t-abort")]
            # The topic really has both kinds, or the comparison proves little.
            assert any(k is not None and k.startswith(b"t-commit") for _, k, _ in want)
            assert any(k is not None and k.startswith(b"gzip") for _, k, _ in want)
            assert (aborted == []) == (isolation == "read_committed"), isolation


@pytest.mark.integration
async def test_demux_output_is_the_same_on_both_fetch_paths(
        kafka_bootstrap: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole demux through runs, then through aiokafka's ConsumerRecords (its fallback)."""
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    table = "public.transactions"
    types_ = {"id": "int4", "n": "int4"}
    events = [ev(0x1000 + 0x10 * i, 0, "insert", table, ["id"], new={"id": i % 300, "n": i}, types=types_)
              for i in range(1500)]
    events += [ev(0x900000 + 0x10 * i, 0, "delete", table, ["id"], identity={"id": i}, types=types_) for i in range(50)]
    events.append((b"not-a-position", b"not json"))  # a dead letter, on both paths
    await produce(kafka_bootstrap, source, events, partition=0)
    total = (await end_offsets(kafka_bootstrap, source))[0]

    async def run(prefix: str) -> list[Row]:
        config = DemuxConfig(kafka_bootstrap=kafka_bootstrap, source_topic=source, topic_prefix=prefix,
                             database=unique_name, group_id=f"g-{prefix}-{unique_name}", state_dir=str(tmp_path / prefix),
                             txn_max_records=400, dlq_topic=f"{source}.{prefix}.dlq")
        registry = new_registry()
        demux_ = Demux(config, registry=registry)
        task = asyncio.create_task(demux_.run())
        deadline = time.monotonic() + 60
        while (registry.get_sample_value("walbus_demux_records_consumed_total", {"partition": "0"}) or 0) < total:
            assert not task.done(), task.exception() if task.done() else None
            assert time.monotonic() < deadline, "the demux did not consume the source topic"
            await asyncio.sleep(0.05)
        demux_.stop()
        await task
        assert registry.get_sample_value("walbus_demux_dead_letters_total", {"reason": "contract"}) == 1
        recs = await read_records(kafka_bootstrap, f"{prefix}.{unique_name}.{table}")
        return [(r.offset, r.key, r.value) for r in recs]

    with_runs = await run("runs")
    monkeypatch.setattr(demux.service, "read_in_runs", lambda consumer: False)  # aiokafka's ConsumerRecords
    with_records = await run("records")
    assert len(with_runs) == 1550
    # Same keys and values in the same order (values carry no per-run field).
    assert [(k, v) for _, k, v in with_runs] == [(k, v) for _, k, v in with_records]
