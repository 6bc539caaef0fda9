"""The producer's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ProducerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("walbus_producer_events", "Row change events read, by table and operation", ["table", "operation"], registry=registry)
        self.transactions = Counter("walbus_producer_transactions", "Committed transactions read from the slot", registry=registry)
        self.behind_source_ms = Gauge("walbus_producer_milliseconds_behind_source", "Now minus the commit time of the last transaction read", registry=registry)
        self.slot_lag_bytes = Gauge("walbus_producer_slot_lag_bytes", "Server WAL position minus the slot's confirmed position (pg_replication_slots, read every 10 s)", registry=registry)
        self.send_latency = Histogram(
            "walbus_producer_kafka_send_seconds", "Kafka batch send-to-ack latency",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=registry,
        )
        self.in_flight = Gauge("walbus_producer_in_flight_events", "Events sent to the database topic and not yet acknowledged (heartbeats and transaction metadata not counted)", registry=registry)
        self.connected = Gauge("walbus_producer_connected", "1 while streaming from PostgreSQL", registry=registry)
        self.confirmed_lsn = Gauge("walbus_producer_confirmed_lsn", "Last LSN confirmed to the slot (Kafka acknowledged)", registry=registry)
        self.reconnects = Counter("walbus_producer_reconnects", "Restarts of the stream after a transient fault", registry=registry)
        self.last_heartbeat = Gauge(
            "walbus_producer_last_heartbeat_timestamp_seconds", "Unix time of the last heartbeat record sent (0: none yet)",
            registry=registry,
        )
        self.unpublished_tables = Gauge(
            "walbus_producer_unpublished_tables",
            "Tables the capture filter takes that the publication (a table list) does not publish: their changes are not streamed",
            registry=registry,
        )
        self.heartbeat_actions = Counter("walbus_producer_heartbeat_actions", "Heartbeat action queries that succeeded", registry=registry)
        self.heartbeat_action_failures = Counter(
            "walbus_producer_heartbeat_action_failures", "Heartbeat action queries that failed or were skipped", registry=registry,
        )


class SnapshotMetrics:
    """Debezium's snapshot metrics, for both kinds (label ``kind``: initial | incremental)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tables_total = Gauge("walbus_snapshot_tables_total", "Tables the snapshot covers", ["kind"], registry=registry)
        self.tables_remaining = Gauge("walbus_snapshot_tables_remaining", "Tables not yet completely read", ["kind"], registry=registry)
        self.rows_scanned = Counter("walbus_snapshot_rows_scanned", "Rows read by snapshots, by table", ["kind", "table"], registry=registry)
        self.running = Gauge("walbus_snapshot_running", "1 while a snapshot runs", ["kind"], registry=registry)
        self.completed = Gauge("walbus_snapshot_completed", "1 once the last snapshot completed", ["kind"], registry=registry)
        self.aborted = Gauge("walbus_snapshot_aborted", "1 when the last snapshot was stopped before completion", ["kind"], registry=registry)
        self.duration = Gauge("walbus_snapshot_duration_seconds", "Duration of the running or last snapshot", ["kind"], registry=registry)
        self.chunks = Counter("walbus_snapshot_chunks", "Incremental snapshot chunks emitted", ["table"], registry=registry)
        self.tables_failed = Counter(
            "walbus_snapshot_tables_failed", "Tables whose snapshot was given up (a failing filter or query; keys the stream does not carry)",
            ["kind", "table"], registry=registry,
        )
        self.tables_skipped = Counter(
            "walbus_snapshot_tables_skipped", "Tables an incremental snapshot was asked for and left out (none such, no "
            "primary key, not captured or not published; the log line says which)", ["kind", "table"], registry=registry,
        )
        self.tables_restarted = Counter(
            "walbus_snapshot_tables_restarted", "Tables read again from their first key: dropped and created again, or their "
            "primary key changed, while an incremental snapshot read them", ["kind", "table"], registry=registry,
        )
        self.lock_timeouts = Counter(
            "walbus_snapshot_lock_timeouts", "Incremental snapshot chunks that waited longer than --incremental-lock-timeout "
            "for their table's lock (another session holds it), by table", ["kind", "table"], registry=registry,
        )
        self.paused = Gauge("walbus_snapshot_paused", "1 while a snapshot is paused (pause-snapshot signal)", ["kind"], registry=registry)
        self.ignored = Counter(
            "walbus_snapshot_ignored_signals", "Signal rows and watermark messages ignored as malformed or over the limits, by kind",
            ["kind"], registry=registry,
        )

    def begin(self, kind: str, tables: int) -> None:
        self.tables_total.labels(kind).set(tables)
        self.tables_remaining.labels(kind).set(tables)
        self.running.labels(kind).set(1)
        self.completed.labels(kind).set(0)
        self.aborted.labels(kind).set(0)
        self.duration.labels(kind).set(0)

    def end(self, kind: str, seconds: float, *, aborted: bool = False) -> None:
        self.running.labels(kind).set(0)
        self.duration.labels(kind).set(seconds)
        (self.aborted if aborted else self.completed).labels(kind).set(1)
