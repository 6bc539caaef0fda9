"""The metrics port's health checks and its loopback default (no services)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import Gauge

from demux.config import parse_config as demux_config
from producer.config import load as producer_config
from walbus.app.dev.processes import free_port
from walbus.metrics import DEFAULT_METRICS_ADDR, new_registry, serve_metrics


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def served() -> Iterator[tuple[int, Gauge]]:
    registry = new_registry()
    connected = Gauge("walbus_test_connected", "readiness under test", registry=registry)
    port = free_port()
    server = serve_metrics(port, registry, ready=lambda: registry.get_sample_value("walbus_test_connected") == 1)
    try:
        yield port, connected
    finally:
        server.shutdown()
        server.server_close()


def test_healthz_answers_while_the_process_runs(served: tuple[int, Gauge]) -> None:
    port, _ = served
    assert get(port, "/healthz") == (200, "ok\n")


def test_readyz_follows_the_readiness_check(served: tuple[int, Gauge]) -> None:
    port, connected = served
    assert get(port, "/readyz")[0] == 503
    connected.set(1)
    assert get(port, "/readyz") == (200, "ready\n")
    connected.set(0)
    assert get(port, "/readyz")[0] == 503


def test_metrics_are_still_served(served: tuple[int, Gauge]) -> None:
    port, connected = served
    connected.set(1)
    status, body = get(port, "/metrics")
    assert status == 200 and "walbus_test_connected 1.0" in body


def test_a_failing_readiness_check_is_not_ready() -> None:
    def broken() -> bool:
        raise RuntimeError("boom")

    port = free_port()
    server = serve_metrics(port, new_registry(), ready=broken)
    try:
        assert get(port, "/readyz")[0] == 503
        assert get(port, "/healthz")[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_the_metrics_server_binds_loopback_by_default() -> None:
    assert DEFAULT_METRICS_ADDR == "127.0.0.1"
    port = free_port()
    server = serve_metrics(port, new_registry())
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()


def test_services_default_to_loopback_and_take_metrics_addr() -> None:
    pcfg = producer_config(["--pg-dsn", "dbname=shop", "--kafka-bootstrap", "k:9092"])
    dcfg = demux_config(["--source-topic", "walbus.shop", "--kafka-bootstrap", "k:9092"])
    assert pcfg.metrics_addr == dcfg.metrics_addr == "127.0.0.1"
    dcfg = demux_config(["--source-topic", "walbus.shop", "--kafka-bootstrap", "k:9092", "--metrics-addr", "0.0.0.0"])
    assert dcfg.metrics_addr == "0.0.0.0"
