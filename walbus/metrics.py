"""Prometheus metrics plumbing: each service builds its metrics on a registry passed in.

The metrics port also answers the health checks of an orchestrator:

* ``/healthz``: 200 while the process runs (liveness);
* ``/readyz``: 200 while the service does its work (the producer streams, the demux owns
  partitions), else 503 (readiness).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("walbus.metrics")

# Loopback unless the operator says otherwise: metrics name tables and topics.
DEFAULT_METRICS_ADDR = "127.0.0.1"

ReadyCheck = Callable[[], bool]


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


def health_app(registry: CollectorRegistry, ready: ReadyCheck | None = None) -> Callable[..., Iterable[bytes]]:
    """A WSGI app: ``/healthz``, ``/readyz`` and the metrics on every other path."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _text(start_response, "200 OK", b"ok\n")
        if path == "/readyz":
            if ready is None or _safe(ready):
                return _text(start_response, "200 OK", b"ready\n")
            return _text(start_response, "503 Service Unavailable", b"not ready\n")
        body: Iterable[bytes] = metrics(environ, start_response)
        return body

    return app


def _text(start_response: Callable[..., Any], status: str, body: bytes) -> list[bytes]:
    # A new header list each time: wsgiref adds Content-Length to the list it is given.
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [body]


def _safe(check: ReadyCheck) -> bool:
    try:
        return bool(check())
    except Exception:
        log.warning("readiness check failed", exc_info=True)
        return False


def serve_metrics(
    port: int | None, registry: CollectorRegistry, *, addr: str = DEFAULT_METRICS_ADDR,
    ready: ReadyCheck | None = None,
) -> Any:
    """Expose ``/metrics``, ``/healthz`` and ``/readyz`` on ``addr:port`` (port None or 0: not
    at all). Returns the server (``.shutdown()`` stops it), or None."""
    if not port:
        return None
    server_class = _Server6 if ":" in addr else _Server
    try:
        server = make_server(addr, port, health_app(registry, ready), server_class, handler_class=_QuietHandler)
    except (OSError, TypeError, ValueError) as e:
        # In use, an address not on this host, or a name no socket takes (a NUL, one idna cannot
        # encode: TypeError, UnicodeError): the operator's to fix.
        from walbus.config import ConfigError

        shown = addr if addr.isprintable() else repr(addr)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"--metrics-port {port} on --metrics-addr {shown}: {reason}") from None
    threading.Thread(target=server.serve_forever, name="walbus-metrics", daemon=True).start()
    log.info("metrics served", extra={"addr": addr, "port": port})
    return server


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample's current value, or None when it has none (a readiness check's reading)."""
    value: float | None = registry.get_sample_value(name, labels)
    return value
