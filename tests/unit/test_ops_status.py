"""`walbus status`'s pure parts: topic families, the warehouse's load log, text output (no services)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from walbus.app.status import StatusConfig, exit_code, render
from walbus.config import ConfigError, load_config
from walbus.status import Status, TopicStatus, last_committed_load, topic_kind
from walbus.status import _warehouse_lag as warehouse_lag


def test_topic_kinds() -> None:
    assert topic_kind("walbus.shop", "walbus.shop") == "database"
    assert topic_kind("walbus.shop", "walbus.shop.public.orders") == "table"
    for side in ("dlq", "progress", "transaction", "heartbeat"):
        assert topic_kind("walbus.shop", f"walbus.shop.{side}") == "side"
    assert topic_kind("walbus.shop", "walbus.shopping") is None
    assert topic_kind("walbus.shop", "other") is None
    # A user's topic beside it (a --signal-topic) is not a table; a client's DLQ neither.
    assert topic_kind("walbus.shop", "walbus.shop.signals") == "side"
    assert topic_kind("walbus.shop", "walbus.shop.billing.dlq") == "side"
    assert topic_kind("walbus.shop", "walbus.shop.group--billing.replay") == "side"
    assert topic_kind("walbus.shop", "walbus.shop.public.Order-20Items") == "table"
    assert topic_kind("walbus.shop", "walbus.shop.sssssss--0a1b2c3d") == "table"  # hashed, cut inside the schema


def test_side_topics_are_named_by_the_contract() -> None:
    from walbus.contract import heartbeat_topic, side_topic

    assert side_topic("walbus.shop", "progress") == "walbus.shop.progress"
    assert heartbeat_topic("walbus.shop") == "walbus.shop.heartbeat"
    with pytest.raises(ValueError):
        side_topic("walbus.shop", "signals")


def write_load(loads: Path, n: int, state: str, end: dict[str, int], at: str = "2026-01-01T00:00:00+00:00") -> None:
    loads.mkdir(parents=True, exist_ok=True)
    doc = {"batch_id": n, "status": state, "start": {}, "end": end, "at": at, "summary": None}
    (loads / f"{n:020d}.{state}.json").write_text(json.dumps(doc))


def test_the_last_committed_load_is_what_the_warehouse_holds(tmp_path: Path) -> None:
    loads = tmp_path / "_walbus_loads"
    assert last_committed_load(loads) is None
    write_load(loads, 0, "planned", {"0": 5})
    assert last_committed_load(loads) is None  # planned only: nothing is in the tables yet
    write_load(loads, 0, "committed", {"0": 5})
    write_load(loads, 1, "planned", {"0": 9})
    (loads / ".abc.tmp").write_text("partial")
    load = last_committed_load(loads)
    assert load is not None and (load.batch_id, load.end_offsets) == (0, {0: 5})
    assert load.at_seconds == 1767225600


def test_warehouse_lag_counts_database_topic_records_not_loaded(tmp_path: Path) -> None:
    loads = tmp_path / "l"
    write_load(loads, 3, "committed", {"0": 5, "1": 2})
    status = Status(topics=[TopicStatus("walbus.shop", "database", {0: 8, 1: 2, 2: 4}),
                            TopicStatus("walbus.shop.public.t", "table", {0: 100})],
                    warehouse=last_committed_load(loads))
    assert warehouse_lag(status) == 3 + 0 + 4


def test_status_reads_the_warehouse_layout(tmp_path: Path) -> None:
    cfg = load_config(StatusConfig, ["--topic", "walbus.my-db", "--warehouse", str(tmp_path), "--kafka-bootstrap", "k"],
                      prog="walbus status", env={}, section="status")
    # the warehouse escapes the topic in its path (warehouse/layout.py)
    assert cfg.sources().warehouse_loads_dir == tmp_path / "walbus~2Emy-db" / "_walbus_loads"
    with pytest.raises(ConfigError, match="local"):
        load_config(StatusConfig, ["--topic", "t", "--warehouse", "s3a://b/w", "--kafka-bootstrap", "k"],
                    prog="s", env={}).sources()


def test_the_default_topic_comes_from_the_dsn() -> None:
    cfg = load_config(StatusConfig, ["--pg-dsn", "postgresql://u@h/shop", "--kafka-bootstrap", "k"], prog="s", env={})
    assert cfg.topic_name == "walbus.shop"


def test_text_output_names_every_part() -> None:
    out = io.StringIO()
    render(Status(topics=[TopicStatus("walbus.shop", "database", {0: 4})], errors={"postgres": "OperationalError: x"}), out)
    text = out.getvalue()
    assert "walbus.shop" in text and " 4\n" in text and "could not read postgres" in text


def test_exit_code_says_unreadable_before_missing() -> None:
    assert exit_code(Status()) == 0
    assert exit_code(Status(missing={"slot": "no logical replication slot named 's'"})) == 3
    assert exit_code(Status(errors={"kafka": "KafkaConnectionError"}, missing={"slot": "x"})) == 1
    out = io.StringIO()
    render(Status(missing={"topic": "no topic named 'walbus.x'"}), out)
    assert out.getvalue().endswith("not found: no topic named 'walbus.x'\n")


def test_a_warehouse_directory_that_is_not_there_is_said(tmp_path: Path) -> None:
    import asyncio

    from walbus.status import StatusSources, gather

    missing = asyncio.run(gather(StatusSources(warehouse_loads_dir=tmp_path / "nope" / "walbus~2Eshop" / "_walbus_loads")))
    assert missing.missing == {"warehouse": f"no warehouse directory {str(tmp_path / 'nope')!r}"}
    there = asyncio.run(gather(StatusSources(warehouse_loads_dir=tmp_path / "walbus~2Eshop" / "_walbus_loads")))
    assert there.missing == {} and there.warehouse is None  # a warehouse with nothing loaded yet


def test_a_refusing_part_exits_2() -> None:
    status = Status(errors={"kafka": "Kafka at h:1 refuses the login: …"}, refused=["kafka"], missing={"slot": "x"})
    assert exit_code(status) == 2
