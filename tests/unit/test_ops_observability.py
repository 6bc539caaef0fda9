"""The dashboard and alert rules in deploy/: they load in promtool and name only metrics the code
exports; the status exporter's gauges (no services; needs Debian's `prometheus` package)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from demux.metrics import DemuxMetrics
from producer.metrics import ProducerMetrics, SnapshotMetrics
from walbus.client.groups import GroupLag, PartitionLag
from walbus.client.metrics import ClientMetrics
from walbus.metrics import new_registry
from walbus.status import SlotStatus, Status, TopicStatus, WarehouseLoad, status_metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_METRIC = re.compile(r"\bwalbus_[a-z0-9_]+")


def promtool(*args: str) -> str:
    done = subprocess.run(["promtool", *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def full_status() -> Status:
    return Status(
        slots=[SlotStatus("walbus_shop", "pgoutput", "shop", False, "0/16B3748", "0/16B3710", 4096, "extended", 1 << 30)],
        topics=[TopicStatus("walbus.shop", "database", {0: 10, 1: 5}), TopicStatus("walbus.shop.public.t", "table", {0: 7})],
        groups=[GroupLag("billing", "walbus.shop", (PartitionLag(0, 9, 10, 1, 0.5), PartitionLag(1, 3, 5, 2, 4.0)))],
        warehouse=WarehouseLoad(4, "committed", {0: 8, 1: 5}, "2026-01-01T00:00:00+00:00"),
        warehouse_lag=2,
    )


def exported_names() -> set[str]:
    """Every sample name the services, the client and the status exporter can expose."""
    registry = new_registry()
    ProducerMetrics(registry)
    SnapshotMetrics(registry)
    DemuxMetrics(registry)
    ClientMetrics(registry)
    names = {s.name for m in registry.collect() for s in m.samples}
    # Counters and histograms show their samples only once labelled: take the families' names too.
    for m in registry.collect():
        names |= {m.name, m.name + "_total", m.name + "_bucket", m.name + "_sum", m.name + "_count"}
    status = CollectorRegistry()
    status.register(_Fixed(full_status()))
    names |= {s.name for m in status.collect() for s in m.samples}
    return names


class _Fixed:
    def __init__(self, status: Status) -> None:
        self.status = status

    def collect(self) -> Any:
        return status_metrics(self.status)


def dashboard() -> dict[str, Any]:
    doc = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert isinstance(doc, dict)
    return doc


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    doc = yaml.safe_load((DEPLOY / "walbus-alerts.yml").read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def test_promtool_accepts_the_rules_and_the_config() -> None:
    assert "SUCCESS: 18 rules found" in promtool("check", "rules", "walbus-alerts.yml")
    promtool("check", "config", "prometheus.yml")


def test_the_alert_rules_pass_their_unit_tests() -> None:
    assert "SUCCESS" in promtool("test", "rules", "walbus-alerts.test.yml")


def test_every_rule_has_an_alert_a_severity_and_a_summary() -> None:
    doc = yaml.safe_load((DEPLOY / "walbus-alerts.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert len(names) == len(rules)
    # the list: slot lag and WAL status, producer disconnected, demux lag, DLQ, warehouse
    assert {"WalbusSlotLagHigh", "WalbusSlotWalUnreserved", "WalbusSlotLost", "WalbusProducerDisconnected",
            "WalbusDemuxLag", "WalbusConsumerGroupLag", "WalbusDeadLetters", "WalbusWarehouseStale"} <= names
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]


def test_rules_and_dashboard_name_only_exported_metrics() -> None:
    exported = exported_names()
    used = {name for expr in rule_exprs() + dashboard_exprs() for name in _METRIC.findall(expr)}
    assert used, "no walbus metric found in the expressions"
    assert used <= exported, f"not exported by walbus: {sorted(used - exported)}"


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    doc = dashboard()
    assert doc["uid"] == "walbus" and doc["schemaVersion"] >= 36
    assert doc["templating"]["list"][0]["type"] == "datasource"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
    # the slot, the producer, the demux, consumers and the warehouse each have a panel
    text = " ".join(dashboard_exprs())
    for metric in ("walbus_slot_lag_bytes", "walbus_producer_connected", "walbus_demux_consumer_lag",
                   "walbus_demux_dead_letters_total", "walbus_consumer_group_lag", "walbus_warehouse_last_load_timestamp_seconds"):
        assert metric in text


def test_status_gauges() -> None:
    registry = CollectorRegistry()
    registry.register(_Fixed(full_status()))
    value = registry.get_sample_value
    assert value("walbus_slot_lag_bytes", {"slot": "walbus_shop", "database": "shop"}) == 4096
    assert value("walbus_slot_wal_status", {"slot": "walbus_shop", "wal_status": "extended"}) == 1
    assert value("walbus_slot_wal_status", {"slot": "walbus_shop", "wal_status": "lost"}) == 0
    assert value("walbus_slot_safe_wal_size_bytes", {"slot": "walbus_shop"}) == 1 << 30
    assert value("walbus_slot_active", {"slot": "walbus_shop"}) == 0
    assert value("walbus_topic_end_offset", {"topic": "walbus.shop", "kind": "database"}) == 15
    assert value("walbus_consumer_group_lag", {"group": "billing", "topic": "walbus.shop"}) == 3
    assert value("walbus_warehouse_last_load_timestamp_seconds") == 1767225600
    assert value("walbus_warehouse_lag_records") == 2
    assert value("walbus_status_read_errors", {"part": "kafka"}) == 0
