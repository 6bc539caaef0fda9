"""docker-compose.yml and the Dockerfile stay valid, safe and consistent with the CLI.

No Docker engine runs in CI: these tests read the files."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from demux.config import DemuxConfig
from producer.config import ProducerConfig
from walbus.app.cli import COMMANDS
from walbus.app.status import StatusConfig
from walbus.config import env_name

ROOT = Path(__file__).resolve().parents[2]
CONFIGS: dict[str, type[Any]] = {"produce": ProducerConfig, "demux": DemuxConfig, "status": StatusConfig}
WALBUS_SERVICES = ("producer", "demux", "status")
METRICS_PORT_ENV = {"producer": "WALBUS_PRODUCE_METRICS_PORT", "demux": "WALBUS_DEMUX_METRICS_PORT",
                    "status": "WALBUS_STATUS_METRICS_PORT"}


def compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_compose_has_the_stack() -> None:
    services = compose()["services"]
    assert {"postgres", "kafka", "producer", "demux", "status", "prometheus"} <= set(services)
    pg = services["postgres"]
    assert "wal_level=logical" in " ".join(pg["command"])
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_walbus_services_use_real_commands_and_options() -> None:
    services = compose()["services"]
    for name in WALBUS_SERVICES:
        svc = services[name]
        command = svc["command"]
        assert command[0] == "walbus" and command[1] in COMMANDS, command
        cls = CONFIGS[command[1]]
        fields = {env_name(f.name): f for f in dataclasses.fields(cls)}
        fields |= {env_name(f.name, command[1]): f for f in dataclasses.fields(cls)}
        env = svc["environment"]
        for key in env:
            assert key in fields, f"{name}: {key} is not an option of `walbus {command[1]}`"
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        for option in required:
            assert {env_name(option), env_name(option, command[1])} & set(env), f"{name}: required option {option} missing"
        assert svc["build"] == {"context": ".", "target": "services"}


def test_options_whose_meaning_differs_use_the_per_command_names() -> None:
    services = compose()["services"]
    for name in WALBUS_SERVICES:
        env = services[name]["environment"]
        assert "WALBUS_METRICS_PORT" not in env and "WALBUS_STATE_DIR" not in env and "WALBUS_GROUP_ID" not in env
        assert METRICS_PORT_ENV[name] in env


def test_prometheus_scrapes_the_metrics_ports_and_loads_the_rules() -> None:
    services = compose()["services"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name in WALBUS_SERVICES:
        port = services[name]["environment"][METRICS_PORT_ENV[name]]
        assert f"{name}:{port}" in targets
        # reachable over the compose network, not published on the host
        assert services[name]["environment"]["WALBUS_METRICS_ADDR"] == "0.0.0.0"
        assert "ports" not in services[name]
    assert scrape["rule_files"] == ["walbus-alerts.yml"]
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/walbus-alerts.yml:/etc/prometheus/walbus-alerts.yml:ro" in mounts


def test_published_ports_are_loopback_only() -> None:
    for name, svc in compose()["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_no_fixed_passwords_and_the_producer_is_not_the_superuser() -> None:
    services = compose()["services"]
    pg_env = services["postgres"]["environment"]
    assert re.fullmatch(r"\$\{POSTGRES_PASSWORD:\?.+\}", pg_env["POSTGRES_PASSWORD"])
    for name in ("producer", "status"):
        dsn = services[name]["environment"]["WALBUS_PG_DSN"]
        assert dsn.startswith("postgresql://walbus_producer:${WALBUS_PRODUCER_PASSWORD:?"), dsn
    init = (ROOT / "deploy" / "postgres-init" / "10-walbus-producer-role.sh").read_text()
    assert "CREATE ROLE :\"role\" WITH LOGIN REPLICATION" in init and "SUPERUSER" not in init
    assert "WALBUS_PRODUCER_ROLE:-walbus_producer" in init
    assert "./deploy/postgres-init:/docker-entrypoint-initdb.d:ro" in services["postgres"]["volumes"]


def test_the_kafka_host_listener_is_loopback_and_documented() -> None:
    kafka = compose()["services"]["kafka"]["environment"]
    assert "EXTERNAL://127.0.0.1:29092" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    assert "127.0.0.1:29092" in (ROOT / "README.md").read_text()


def test_producer_and_demux_have_healthchecks_on_readyz() -> None:
    services = compose()["services"]
    for name in ("producer", "demux"):
        port = services[name]["environment"][METRICS_PORT_ENV[name]]
        test = " ".join(services[name]["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/readyz" in test


def test_the_demux_runs_as_a_user_owning_its_state_volume() -> None:
    text = dockerfile()
    services_stage = text.split("AS services", 1)[1]
    assert re.search(r"^USER walbus$", services_stage, re.M), "the services image must not run as root"
    assert "--home-dir /var/lib/walbus --create-home" in text and "chmod 0700 /var/lib/walbus" in text
    demux = compose()["services"]["demux"]
    assert demux["volumes"] == ["demux-state:/var/lib/walbus"]  # a new volume copies the image's owner
    assert demux["environment"]["WALBUS_DEMUX_STATE_DIR"].startswith("/var/lib/walbus/")


def test_the_image_has_the_compression_codecs_and_the_warehouse_a_jre() -> None:
    text = dockerfile()
    assert "pip install --no-cache-dir '.[compression]'" in text
    warehouse = text.split("AS warehouse", 1)[1].split("FROM ", 1)[0]
    assert "jre-headless" in warehouse and "USER walbus" in warehouse


def test_compose_runs_the_local_stacks_kafka_version() -> None:
    from walbus.app.dev.kafka import KAFKA_VERSION

    assert compose()["services"]["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"
