"""docker-compose.yml stays valid and consistent with the CLI (no Docker engine runs in CI)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from demux.config import DemuxConfig
from producer.config import ProducerConfig
from walbus.app.cli import COMMANDS
from walbus.config import env_name

ROOT = Path(__file__).resolve().parents[2]
CONFIGS: dict[str, type[Any]] = {"produce": ProducerConfig, "demux": DemuxConfig}


def compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def test_compose_has_the_stack() -> None:
    services = compose()["services"]
    assert {"postgres", "kafka", "producer", "demux", "prometheus"} <= set(services)
    pg = services["postgres"]
    assert "wal_level=logical" in " ".join(pg["command"])
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_walbus_services_use_real_commands_and_options() -> None:
    services = compose()["services"]
    for name in ("producer", "demux"):
        svc = services[name]
        command = svc["command"]
        assert command[0] == "walbus" and command[1] in COMMANDS, command
        cls = CONFIGS[command[1]]
        fields = {env_name(f.name): f for f in dataclasses.fields(cls)}
        env = svc["environment"]
        for key in env:
            assert key in fields, f"{name}: {key} is not an option of `walbus {command[1]}`"
        required = [k for k, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        assert set(required) <= set(env), f"{name}: required options missing: {set(required) - set(env)}"
        assert (ROOT / "Dockerfile").exists() and svc["build"] == "."


def test_prometheus_scrapes_the_metrics_ports() -> None:
    services = compose()["services"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name in ("producer", "demux"):
        port = services[name]["environment"]["WALBUS_METRICS_PORT"]
        assert f"{name}:{port}" in targets


def test_compose_runs_the_local_stacks_kafka_version() -> None:
    from walbus.app.dev.kafka import KAFKA_VERSION

    assert compose()["services"]["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"
