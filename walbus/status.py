"""Where the data is: the slot, the topics, the consumer groups and the warehouse's last load.

Read from the outside (``pg_replication_slots``, Kafka's offsets, the warehouse's load log),
so it keeps reporting while a service is down: ``walbus status`` prints it, and
:class:`StatusCollector` exports it to Prometheus on each scrape (the slot's lag must keep
growing on a dashboard precisely when the producer is not there to report it).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from walbus.client.groups import GroupLag, group_lags
from walbus.contract import SIDE_TOPIC_SUFFIXES
from walbus.kafka import broker_refusal

log = logging.getLogger("walbus.status")

SIDE_TOPICS = frozenset(SIDE_TOPIC_SUFFIXES)
# wal_status of pg_replication_slots, worst last: "lost" means the slot can no longer be used.
WAL_STATUSES = ("reserved", "extended", "unreserved", "lost")
# The warehouse's load log file names (warehouse/loads.py): <20-digit id>.<state>.json.
_LOAD_FILE = re.compile(r"(\d{20})\.(planned|committed)\.json")

_SLOTS_SQL = """
SELECT slot_name, plugin, database, active, confirmed_flush_lsn::text, restart_lsn::text,
       CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint END,
       wal_status, safe_wal_size
FROM pg_replication_slots
WHERE slot_type = 'logical' AND (%(slot)s::text IS NULL OR slot_name = %(slot)s)
ORDER BY slot_name
"""


@dataclass(frozen=True)
class SlotStatus:
    slot: str
    plugin: str
    database: str
    active: bool
    confirmed_flush_lsn: str | None
    restart_lsn: str | None
    lag_bytes: int | None  # the server's WAL position minus the slot's confirmed one
    wal_status: str | None
    safe_wal_size: int | None  # bytes that may still be written before the slot is lost (None: no limit)


@dataclass(frozen=True)
class TopicStatus:
    topic: str
    kind: str  # database | table | side
    end_offsets: dict[int, int]

    @property
    def records(self) -> int:
        """The sum of the partitions' end offsets (records ever written, compaction aside)."""
        return sum(self.end_offsets.values())


@dataclass(frozen=True)
class WarehouseLoad:
    batch_id: int
    status: str  # planned | committed
    end_offsets: dict[int, int]
    at: str | None  # when it was recorded (ISO 8601, UTC)

    @property
    def at_seconds(self) -> float | None:
        return dt.datetime.fromisoformat(self.at).timestamp() if self.at else None


@dataclass
class Status:
    slots: list[SlotStatus] = field(default_factory=list)
    topics: list[TopicStatus] = field(default_factory=list)
    groups: list[GroupLag] = field(default_factory=list)
    warehouse: WarehouseLoad | None = None
    warehouse_lag: int | None = None  # database topic records not yet loaded
    errors: dict[str, str] = field(default_factory=dict)  # part -> why it could not be read
    # part -> what was asked for and is not there (a --slot of that name, the database topic):
    # read fine, but a script asking "is it there?" must not get the answer of an empty success.
    missing: dict[str, str] = field(default_factory=dict)
    # parts of ``errors`` that refuse this client (a login, a certificate, a security protocol):
    # a configuration fault, no retry mends it (exit 2, as every command)
    refused: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for t in out["topics"]:
            t["records"] = sum(t["end_offsets"].values())
        out["groups"] = [g.to_json_obj() for g in self.groups]
        return out


# -- PostgreSQL ---------------------------------------------------------------------------------


def slot_status(dsn: str, slot: str | None = None) -> list[SlotStatus]:
    """The logical slots (or the one named), as ``pg_replication_slots`` shows them."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        rows = conn.execute(_SLOTS_SQL, {"slot": slot}).fetchall()
    return [
        SlotStatus(
            slot=r[0], plugin=r[1], database=r[2], active=bool(r[3]), confirmed_flush_lsn=r[4], restart_lsn=r[5],
            lag_bytes=None if r[6] is None else max(0, int(r[6])), wal_status=r[7],
            safe_wal_size=None if r[8] is None else int(r[8]),
        )
        for r in rows
    ]


# -- Kafka --------------------------------------------------------------------------------------


def topic_kind(database_topic: str, topic: str) -> str | None:
    """database | table | side for a topic of ``database_topic``'s family, else None."""
    if topic == database_topic:
        return "database"
    if not topic.startswith(database_topic + "."):
        return None
    rest = topic[len(database_topic) + 1 :]
    if rest.startswith("group--"):  # a consumer group's dead-letter or replay topic
        return "side"
    # A table's topic adds its schema and its table (two parts, each escaped: no dot inside);
    # one part more is a side topic, walbus's own or a user's (a --signal-topic beside it).
    # The hashed form of a long table topic (ending "--<hash>") may have lost those dots.
    if rest.rsplit(".", 1)[-1] in SIDE_TOPICS or ("." not in rest and "--" not in rest):
        return "side"
    return "table"


async def kafka_status(client_kwargs: dict[str, Any], database_topic: str) -> tuple[list[TopicStatus], list[GroupLag]]:
    """End offsets of the database topic and its per-table and side topics, and the lag of
    every consumer group that committed offsets on any of them."""
    admin = AIOKafkaAdminClient(**client_kwargs)
    consumer = AIOKafkaConsumer(**client_kwargs, enable_auto_commit=False)
    # Both closed even when a start failed (Kafka unreachable): a consumer made and never
    # stopped warns "Unclosed AIOKafkaConsumer" at exit, a second message for the one cause.
    try:
        await admin.start()
        await consumer.start()
        topics = await _end_offsets(admin, consumer, database_topic)
    finally:
        await consumer.stop()
        await admin.close()
    groups = await group_lags(client_kwargs, topics=[t.topic for t in topics]) if topics else []
    return topics, groups


async def _end_offsets(admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer, database_topic: str) -> list[TopicStatus]:
    names = sorted(t for t in await admin.list_topics() if topic_kind(database_topic, t) is not None)
    if not names:
        return []
    partitions = {d["topic"]: sorted(p["partition"] for p in d["partitions"]) for d in await admin.describe_topics(names)}
    out: list[TopicStatus] = []
    for name in names:
        ends = await consumer.end_offsets([TopicPartition(name, p) for p in partitions.get(name, [])])
        kind = topic_kind(database_topic, name) or "side"
        out.append(TopicStatus(name, kind, {tp.partition: int(o) for tp, o in sorted(ends.items())}))
    return out


# -- the warehouse ------------------------------------------------------------------------------


def last_committed_load(loads_dir: Path) -> WarehouseLoad | None:
    """The newest *committed* load (what the warehouse tables hold)."""
    if not loads_dir.is_dir():
        return None
    ids = sorted(int(m.group(1)) for e in loads_dir.iterdir() if (m := _LOAD_FILE.fullmatch(e.name)) and m.group(2) == "committed")
    if not ids:
        return None
    doc = orjson.loads((loads_dir / f"{ids[-1]:020d}.committed.json").read_bytes())
    return WarehouseLoad(ids[-1], "committed", {int(p): int(o) for p, o in doc["end"].items()}, doc.get("at"))


# -- all of it ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusSources:
    """What to look at; any part left None is not read."""

    pg_dsn: str | None = None
    slot: str | None = None
    kafka_client_kwargs: dict[str, Any] | None = None
    topic: str | None = None
    warehouse_loads_dir: Path | None = None


async def gather(sources: StatusSources) -> Status:
    """Every part that can be read; a part that cannot is named in ``errors``, not raised."""
    status = Status()
    if sources.pg_dsn:
        try:
            status.slots = await asyncio.to_thread(slot_status, sources.pg_dsn, sources.slot)
        except Exception as e:
            status.errors["postgres"] = _reason(e)
        else:
            if sources.slot is not None and not status.slots:
                status.missing["slot"] = f"no logical replication slot named {sources.slot!r}"
    if sources.kafka_client_kwargs is not None and sources.topic:
        try:
            status.topics, status.groups = await asyncio.wait_for(
                kafka_status(sources.kafka_client_kwargs, sources.topic), 60
            )
        except Exception as e:
            # aiokafka says only "Unable to bootstrap" for a broker that refuses this client
            refusal = await broker_refusal(sources.kafka_client_kwargs) if isinstance(e, KafkaConnectionError) else None
            if refusal:
                status.errors["kafka"] = f"Kafka at {refusal}"
                status.refused.append("kafka")
            else:
                status.errors["kafka"] = _reason(e)
        else:
            if not any(t.kind == "database" for t in status.topics):
                status.missing["topic"] = f"no topic named {sources.topic!r}"
    if sources.warehouse_loads_dir is not None:
        root = sources.warehouse_loads_dir.parent.parent  # <warehouse>/<topic>/_walbus_loads
        if not root.is_dir():  # a typo read as "nothing loaded yet" (a fuzz)
            status.missing["warehouse"] = f"no warehouse directory {str(root)!r}"
        try:
            status.warehouse = last_committed_load(sources.warehouse_loads_dir)
        except (OSError, ValueError, KeyError) as e:
            status.errors["warehouse"] = _reason(e)
        status.warehouse_lag = _warehouse_lag(status)
    return status


def _warehouse_lag(status: Status) -> int | None:
    db = next((t for t in status.topics if t.kind == "database"), None)
    if db is None:
        return None
    loaded = status.warehouse.end_offsets if status.warehouse else {}
    return sum(max(0, end - loaded.get(p, 0)) for p, end in db.end_offsets.items())


def _reason(e: BaseException) -> str:
    from walbus.logs import redact_dsn

    text = redact_dsn(str(e).strip())
    if text.startswith(type(e).__name__):  # aiokafka's errors name their type already
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# -- Prometheus ---------------------------------------------------------------------------------


class StatusCollector(Collector):
    """Reads :func:`gather` on each scrape and exports it as ``walbus_status_*`` gauges."""

    def __init__(self, sources: StatusSources) -> None:
        self.sources = sources
        # What each part's last read failed with: its reason is logged when it changes, not on
        # every scrape (walbus_status_read_errors alone did not say why).
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()

    def describe(self) -> list[Any]:
        return []  # collected on demand: nothing is read at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = asyncio.run(gather(self.sources))
        self._log_changes(status.errors)
        yield from status_metrics(status)

    def _log_changes(self, errors: dict[str, str]) -> None:
        with self._lock:
            for part, why in errors.items():
                if self._errors.get(part) != why:
                    log.warning(f"could not read {part}: {why}", extra={"part": part})
            for part in self._errors.keys() - errors.keys():
                log.warning(f"{part} can be read again", extra={"part": part})
            self._errors = dict(errors)


def status_metrics(status: Status) -> Iterator[GaugeMetricFamily]:
    """The status as gauges (names in deploy/walbus-alerts.yml and the dashboard)."""
    lag = GaugeMetricFamily("walbus_slot_lag_bytes", "Server WAL position minus the slot's confirmed_flush_lsn (from pg_replication_slots)", labels=["slot", "database"])
    safe = GaugeMetricFamily("walbus_slot_safe_wal_size_bytes", "WAL that may still be written before the slot is lost (max_slot_wal_keep_size)", labels=["slot"])
    wal = GaugeMetricFamily("walbus_slot_wal_status", "1 for the slot's wal_status (reserved, extended, unreserved, lost)", labels=["slot", "wal_status"])
    active = GaugeMetricFamily("walbus_slot_active", "1 while a client (the producer) streams from the slot", labels=["slot"])
    for s in status.slots:
        if s.lag_bytes is not None:
            lag.add_metric([s.slot, s.database], s.lag_bytes)
        if s.safe_wal_size is not None:
            safe.add_metric([s.slot], s.safe_wal_size)
        for state in WAL_STATUSES:
            wal.add_metric([s.slot, state], 1.0 if s.wal_status == state else 0.0)
        active.add_metric([s.slot], 1.0 if s.active else 0.0)
    yield from (lag, safe, wal, active)
    ends = GaugeMetricFamily("walbus_topic_end_offset", "Sum of the topic's partition end offsets", labels=["topic", "kind"])
    for t in status.topics:
        ends.add_metric([t.topic, t.kind], t.records)
    yield ends
    groups = GaugeMetricFamily("walbus_consumer_group_lag", "End offsets minus the group's committed offsets", labels=["group", "topic"])
    for g in status.groups:
        groups.add_metric([g.group, g.topic], g.records)
    yield groups
    ages = GaugeMetricFamily("walbus_consumer_group_lag_seconds", "Age of the oldest record a group has not consumed yet",
                             labels=["group", "topic"])
    for g in status.groups:
        ages.add_metric([g.group, g.topic], g.seconds)
    yield ages
    if status.warehouse is not None and status.warehouse.at_seconds is not None:
        yield GaugeMetricFamily(
            "walbus_warehouse_last_load_timestamp_seconds", "When the warehouse last committed a load", value=status.warehouse.at_seconds
        )
    if status.warehouse_lag is not None:
        yield GaugeMetricFamily("walbus_warehouse_lag_records", "Database topic records not yet loaded into the warehouse", value=status.warehouse_lag)
    errors = GaugeMetricFamily("walbus_status_read_errors", "1 when a part could not be read on this scrape", labels=["part"])
    for part in ("postgres", "kafka", "warehouse"):
        errors.add_metric([part], 1.0 if part in status.errors else 0.0)
    yield errors
