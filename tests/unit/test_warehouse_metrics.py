"""The warehouse loader's Prometheus metrics and their options (no services: a load's result
is made by hand; tests/integration/test_warehouse_cli.py and test_warehouse_parallel.py take
them from real loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from walbus.config import ConfigError, load_config
from walbus.metrics import new_registry
from warehouse.cli import LoadConfig, StreamConfig
from warehouse.job import LoadResult, TableSummary
from warehouse.metrics import WarehouseMetrics

TOPIC = "walbus.shop"
BASE = ["--topic", TOPIC, "--warehouse", "/tmp/wh", "--kafka-bootstrap", "k"]


def _result(*summaries: TableSummary, batches: tuple[int, ...] = (7,), quarantined: int = 0) -> LoadResult:
    result = LoadResult(batches=list(batches), quarantined=quarantined)
    for summary in summaries:
        result.tables[summary.table] = summary
        result.events += summary.events
    return result


def _value(metrics: WarehouseMetrics, name: str, **labels: str) -> float | None:
    value: float | None = metrics.registry.get_sample_value(name, {"topic": TOPIC, **labels})
    return value


def test_a_successful_load_counts_each_tables_rows() -> None:
    metrics = WarehouseMetrics(new_registry(), TOPIC)
    # the topic's series are there before any load: an alert on a missing success can fire
    assert _value(metrics, "walbus_warehouse_last_success_timestamp_seconds") == 0
    assert _value(metrics, "walbus_warehouse_loads_total") == 0
    odd = 'public."Order Items"'  # any PostgreSQL name is a label value
    metrics.succeeded(_result(
        TableSummary("public.a", events=10, history_rows=10, inserted=6, updated=2, deleted=1),
        TableSummary(odd, events=3, history_rows=2, history_only=True),
        quarantined=2,
    ), 4.5)
    metrics.succeeded(_result(TableSummary("public.a", events=5, history_rows=5, inserted=5)), 1.0)
    assert _value(metrics, "walbus_warehouse_loads_total") == 2
    assert _value(metrics, "walbus_warehouse_events_total", table="public.a") == 15
    assert _value(metrics, "walbus_warehouse_events_total", table=odd) == 3
    assert _value(metrics, "walbus_warehouse_history_rows_total", table=odd) == 2
    assert _value(metrics, "walbus_warehouse_current_rows_total", table="public.a", action="inserted") == 11
    assert _value(metrics, "walbus_warehouse_current_rows_total", table="public.a", action="updated") == 2
    assert _value(metrics, "walbus_warehouse_current_rows_total", table="public.a", action="deleted") == 1
    assert _value(metrics, "walbus_warehouse_current_rows_total", table=odd, action="inserted") is None
    assert _value(metrics, "walbus_warehouse_quarantined_records_total") == 2
    assert _value(metrics, "walbus_warehouse_load_seconds_count") == 2
    assert _value(metrics, "walbus_warehouse_load_seconds_sum") == 5.5
    assert _value(metrics, "walbus_warehouse_last_load_events") == 5
    assert (_value(metrics, "walbus_warehouse_last_success_timestamp_seconds") or 0) > 0
    assert _value(metrics, "walbus_warehouse_load_failures_total") == 0


def test_a_run_without_new_events_succeeds_without_a_load() -> None:
    metrics = WarehouseMetrics(new_registry(), TOPIC)
    metrics.succeeded(_result(batches=()), 0.2)
    assert _value(metrics, "walbus_warehouse_loads_total") == 0
    assert (_value(metrics, "walbus_warehouse_last_success_timestamp_seconds") or 0) > 0


def test_a_failed_load_counts_the_failure_and_its_failed_tables_but_not_their_rows() -> None:
    metrics = WarehouseMetrics(new_registry(), TOPIC)
    metrics.failed(_result(
        TableSummary("public.a", events=4, history_rows=4, inserted=4),
        TableSummary("public.b", events=9, error="public.b: column v changed type"),
    ))
    metrics.failed()
    assert _value(metrics, "walbus_warehouse_load_failures_total") == 2
    assert metrics.failed_runs == 2  # what `stream` reads to count a query's failure once
    assert _value(metrics, "walbus_warehouse_table_failures_total", table="public.b") == 1
    assert _value(metrics, "walbus_warehouse_events_total", table="public.b") is None
    assert _value(metrics, "walbus_warehouse_events_total", table="public.a") == 4  # committed before the failure
    assert _value(metrics, "walbus_warehouse_last_success_timestamp_seconds") == 0
    assert _value(metrics, "walbus_warehouse_loads_total") == 0


def test_the_metrics_file_is_prometheus_text(tmp_path: Path) -> None:
    path = tmp_path / "walbus_warehouse.prom"
    metrics = WarehouseMetrics(new_registry(), TOPIC, str(path))
    metrics.succeeded(_result(TableSummary("public.a", events=3, history_rows=3, inserted=3)), 2.0)
    metrics.write()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(path.read_text()) for s in family.samples
    }
    assert samples[("walbus_warehouse_events_total", (("table", "public.a"), ("topic", TOPIC)))] == 3
    assert samples[("walbus_warehouse_loads_total", (("topic", TOPIC),))] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["walbus_warehouse.prom"]  # no temporary file left
    WarehouseMetrics(new_registry(), "other").write()  # no file asked for: nothing happens


def test_the_stream_metrics_port_is_its_own_and_checked() -> None:
    env = {"WALBUS_WAREHOUSE_METRICS_PORT": "9190", "WALBUS_METRICS_PORT": "9187"}
    cfg = load_config(StreamConfig, BASE, prog="walbus warehouse stream", env=env, section="warehouse")
    assert (cfg.metrics_port, cfg.metrics_addr) == (9190, "127.0.0.1")
    shared = load_config(StreamConfig, BASE, prog="walbus warehouse stream", env={"WALBUS_METRICS_PORT": "9187"},
                         section="warehouse")
    assert shared.metrics_port is None  # the producer's shared variable is not the stream's port
    with pytest.raises(ConfigError, match="--metrics-port"):
        load_config(StreamConfig, [*BASE, "--metrics-port", "70000"], prog="s", env={}, section="warehouse")


def test_a_metrics_file_in_a_missing_directory_is_a_configuration_error(tmp_path: Path) -> None:
    cfg = load_config(LoadConfig, [*BASE, "--metrics-file", str(tmp_path / "w.prom")], prog="l", env={}, section="warehouse")
    assert cfg.metrics_file == str(tmp_path / "w.prom")
    with pytest.raises(ConfigError, match="--metrics-file"):
        load_config(LoadConfig, [*BASE, "--metrics-file", str(tmp_path / "no" / "w.prom")], prog="l", env={},
                    section="warehouse")
