"""`walbus status`: where the data is — the slot, the topics, the consumer groups, the warehouse.

With ``--metrics-port`` it stays up as a Prometheus exporter that reads all of it on each
scrape: the slot's lag keeps being reported while the producer is down.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from walbus.config import PORT_MAX, ConfigError, load_config, option, parse_dsn
from walbus.contract import database_topic
from walbus.kafka import KafkaOptions
from walbus.logs import setup_logging
from walbus.metrics import DEFAULT_METRICS_ADDR, new_registry, serve_metrics
from walbus.status import Status, StatusCollector, StatusSources, gather


@dataclass(kw_only=True)
class StatusConfig(KafkaOptions):
    pg_dsn: str | None = option(None, help="PostgreSQL connection string: the slots are read from pg_replication_slots")
    slot: str | None = option(None, help="only this replication slot (default: every logical slot)")
    topic: str | None = option(None, topic=True, help="the database topic (default <topic-prefix>.<database of --pg-dsn>)")
    topic_prefix: str = option("walbus", topic=True, help="prefix of the default topic name")
    warehouse: str | None = option(None, help="the warehouse root (a local directory): its last committed load")
    json: bool = option(False, help="print JSON instead of text")
    metrics_port: int = option(0, minimum=0, maximum=PORT_MAX, help="serve the status as Prometheus metrics on this port instead of printing it", env="command")
    metrics_addr: str = option(DEFAULT_METRICS_ADDR, help="address the metrics port binds (0.0.0.0: every interface)")
    log_level: str = option("warning", help="log level", choices=["debug", "info", "warning", "error"])

    @property
    def topic_name(self) -> str | None:
        if self.topic:
            return self.topic
        if not self.pg_dsn:
            return None
        params = parse_dsn(self.pg_dsn, "--pg-dsn")
        db = params.get("dbname") or params.get("user")
        return database_topic(self.topic_prefix, str(db)) if db else None

    def sources(self) -> StatusSources:
        topic = self.topic_name
        loads_dir = None
        if self.warehouse and topic:
            if "://" in self.warehouse and not self.warehouse.startswith("file:"):
                raise ConfigError("--warehouse: `walbus status` reads a local warehouse directory only")
            from warehouse.layout import loads_path  # the warehouse's own layout (no Spark)

            loads_dir = Path(loads_path(self.warehouse.removeprefix("file://").removeprefix("file:"), topic))
        return StatusSources(
            pg_dsn=self.pg_dsn, slot=self.slot, kafka_client_kwargs=self.kafka_client_kwargs(), topic=topic,
            warehouse_loads_dir=loads_dir,
        )


def render(status: Status, out: TextIO) -> None:
    """The status as short text sections."""
    w = out.write
    w("slots\n" + ("" if status.slots else "  (none)\n"))
    for s in status.slots:
        lag = "?" if s.lag_bytes is None else f"{s.lag_bytes} B"
        safe = "" if s.safe_wal_size is None else f", {s.safe_wal_size} B before it is lost"
        w(f"  {s.slot:<30} {'active' if s.active else 'inactive':<8} confirmed {s.confirmed_flush_lsn}  lag {lag}"
          f"  wal_status {s.wal_status}{safe}\n")
    w("topics (end offsets)\n" + ("" if status.topics else "  (none)\n"))
    for t in status.topics:
        w(f"  {t.kind:<8} {t.topic:<50} {t.records}\n")
    w("consumer groups (lag in records, seconds)\n" + ("" if status.groups else "  (none)\n"))
    for g in status.groups:
        w(f"  {g.group:<40} {g.topic:<50} {g.records} {g.seconds:.1f}\n")
    if status.warehouse is not None:
        wh = status.warehouse
        w(f"warehouse\n  load {wh.batch_id} committed at {wh.at}, {status.warehouse_lag} records of the database topic not loaded\n")
    for part, why in status.errors.items():
        w(f"could not read {part}: {why}\n")
    for what in status.missing.values():
        w(f"not found: {what}\n")


def serve(config: StatusConfig, sources: StatusSources) -> int:
    registry = new_registry()
    registry.register(StatusCollector(sources))
    server = serve_metrics(config.metrics_port, registry, addr=config.metrics_addr)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.shutdown()
    return 0


def main(argv: Sequence[str]) -> int:
    config = load_config(StatusConfig, argv, prog="walbus status", description=__doc__, section="status")
    if config.pg_dsn:
        parse_dsn(config.pg_dsn, "--pg-dsn")  # libpq's own parse errors quote pieces of it, the password among them
    setup_logging(config.log_level)
    sources = config.sources()
    if not sources.pg_dsn and not sources.topic:
        raise ConfigError("give --pg-dsn and/or --topic (and --kafka-bootstrap): there is nothing to look at")
    if config.metrics_port:
        return serve(config, sources)
    status = asyncio.run(gather(sources))
    if config.json:
        print(json.dumps(status.as_dict(), indent=2, default=str))
    else:
        render(status, sys.stdout)
    return exit_code(status)


def exit_code(status: Status) -> int:
    """2: a part refuses this client (a configuration fault, as for every command); 1: a part
    could not be read; 3: read, but the named slot or the database topic is not there (a
    producer that never ran, a typo); 0: all of it was read and is there."""
    if status.refused:
        return 2
    if status.errors:
        return 1
    return 3 if status.missing else 0
