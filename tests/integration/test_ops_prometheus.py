"""A real Prometheus scrapes a running producer, demux and status exporter: `up == 1`, walbus
metrics, the alert rules loaded and the dashboard's queries valid; /readyz follows the
services; the slot's lag keeps being reported while the producer is down."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from tests.support.demux import DemuxProc, demux_args
from tests.support.pipeline import ROOT, walbus_process
from walbus.app.dev.processes import free_port

pytestmark = pytest.mark.integration
DEPLOY = ROOT / "deploy"


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, *, expect: int = 200, within: float = 90) -> None:
    """Until ``url`` answers ``expect``; fails early when the process died."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if http_status(url) == expect:
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer {expect} within {within} s:\n{log.read_text(errors='replace')[-3000:]}")


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.base}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=30) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def wait_for(self, expr: str, within: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(1)
        raise AssertionError(f"no result for {expr} within {within} s; targets: {self.api('targets')['activeTargets']}")


@pytest.fixture()
def prometheus(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Prometheus, dict[str, int]]]:
    """Prometheus on a free loopback port, scraping three ports the test then serves."""
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is missing: `apt-get install prometheus` (scripts/setup.sh does)"
    ports = {"walbus-producer": free_port(), "walbus-demux": free_port(), "walbus-status": free_port()}
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "walbus-alerts.yml")],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]} for job, port in ports.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/-/ready", proc, tmp_path / "prometheus.log")  # type: ignore[arg-type]
        yield Prometheus(port), ports
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def values(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


def test_prometheus_scrapes_the_services(
    prometheus: tuple[Prometheus, dict[str, int]], pg_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    prom, ports = prometheus
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        database = conn.info.dbname
    topic = f"walbus.{database}"
    producer_log = tmp_path / "producer.log"
    producer = walbus_process(
        ["produce", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--heartbeat-interval", "1",
         "--metrics-port", str(ports["walbus-producer"])], log=producer_log,
    )
    status_log = tmp_path / "status.log"
    status = walbus_process(
        ["status", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--slot", f"walbus_{database}",
         "--metrics-port", str(ports["walbus-status"])], log=status_log,
    )
    demux = DemuxProc(demux_args(kafka_bootstrap, topic, tmp_path / "demux"), tmp_path / "demux.log",
                      metrics_port=ports["walbus-demux"])
    try:
        # /healthz at once, /readyz once streaming
        wait_http(f"http://127.0.0.1:{ports['walbus-producer']}/readyz", producer, producer_log)
        assert http_status(f"http://127.0.0.1:{ports['walbus-producer']}/healthz") == 200
        demux.start()
        assert demux.proc is not None
        wait_http(f"http://127.0.0.1:{ports['walbus-demux']}/readyz", demux.proc, demux.log_path)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")

        up: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while set(up) != set(ports) and time.monotonic() < deadline:
            time.sleep(1)
            up = values(prom.query("up == 1"), "job")
        assert set(up) == set(ports), prom.api("targets")["activeTargets"]
        assert values(prom.wait_for("walbus_producer_connected == 1"), "job") == {"walbus-producer": 1.0}
        assert values(prom.wait_for("walbus_demux_assigned_partitions > 0"), "job") == {"walbus-demux": 1.0}
        prom.wait_for('sum(walbus_producer_events_total{table="public.t"}) >= 2')
        slot = values(prom.wait_for(f'walbus_slot_active{{slot="walbus_{database}"}}'), "slot")
        assert slot == {f"walbus_{database}": 1.0}

        # The rules load in Prometheus itself, and every dashboard query is valid PromQL there.
        groups = prom.api("rules")["groups"]
        in_file = yaml.safe_load((DEPLOY / "walbus-alerts.yml").read_text())["groups"]
        assert sum(len(g["rules"]) for g in groups) == sum(len(g["rules"]) for g in in_file) >= 18
        dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                prom.query(target["expr"].replace("$__rate_interval", "1m"))

        # The producer stops: /readyz is gone with it, and the slot's lag is still reported.
        producer.terminate()
        assert producer.wait(60) == 0
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(3, 3000) g")
        prom.wait_for(f'walbus_slot_active{{slot="walbus_{database}"}} == 0')
        prom.wait_for(f'walbus_slot_lag_bytes{{slot="walbus_{database}"}} > 300000')
        prom.wait_for('up{job="walbus-producer"} == 0')
    finally:
        for proc in (producer, status):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        if demux.proc is not None and demux.proc.poll() is None:
            demux.stop()
