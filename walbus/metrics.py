"""Prometheus metrics plumbing: each service builds its metrics on a registry passed in."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("walbus.metrics")


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def serve_metrics(port: int | None, registry: CollectorRegistry, *, addr: str = "0.0.0.0") -> Any:
    """Expose ``/metrics`` on ``port`` (None or 0: not at all). Returns the server, or None."""
    if not port:
        return None
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    log.info("metrics served", extra={"port": port})
    return server
