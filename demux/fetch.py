"""Source records in runs, without aiokafka's per-record objects (the demux' fetch path).

Why: aiokafka turns every fetched record into a ``ConsumerRecord`` dataclass of
eleven fields, one generator step and one list append each: 1.3-1.6 µs per record
measured, against 0.3-0.4 µs to read aiokafka's own Cython records (``offset``,
``key``, ``value``) straight from their record batch. That difference was a fifth
of the demux' CPU per event. The demux reads nothing else of a record, so its
consumer takes the records in runs: one list of aiokafka's Cython records per
record batch.

How: aiokafka builds one ``PartitionRecords`` per fetched partition and offers no
hook for this. :class:`RunRecords` subclasses it and :func:`install` puts it in
aiokafka's fetcher module, once. Only a consumer created with
``value_deserializer=RUNS`` gets runs; every other consumer in the process (the
KTable reader, a client) goes through aiokafka's code unchanged. The
``read_committed`` rules are Kafka's (KIP-98), applied per batch where aiokafka
applies them per record, with aiokafka's own helpers: a transactional batch of a
producer in the fetch's aborted list is dropped until that producer's abort
marker; control batches are never returned; records before the fetch offset
(a seek into the middle of a batch) are dropped.
``tests/test_demux_fetch.py`` compares both modes on a real broker.

This leans on aiokafka internals (pinned below 0.15 in pyproject.toml). If they
are not what :func:`install` expects, it says so once in the log and the demux
takes aiokafka's ConsumerRecords, which it reads the same way: slower, not wrong.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from itertools import chain
from typing import Any, Protocol

from aiokafka.consumer import fetcher as _fetcher
from aiokafka.errors import CorruptRecordException

log = logging.getLogger("walbus.demux")


class SourceRecord(Protocol):
    """What the demux reads of a source record: a ConsumerRecord or aiokafka's Cython record."""

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...


def RUNS(value: bytes) -> bytes:  # a marker, named like the constant it is
    """The value deserializer that asks for runs (never called: runs are not deserialized)."""
    return value


_PartitionRecords: Any = _fetcher.PartitionRecords


class RunRecords(_PartitionRecords):  # type: ignore[misc]
    """aiokafka's PartitionRecords; with ``value_deserializer=RUNS``, one list of records per batch."""

    def _unpack_records(self) -> Iterator[Any]:
        if self._value_deserializer is not RUNS:
            yield from super()._unpack_records()
            return
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
            run = list(batch)
            start = self.next_fetch_offset
            if run and run[0].offset < start:
                run = [r for r in run if r.offset >= start]
            # The whole batch is handed over at once: the position moves past it.
            self.next_fetch_offset = batch.next_offset
            if run:
                yield run


_INSTALLED: bool | None = None


def install() -> bool:
    """Put RunRecords in aiokafka's fetcher (once); False when aiokafka is not as expected."""
    global _INSTALLED
    if _INSTALLED is None:
        _INSTALLED = _fits(_fetcher)
        if _INSTALLED:
            _fetcher.PartitionRecords = RunRecords
        else:
            log.warning("this aiokafka's fetcher is not the one the demux' fast fetch path was written for; "
                        "using aiokafka's ConsumerRecords (slower)",
                        extra={"aiokafka_partition_records": repr(_fetcher.PartitionRecords)})
    return _INSTALLED


def _fits(module: Any) -> bool:
    """The internals RunRecords relies on are there, with the shapes it expects."""
    cls = getattr(module, "PartitionRecords", None)
    if cls is RunRecords:
        return True
    if cls is not _PartitionRecords or not hasattr(module, "READ_COMMITTED"):
        return False
    try:
        params = list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return False
    expected = ["self", "tp", "records", "aborted_transactions", "fetch_offset", "key_deserializer",
                "value_deserializer", "check_crcs", "isolation_level"]
    return params == expected and all(
        callable(getattr(cls, name, None)) for name in ("_unpack_records", "_consume_aborted_up_to",
                                                         "_contains_abort_marker"))


def consumer_options() -> dict[str, Any]:
    """The AIOKafkaConsumer options for runs (none when aiokafka does not fit)."""
    return {"value_deserializer": RUNS} if install() else {}


def flatten(items: list[Any]) -> list[SourceRecord]:
    """getmany's list for one partition -> its records in offset order (runs or records alike)."""
    if items and isinstance(items[0], list):
        return list(chain.from_iterable(items))
    return items
