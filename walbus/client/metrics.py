"""Prometheus counters of the client library: one set per registry, shared by its readers."""

from __future__ import annotations

import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Counter


class ClientMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.invalid_records = Counter(
            "walbus_client_invalid_records",
            "Records skipped because they break the walbus contract (see the error log line)",
            ["reader", "topic"],
            registry=registry,
        )
        self.stored_positions_ignored = Counter(
            "walbus_client_stored_positions_ignored",
            "Positions in a group's offset metadata that no valid event has, ignored",
            ["topic"],
            registry=registry,
        )
        self.retries = Counter(
            "walbus_client_retries",
            "Events handed to their handler again after a nack or a handler error",
            ["topic", "group"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "walbus_client_dead_letters",
            "Events sent to the group's dead-letter topic after their last attempt",
            ["topic", "group"],
            registry=registry,
        )


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ClientMetrics] = weakref.WeakKeyDictionary()


def client_metrics(registry: CollectorRegistry | None = None) -> ClientMetrics:
    """The client's counters on ``registry`` (default: prometheus_client's global one)."""
    registry = REGISTRY if registry is None else registry
    metrics = _by_registry.get(registry)
    if metrics is None:
        metrics = _by_registry[registry] = ClientMetrics(registry)
    return metrics
