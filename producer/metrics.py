"""The producer's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ProducerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("walbus_producer_events", "Row change events read, by table and operation", ["table", "operation"], registry=registry)
        self.transactions = Counter("walbus_producer_transactions", "Committed transactions read from the slot", registry=registry)
        self.behind_source_ms = Gauge("walbus_producer_milliseconds_behind_source", "Now minus the commit time of the last transaction read", registry=registry)
        self.slot_lag_bytes = Gauge("walbus_producer_slot_lag_bytes", "Server WAL position minus the slot's confirmed position", registry=registry)
        self.send_latency = Histogram(
            "walbus_producer_kafka_send_seconds", "Kafka batch send-to-ack latency",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=registry,
        )
        self.in_flight = Gauge("walbus_producer_in_flight_events", "Events sent to Kafka and not yet acknowledged", registry=registry)
        self.connected = Gauge("walbus_producer_connected", "1 while streaming from PostgreSQL", registry=registry)
        self.confirmed_lsn = Gauge("walbus_producer_confirmed_lsn", "Last LSN confirmed to the slot (Kafka acknowledged)", registry=registry)
        self.reconnects = Counter("walbus_producer_reconnects", "Restarts of the stream after a transient fault", registry=registry)
