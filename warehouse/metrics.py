"""The warehouse loader's Prometheus metrics.

``walbus warehouse stream`` serves them on ``--metrics-port`` (with ``/healthz`` and
``/readyz``, as the producer and the demux do); both ``load`` and ``stream`` can write them to
``--metrics-file`` after each load (micro-batch) and when they stop, for node_exporter's
textfile collector: a nightly ``load`` lives too briefly to be scraped.

A micro-batch of ``stream`` is a load here: it commits one slice of the topic.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, write_to_textfile

if TYPE_CHECKING:
    from warehouse.job import LoadResult

# a nightly load of a large database takes minutes; a micro-batch of a quiet one, seconds
_LOAD_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)


class WarehouseMetrics:
    """Counters of what the loads of one topic wrote, and when the last one committed."""

    def __init__(self, registry: CollectorRegistry, topic: str, path: str | None = None) -> None:
        self.registry = registry
        self.topic = topic
        self.path = path  # the text file written by write() (None: none)
        self.failed_runs = 0  # failures counted by this process
        self.loads = Counter(
            "walbus_warehouse_loads", "Loads (stream: micro-batches) committed: slices of the topic", ["topic"],
            registry=registry,
        )
        self.failures = Counter(
            "walbus_warehouse_load_failures", "Runs that stopped with an error (stream: a micro-batch or the query)", ["topic"],
            registry=registry,
        )
        self.events = Counter("walbus_warehouse_events", "Events loaded, by table", ["topic", "table"], registry=registry)
        self.history_rows = Counter(
            "walbus_warehouse_history_rows", "Rows appended to history tables (duplicates left out)", ["topic", "table"],
            registry=registry,
        )
        self.current_rows = Counter(
            "walbus_warehouse_current_rows",
            "Current-table rows written, by action (inserted, updated; deleted: tombstones)",
            ["topic", "table", "action"], registry=registry,
        )
        self.table_failures = Counter(
            "walbus_warehouse_table_failures", "Tables a load could not write (a schema change it refuses)",
            ["topic", "table"], registry=registry,
        )
        self.quarantined = Counter(
            "walbus_warehouse_quarantined_records", "Invalid records written to the quarantine table (--skip-invalid)",
            ["topic"], registry=registry,
        )
        self.seconds = Histogram(
            "walbus_warehouse_load_seconds", "Duration of a run that succeeded (stream: a micro-batch)", ["topic"],
            buckets=_LOAD_BUCKETS, registry=registry,
        )
        self.last_success = Gauge(
            "walbus_warehouse_last_success_timestamp_seconds",
            "Unix time the last run succeeded, new events or none (0: none yet)", ["topic"], registry=registry,
        )
        self.last_events = Gauge(
            "walbus_warehouse_last_load_events", "Events the last successful run loaded", ["topic"], registry=registry,
        )
        # the topic's series exist from the start: an alert on a missing success needs them
        for metric in (self.loads, self.failures, self.quarantined, self.last_success, self.last_events):
            metric.labels(topic)
        self.seconds.labels(topic)

    def succeeded(self, result: LoadResult, seconds: float) -> None:
        """A run (``load``) or micro-batch (``stream``) succeeded; ``result`` holds what it
        alone wrote (no batch: there were no new events)."""
        self.loads.labels(self.topic).inc(len(result.batches))
        self.seconds.labels(self.topic).observe(seconds)
        self.last_success.labels(self.topic).set(time.time())
        self.last_events.labels(self.topic).set(result.events)
        self._tables(result)

    def failed(self, result: LoadResult | None = None) -> None:
        """A run or micro-batch stopped with an error; ``result``: what it had written by then
        (the tables that committed, and those that failed)."""
        self.failures.labels(self.topic).inc()
        self.failed_runs += 1
        if result is not None:
            self._tables(result)

    def _tables(self, result: LoadResult) -> None:
        topic = self.topic
        if result.quarantined:
            self.quarantined.labels(topic).inc(result.quarantined)
        for table, summary in result.tables.items():
            if summary.error:
                self.table_failures.labels(topic, table).inc()
                continue
            self.events.labels(topic, table).inc(summary.events)
            self.history_rows.labels(topic, table).inc(summary.history_rows)
            for action, rows in (("inserted", summary.inserted), ("updated", summary.updated), ("deleted", summary.deleted)):
                if rows:
                    self.current_rows.labels(topic, table, action).inc(rows)

    def write(self) -> None:
        """The registry in Prometheus' text format at ``self.path`` (written whole, then renamed
        into place: a collector never reads half a file); nothing without a path."""
        if self.path is not None:
            write_to_textfile(self.path, self.registry)
