"""Prometheus metrics of the demux (built on a registry passed in, so tests can read them)."""

from __future__ import annotations

import logging
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("walbus.demux")


class DemuxMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.consumed = Counter(
            "walbus_demux_records_consumed", "Source records consumed (committed)", ["partition"], registry=registry
        )
        self.produced = Counter(
            "walbus_demux_records_produced", "Records produced to per-table topics (committed)", ["table"],
            registry=registry,
        )
        self.tombstones = Counter(
            "walbus_demux_tombstones", "Tombstones produced (committed)", ["table"], registry=registry
        )
        self.dead_letters = Counter(
            "walbus_demux_dead_letters", "Source records sent to the dead-letter topic", ["reason"],
            registry=registry,
        )
        self.unwritten_outputs = Counter(
            "walbus_demux_unwritten_outputs",
            "Events whose output could not be written (too large for its topic, topic refused): "
            "sent to the dead-letter topic", ["table", "reason"], registry=registry,
        )
        self.no_pk_events = Counter(
            "walbus_demux_no_pk_events", "Events of tables without a primary key", ["table"], registry=registry
        )
        self.unfilled_columns = Counter(
            "walbus_demux_unfilled_columns",
            "Unchanged TOAST values that were unknown and left out of the row", ["table"], registry=registry,
        )
        self.replayed = Counter(
            "walbus_demux_replayed_skipped",
            "Source events skipped as replays (position not after the last processed one)", registry=registry,
        )
        self.consumer_lag = Gauge(
            "walbus_demux_consumer_lag", "High watermark minus next offset to process", ["partition"],
            registry=registry,
        )
        self.txn_commit_seconds = Histogram(
            "walbus_demux_txn_commit_seconds", "Kafka transaction commit latency (offsets + EndTxn)",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5), registry=registry,
        )
        self.transactions = Counter(
            "walbus_demux_transactions", "Kafka transactions by outcome", ["outcome"], registry=registry
        )
        self.state_resets = Counter(
            "walbus_demux_state_resets", "Last-row stores found missing or stale and reset", registry=registry
        )
        self.state_table_loads = Counter(
            "walbus_demux_state_table_loads", "Tables loaded into the last-row store from their topics", ["table"],
            registry=registry,
        )
        self.open_transaction_records = Gauge(
            "walbus_demux_open_transaction_records",
            "Records of the open transaction the broker has acknowledged (0 once it commits or aborts)",
            ["partition"], registry=registry,
        )
        self.aiokafka_shortcuts = Gauge(
            "walbus_demux_aiokafka_shortcuts",
            "1 when the demux takes this shortcut through aiokafka's internals, 0 when it uses the public API "
            "(an aiokafka it was not checked against)", ["shortcut"], registry=registry,
        )
        self.assigned_partitions = Gauge(
            "walbus_demux_assigned_partitions", "Source partitions owned by this process", registry=registry
        )


class TransactionCounts:
    """One partition's counts of the open transaction, added to the metrics when it commits.

    Plain dicts for the per-record counts: the cheapest thing the hot loop can update.
    """

    def __init__(self, metrics: DemuxMetrics, partition: int) -> None:
        self._metrics = metrics
        self._partition = partition
        self._label = str(partition)
        self.records = 0  # source records processed
        self.replayed = 0
        self.produced: dict[str, int] = {}  # table -> rows
        self.tombstones: dict[str, int] = {}  # table -> tombstones
        self.other: Tally[tuple[str, ...]] = Tally()  # (kind, *labels): dead letters, no_pk, ...

    def flush(self) -> None:
        """The committed transaction's counts into the metrics."""
        m = self._metrics
        m.consumed.labels(self._label).inc(self.records)
        if self.replayed:
            m.replayed.inc(self.replayed)
            log.warning("skipped replayed source events (position not after the last one processed)",
                        extra={"partition": self._partition, "count": self.replayed})
        for table, n in self.produced.items():
            m.produced.labels(table).inc(n)
        for table, n in self.tombstones.items():
            m.tombstones.labels(table).inc(n)
        by_kind = {"dead_letter": m.dead_letters, "no_pk": m.no_pk_events, "unfilled": m.unfilled_columns,
                   "unwritten": m.unwritten_outputs}
        for (kind, *labels), n in self.other.items():
            by_kind[kind].labels(*labels).inc(n)
        self.clear()

    def clear(self) -> None:
        self.records = self.replayed = 0
        self.produced.clear()
        self.tombstones.clear()
        self.other.clear()
