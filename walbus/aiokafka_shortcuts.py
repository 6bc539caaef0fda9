"""Every use walbus makes of aiokafka's internals, in one place, with its version guard.

Five shortcuts, each with a public-API path that is slower but equally correct
(docs/demux.md, "aiokafka shortcuts"):

* runs: a consumer (the demux', a Feed's) hands over one list of aiokafka's Cython
  records per record batch instead of one ConsumerRecord each (scoped to one consumer),
  or (a Feed's) the batch itself, whose records are made as they are reached;
* direct append: records go into aiokafka's Cython batch builder without its
  per-record Python wrapper;
* fenced probe: whether a transactional producer is fenced or broken;
* enqueue now: a record batch joins the producer's queue of a partition whose queue is
  empty at once, as ``send_batch`` would after its awaits (the producer's sink hands a
  partition's next batch over from the acknowledgement of the one before, a callback);
* flat produce requests: a ProduceRequest is encoded with one join of its pieces
  (aiokafka's encoder copies each record batch once per nesting level: ~1.4 ms a
  1 MB request, ~0.35 µs a row of the producer's 2.7); installed in aiokafka's
  sender once, for every producer of the process, only when the probe finds the
  bytes identical to aiokafka's own for every ProduceRequest version it has.

A shortcut is taken only when the installed aiokafka is one of CHECKED_VERSIONS and
a probe of the internals it needs passes; otherwise walbus logs once and takes
the public path (slower, not wrong): an upgrade must not stop the stream.
tests/integration/test_demux_fetch.py fails when an aiokafka upgrade changes what this relies on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any, Final, Protocol

import aiokafka
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.consumer import fetcher as _fetcher
from aiokafka.errors import CorruptRecordException
from aiokafka.producer import sender as _sender
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.producer.transaction_manager import TransactionManager
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.memory_records import MemoryRecords

from walbus.native import native_module

log = logging.getLogger("walbus.kafka")

# (major, minor) releases whose internals the shortcuts were read against and tested with.
CHECKED_VERSIONS: Final = ((0, 14),)
# Passed as every fast record's headers (read only, never changed).
NO_HEADERS: Final[list[tuple[str, bytes]]] = []


class ByteStrings(Protocol):
    """Keys or values for :meth:`OutputBatch.extend`: a list, or a change run's
    walbus_native.Records (one buffer; a ``bytes`` made only when one is read)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> bytes | None: ...


class SourceRecord(Protocol):
    """What walbus reads of a source record: a ConsumerRecord or aiokafka's Cython record."""

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...


def version_checked(version: str) -> bool:
    """Whether an aiokafka version is one of CHECKED_VERSIONS."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in CHECKED_VERSIONS


# -- runs of records -----------------------------------------------------------------------

_PartitionRecords: Any = _fetcher.PartitionRecords


class RunRecords(_PartitionRecords):  # type: ignore[misc]
    """aiokafka's PartitionRecords, yielding one list of records per record batch; for a lazy
    consumer, an iterator instead: over the batch itself (making each record when it is
    reached), or over the records after a seek that landed inside it.

    The read_committed rules are Kafka's (KIP-98) applied per batch with aiokafka's
    own helpers: a transactional batch of an aborted producer is dropped until its
    abort marker, control batches are never returned, records before the fetch
    offset (a seek into a batch) are dropped.

    Lazy batches keep the records a fetch brought from being made all at once: a consumer
    that holds thousands of them while it works through them has the garbage collector
    promote them to its oldest generation, and each full collection then walks the whole
    heap (measured on bench.client, 300k events: the Feed ran 6 full collections, ~0.25 µs an
    event, and ~720 young ones; with lazy batches, 2 young ones and no full one).
    """

    _lazy = False

    def _unpack_records(self) -> Iterator[list[Any] | Iterator[Any]]:
        records = self._records
        read_committed = self._isolation_level == _fetcher.READ_COMMITTED
        while records.has_next():
            batch = records.next_batch()
            if self._check_crcs and not batch.validate_crc():
                raise CorruptRecordException(f"Invalid CRC - {self._tp}")
            if read_committed and batch.producer_id is not None:
                self._consume_aborted_up_to(batch.base_offset)
                if batch.is_control_batch and self._contains_abort_marker(batch):
                    self._aborted_producers.discard(batch.producer_id)
                if batch.is_transactional and batch.producer_id in self._aborted_producers:
                    self.next_fetch_offset = batch.next_offset
                    continue
            if batch.is_control_batch:
                self.next_fetch_offset = batch.next_offset
                continue
            start = self.next_fetch_offset
            # The whole batch is handed over at once: the position moves past it.
            self.next_fetch_offset = batch.next_offset
            if self._lazy and batch.base_offset >= start:
                # Its records are made as the caller reaches them. aiokafka's batch takes one
                # iter() only: this iterator of its __next__ can be handed to islice and the like.
                yield iter(iter(batch).__next__, None)
                continue
            run = list(batch)
            if run and run[0].offset < start:
                run = [r for r in run if r.offset >= start]
            if run:
                # A lazy consumer is handed iterators only: it takes a few records at a time
                # and comes back for more (a list would start over from its first record).
                yield iter(run) if self._lazy else run


def _as_runs(partition_records: Any, lazy: bool) -> None:
    """Turn a fresh (unread) PartitionRecords into RunRecords, in place."""
    partition_records.__class__ = RunRecords
    partition_records._lazy = lazy
    partition_records._records_iterator = partition_records._unpack_records()


class _RunsBuffer(OrderedDict[Any, Any]):
    """One consumer's fetch buffer (aiokafka's ``Fetcher._records``): what is put in it comes out as runs."""

    lazy = False

    def __setitem__(self, tp: Any, result: Any) -> None:
        if isinstance(result, _fetcher.FetchResult) and type(result._partition_records) is _PartitionRecords:
            _as_runs(result._partition_records, self.lazy)
        super().__setitem__(tp, result)


def _probe_runs() -> bool:
    """The fetcher internals read_in_runs relies on are there, with the shapes it expects."""
    try:
        params = list(inspect.signature(_PartitionRecords.__init__).parameters)
        if params != ["self", "tp", "records", "aborted_transactions", "fetch_offset", "key_deserializer",
                      "value_deserializer", "check_crcs", "isolation_level"]:
            return False
        if not all(callable(getattr(_PartitionRecords, name, None))
                   for name in ("_consume_aborted_up_to", "_contains_abort_marker")):
            return False
        tp = TopicPartition("probe", 0)
        records = _PartitionRecords(tp, MemoryRecords(b""), None, 7, None, None, True, _fetcher.READ_COMMITTED)
        result = _fetcher.FetchResult(tp, assignment=None, partition_records=records, backoff=0)
        buffer = _RunsBuffer()
        buffer[tp] = result
        return (result._partition_records is records and type(records) is RunRecords
                and list(records) == [] and records.next_fetch_offset == 7)
    except Exception:  # another aiokafka
        log.debug("probing aiokafka's fetcher failed", exc_info=True)
        return False


def read_in_runs(consumer: AIOKafkaConsumer, *, lazy: bool = False) -> bool:
    """From now on this started consumer's getmany returns runs; False: it keeps ConsumerRecords.

    With ``lazy`` a run is a record batch iterator (each iterated once, in order) rather
    than a list. Call it right after ``start()``: a fetch already buffered is converted too.
    No other consumer of the process is affected.
    """
    fetcher = getattr(consumer, "_fetcher", None)
    buffer = getattr(fetcher, "_records", None)
    if not SHORTCUTS.runs or type(buffer) is not OrderedDict:
        return False
    runs = _RunsBuffer()
    runs.lazy = lazy
    for tp, result in buffer.items():
        runs[tp] = result
    fetcher._records = runs  # type: ignore[union-attr]
    return True


# Turns of the event loop aiokafka's fetcher needs, after getmany took a partition's records,
# to send the next fetch for it: its routine wakes on the consume signal (asyncio.wait's
# callback, then the routine's step), starts a task per node, and that task's first step writes
# the request. Public behaviour, not internals: with fewer turns the fetch only goes out later.
FETCH_SEND_TURNS: Final = 4


async def send_next_fetch() -> None:
    """Let a consumer's fetcher send its next fetch request now, right after getmany returned
    records: the answer then arrives while the caller handles these, instead of after it.

    For a caller whose hot path never yields to the loop (a Feed, the demux): measured on
    ``bench.client`` (300k events, 5 rounds), the Feed went from 0.70-0.74 to 0.82-0.87 of
    a raw consumer's rate."""
    for _ in range(FETCH_SEND_TURNS):
        await asyncio.sleep(0)


def flatten(items: list[Any]) -> list[SourceRecord]:
    """getmany's list for one partition -> its records in offset order (runs or records alike)."""
    if items and isinstance(items[0], list):
        return list(chain.from_iterable(items))
    return items


# -- output batches ------------------------------------------------------------------------


# Kafka's codec ids that walbus_native's record batches write (none, LZ4).
NATIVE_CODECS: Final = (0, 3)


class NativeBatch(BatchBuilder):  # type: ignore[misc]
    """aiokafka's BatchBuilder over walbus_native's RecordBatchBuilder (record batches built
    in Rust from whole runs of records, uncompressed or LZ4): aiokafka's accumulator and
    sender call the methods below as they would on their own batch (:func:`native_batch`
    makes one)."""

    def __init__(self, batch_size: int, transactional: bool, compression: int = 0) -> None:  # no super(): no Cython builder
        self._builder: Any = native_module().RecordBatchBuilder(batch_size, transactional, compression)
        self._relative_offset = 0
        self._buffer: bytes | None = None
        self._closed = False
        self._key_serializer = self._value_serializer = None

    def append(self, *, timestamp: int | None, key: bytes | None, value: bytes | None,
               headers: Any = NO_HEADERS) -> Any:
        # aiokafka's public append: walbus's sinks use OutputBatch; nothing else may add to this batch.
        raise TypeError("a NativeBatch is filled through OutputBatch")

    def _set_producer_state(self, producer_id: int, producer_epoch: int, base_sequence: int) -> None:
        self._builder.set_producer_state(producer_id, producer_epoch, base_sequence)

    def _build(self) -> bytes:
        self.close()
        if self._buffer is None:
            self._buffer = self._builder.build()
        return self._buffer

    def size(self) -> int:
        return len(self._buffer) if self._buffer is not None else int(self._builder.size())

    def record_count(self) -> int:
        return int(self._builder.record_count())


def drop_pending(producer: AIOKafkaProducer, error: Exception) -> None:
    """Fail every batch the producer has not delivered yet with ``error``: its ``stop()``
    flushes them first, and one that can never be delivered (its topic deleted meanwhile)
    held that stop forever (a fuzz). For a producer whose pending records nobody wants any
    more (an aborted transaction's)."""
    acc = getattr(producer, "_message_accumulator", None)
    fail_all = getattr(acc, "fail_all", None)
    if not callable(fail_all):
        return
    queued: Any = getattr(acc, "_batches", {})
    batches = [b for q in queued.values() for b in q] + list(getattr(acc, "_pending_batches", ()))
    fail_all(error)
    for batch in batches:  # seen here, not logged as "Future exception was never retrieved"
        for fut in (getattr(batch, "future", None), getattr(batch, "_drain_waiter", None)):
            if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
                fut.exception()


def _accumulator_settings(producer: AIOKafkaProducer) -> tuple[int, bool, int] | None:
    """(batch size, transactional, codec id) of the producer's batches when they are
    unserialized and uncompressed or LZ4 (what a NativeBatch builds), as its create_batch()
    would make them."""
    acc = getattr(producer, "_message_accumulator", None)
    size, compression = getattr(acc, "_batch_size", None), getattr(acc, "_compression_type", None)
    if not isinstance(size, int) or compression not in NATIVE_CODECS:
        return None
    if getattr(producer, "_key_serializer", None) is not None or getattr(producer, "_value_serializer", None) is not None:
        return None
    txn = getattr(acc, "_txn_manager", None)
    return size, txn is not None and txn.transactional_id is not None, compression


def native_batch(producer: AIOKafkaProducer) -> BatchBuilder | None:
    """An empty NativeBatch for ``producer.send_batch``, or None: the extension is not there,
    its batches do not read back as aiokafka's own (probed once per codec), or the producer
    compresses with a codec other than LZ4."""
    settings = _accumulator_settings(producer)
    if settings is None or not _native_batches(settings[2]):
        return None
    return NativeBatch(*settings)


@functools.cache
def _native_batches(compression: int = 0) -> bool:
    """walbus_native's record batches (with this codec) read back as aiokafka's own hold the
    same records, with a valid CRC and the producer state aiokafka's sender sets."""
    module = native_module()
    if module is None or not hasattr(module, "RecordBatchBuilder"):
        return False
    try:
        records = [(b"k1", b"v1" * 300), (None, b"v2"), (b"k3", None), (b"", b"")]
        theirs = BatchBuilder(16384, compression, is_transactional=1)
        ours = NativeBatch(16384, True, compression)
        for key, value in records:
            theirs.append(timestamp=None, key=key, value=value)
        if ours._builder.extend([k for k, _ in records], [v for _, v in records], 0) != len(records):
            return False
        for b in (theirs, ours):
            b._set_producer_state(12345, 7, 99)
        built = [MemoryRecords(bytes(b._build())).next_batch() for b in (theirs, ours)]
        fields = [(b.validate_crc(), b.compression_type, b.producer_id, b.producer_epoch, b.base_sequence, b.is_transactional,
                   [(r.offset, r.key, r.value, r.headers) for r in b]) for b in built]
        if fields[0] != fields[1] or not fields[1][0] or ours.record_count() != len(records):
            log.warning("walbus_native's record batches differ from aiokafka's: building them in Python",
                        extra={"aiokafka": aiokafka.__version__, "compression": compression})
            return False
        return True
    except Exception:  # another aiokafka
        log.warning("probing walbus_native's record batches failed: building them in Python", exc_info=True)
        return False


class OutputBatch:
    """An aiokafka record batch for ``send_batch``, filled without its per-record wrapper.

    Over a :class:`NativeBatch` (``native``), :meth:`extend` hands whole runs to Rust.
    Otherwise the hot loop appends with ``records.append(count, None, key, value, NO_HEADERS)``
    (the Cython builder: None when full) and then ``count += 1``; :meth:`for_send`
    hands aiokafka the batch with its record count. Without the direct-append
    shortcut ``records`` is None and :meth:`append` takes aiokafka's public append.
    """

    __slots__ = ("batch", "count", "native", "records")

    def __init__(self, size: int, *, batch: Any = None) -> None:
        # As AIOKafkaProducer.create_batch with max_batch_size=size (no compression):
        # the demux sizes batches per topic (its max.message.bytes).
        self.batch = BatchBuilder(size, 0, is_transactional=1) if batch is None else batch
        self.native: Any = self.batch._builder if isinstance(self.batch, NativeBatch) else None
        self.records: Any = self.batch._builder if SHORTCUTS.direct_append and self.native is None else None
        self.count = 0

    @classmethod
    def around(cls, batch: Any) -> OutputBatch:
        """An empty batch from ``producer.create_batch()`` (its size, compression and
        transactional flag), filled the same way."""
        return cls(0, batch=batch)

    def append(self, key: bytes | None, value: bytes | None,
               headers: list[tuple[str, bytes]] = NO_HEADERS) -> bool:
        """Append one record; False when the batch is full."""
        native = self.native
        if native is not None:
            if headers:
                raise TypeError("a NativeBatch takes records without headers")
            if not native.append(key, value):
                return False
            self.count += 1
            return True
        records = self.records
        if records is None:
            if self.batch.append(timestamp=None, key=key, value=value, headers=headers) is None:
                return False
        elif records.append(self.count, None, key, value, headers) is None:
            return False
        self.count += 1
        return True

    def extend(self, keys: ByteStrings, values: ByteStrings, start: int = 0) -> int:
        """Append ``zip(keys, values)[start:]`` until the batch is full; how many it took.
        A native batch copies a change run's ``Records`` without a ``bytes`` each."""
        if self.native is not None:
            taken: int = self.native.extend(keys, values, start)
            self.count += taken
            return taken
        records, count = self.records, self.count
        i, end = start, len(keys)
        if records is None:
            append = self.batch.append
            while i < end and append(timestamp=None, key=keys[i], value=values[i], headers=NO_HEADERS) is not None:
                i += 1
        else:
            append = records.append
            while i < end and append(count, None, keys[i], values[i], NO_HEADERS) is not None:
                count += 1
                i += 1
        self.count = count + (i - start if records is None else 0)
        return i - start

    def for_send(self) -> Any:
        """The closed aiokafka BatchBuilder, counting the records appended directly."""
        if self.records is not None:  # (a NativeBatch counts its own records)
            self.batch._relative_offset = self.count
        self.batch.close()
        return self.batch


def _probe_direct_append() -> bool:
    """A batch filled directly holds what one filled by BatchBuilder.append holds, and counts alike."""
    try:
        records = [(b"k1", b"v1"), (None, b"v2"), (b"k3", None)]
        public = BatchBuilder(16384, 0, is_transactional=1)
        direct = BatchBuilder(16384, 0, is_transactional=1)
        builder = direct._builder
        for at, (key, value) in enumerate(records):
            public.append(timestamp=None, key=key, value=value)
            if builder.append(at, None, key, value, NO_HEADERS) is None:
                return False
        direct._relative_offset = len(records)

        def content(batch: Any) -> list[tuple[int, bytes | None, bytes | None]]:
            built = MemoryRecords(bytes(batch._build())).next_batch()
            return [(r.offset, r.key, r.value) for r in built]  # timestamps differ: each append reads the clock

        return (content(public) == content(direct) == [(i, k, v) for i, (k, v) in enumerate(records)]
                and public.record_count() == direct.record_count() == len(records))
    except Exception:  # another aiokafka
        log.debug("probing aiokafka's BatchBuilder failed", exc_info=True)
        return False


def _probe_enqueue() -> bool:
    from aiokafka.producer.message_accumulator import MessageAccumulator

    return callable(getattr(MessageAccumulator, "_append_batch", None)) and "builder" in inspect.signature(
        MessageAccumulator._append_batch).parameters


def enqueue_batch(producer: AIOKafkaProducer, builder: BatchBuilder, tp: TopicPartition) -> asyncio.Future[Any] | None:
    """Put ``builder`` in the producer's queue of ``tp`` now and return its delivery future, as
    ``send_batch`` does once the partition's queue is empty (its topic's metadata known: the
    caller sent it a batch before); None when that is not so or the shortcut is off: then
    ``send_batch``. No await: called from a callback, the batch is queued before aiokafka's
    sender looks at its queues again."""
    if not SHORTCUTS.enqueue:
        return None
    acc = getattr(producer, "_message_accumulator", None)
    if acc is None or acc._closed or acc._exception is not None or acc._batches.get(tp):
        return None
    batch = acc._append_batch(builder, tp)
    future: asyncio.Future[Any] = batch.future
    return future


# -- transaction-manager probe -------------------------------------------------------------


def _probe_fenced() -> bool:
    return all(callable(getattr(TransactionManager, name, None))
               for name in ("is_fatal_error", "wait_for_transaction_end"))


def fenced(producer: AIOKafkaProducer) -> bool:
    """True when the transactional producer is fenced or broken: nothing left to abort on our side.

    Without the shortcut: False (the abort is tried, fails and is logged).
    """
    txn = getattr(producer, "_txn_manager", None) if SHORTCUTS.fenced else None
    if not isinstance(txn, TransactionManager) or not txn.is_fatal_error():
        return False
    # aiokafka parks the fatal error on the transaction waiter; nobody else awaits it.
    waiter = txn.wait_for_transaction_end()
    if isinstance(waiter, asyncio.Future) and waiter.done() and not waiter.cancelled():
        waiter.exception()
    return True


# -- flat produce requests -----------------------------------------------------------------

_STR_LEN = struct.Struct(">h")
_ACKS_TIMEOUT = struct.Struct(">hi")
_COUNT = struct.Struct(">i")
_PARTITION_SIZE = struct.Struct(">ii")


def encode_produce(version: int, transactional_id: str | None, acks: int, timeout: int,
                   topics: list[tuple[str, list[tuple[int, Any]]]]) -> bytes:
    """A ProduceRequest's body (v0-v8 layout: not flexible), as one join of its pieces: each
    record batch is copied once, where aiokafka's nested encoders copy it once per level."""
    parts: list[Any] = []
    if version >= 3:
        if transactional_id is None:
            parts.append(_STR_LEN.pack(-1))
        else:
            tid = transactional_id.encode()
            parts += (_STR_LEN.pack(len(tid)), tid)
    parts.append(_ACKS_TIMEOUT.pack(acks, timeout))
    parts.append(_COUNT.pack(len(topics)))
    for topic, partitions in topics:
        name = topic.encode()
        parts += (_STR_LEN.pack(len(name)), name, _COUNT.pack(len(partitions)))
        for partition, records in partitions:
            if records is None:
                parts.append(_PARTITION_SIZE.pack(partition, -1))
            else:
                parts += (_PARTITION_SIZE.pack(partition, len(records)), records)
    return b"".join(parts)


@functools.cache
def _flat_struct(struct_class: Any) -> type[Any]:
    """aiokafka's request struct class of one ProduceRequest version, encoded flat."""
    version = struct_class.API_VERSION

    def encode(self: Any) -> bytes:
        fields = self.__dict__
        return encode_produce(version, fields.get("transactional_id"), fields["required_acks"], fields["timeout"], fields["topics"])

    return type(struct_class.__name__, (struct_class,), {"encode": encode, "__module__": __name__})


class FlatProduceRequest(ProduceRequest):  # type: ignore[misc]
    """aiokafka's ProduceRequest whose struct (the version both sides speak) encodes flat."""

    def build(self, request_struct_class: Any) -> Any:
        if getattr(request_struct_class, "FLEXIBLE_VERSION", False):  # compact encodings: aiokafka's own
            return super().build(request_struct_class)
        return super().build(_flat_struct(request_struct_class))


def _probe_flat_produce() -> bool:
    """For every ProduceRequest version aiokafka has, the flat body is aiokafka's own, byte for
    byte (several topics and partitions, a transactional id or none, any buffer type)."""
    try:
        installed: Any = getattr(_sender, "ProduceRequest", None)
        if installed is not ProduceRequest:
            return False
        theirs_class: Any = ProduceRequest
        records: list[tuple[int, Any]] = [(0, b"\x00batch" * 40), (3, bytearray(b"second")), (7, memoryview(b"third"))]
        topics: list[tuple[str, list[tuple[int, Any]]]] = [("db.t\u00e9st", records), ("other", [(1, b"")])]
        seen = 0
        for struct_class in theirs_class._CLASSES:
            for tid in ((None, "walbus-\u00e9") if struct_class.API_VERSION >= 3 else (None,)):
                theirs = theirs_class(transactional_id=tid, required_acks=-1, timeout=30000, topics=topics).build(struct_class)
                ours = FlatProduceRequest(transactional_id=tid, required_acks=-1, timeout=30000, topics=topics).build(struct_class)
                if ours.encode() != theirs.encode() or type(ours).API_VERSION != struct_class.API_VERSION:
                    return False
                seen += 1
        return seen > 0
    except Exception:  # another aiokafka
        log.debug("probing aiokafka's ProduceRequest failed", exc_info=True)
        return False


# -- the guard -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shortcuts:
    """Which shortcuts this process takes (decided once, at import)."""

    version: str
    runs: bool
    direct_append: bool
    fenced: bool
    flat_produce: bool = False
    enqueue: bool = False

    def as_labels(self) -> dict[str, bool]:
        return {"runs": self.runs, "direct_append": self.direct_append, "fenced_probe": self.fenced,
                "flat_produce": self.flat_produce, "enqueue": self.enqueue}


def _decide(version: str) -> Shortcuts:
    if not version_checked(version):
        log.warning("aiokafka %s is not one walbus's shortcuts were checked against; using its public API "
                    "(slower)", version, extra={"aiokafka": version, "checked": [list(v) for v in CHECKED_VERSIONS]})
        return Shortcuts(version, runs=False, direct_append=False, fenced=False)
    shortcuts = Shortcuts(version, runs=_probe_runs(), direct_append=_probe_direct_append(), fenced=_probe_fenced(),
                          flat_produce=_probe_flat_produce(), enqueue=_probe_enqueue())
    off = [name for name, on in shortcuts.as_labels().items() if not on]
    if off:
        log.warning("aiokafka's internals are not what walbus's shortcuts expect; using its public API for them "
                    "(slower)", extra={"aiokafka": version, "shortcuts_off": off})
    return shortcuts


SHORTCUTS: Final = _decide(aiokafka.__version__)
if SHORTCUTS.flat_produce:
    # aiokafka's sender builds each produce request through this module-level name.
    _sender.ProduceRequest = FlatProduceRequest
