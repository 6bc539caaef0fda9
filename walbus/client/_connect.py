"""Connection plumbing shared by Feed and Table: client options and topic discovery."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from walbus.kafka import (
    topic_partitions as topic_partitions,  # the one definition, re-exported for Feed and Table
)

log = logging.getLogger("walbus.client")


def client_kwargs(bootstrap_servers: str | None, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge a bootstrap address with aiokafka options (e.g. ``KafkaOptions.kafka_client_kwargs()``)."""
    kw = dict(extra or {})
    if bootstrap_servers:
        kw["bootstrap_servers"] = bootstrap_servers
    if not kw.get("bootstrap_servers"):
        raise ValueError("give bootstrap_servers= or client_kwargs={'bootstrap_servers': ...}")
    return kw


def consumer_options(
    given: Mapping[str, Any] | None, client: Mapping[str, Any], reserved: Mapping[str, str]
) -> dict[str, Any]:
    """The caller's extra consumer options, checked when the reader is made: an option the reader
    sets itself (``reserved``: option -> what to use instead) or one already in ``client`` was a
    TypeError from inside aiokafka at start() ("got multiple values for keyword argument")."""
    options = dict(given or {})
    for name in options:
        if name in reserved:
            raise ValueError(f"consumer_options: {name} is set by the reader itself; {reserved[name]}")
        if name in client:
            raise ValueError(f"consumer_options: {name} is given in client_kwargs (or bootstrap_servers) already")
    return options


async def read_records(kwargs: Mapping[str, Any], tp: TopicPartition, start: int, end: int) -> list[Any]:
    """The committed records of ``tp`` at offsets ``start <= offset < end`` (those still there)."""
    consumer = AIOKafkaConsumer(**kwargs, enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        consumer.assign([tp])
        first = (await consumer.beginning_offsets([tp]))[tp]
        end = min(end, (await consumer.end_offsets([tp]))[tp])
        consumer.seek(tp, max(start, first))
        out: list[Any] = []
        while await consumer.position(tp) < end:
            batches = await consumer.getmany(tp, timeout_ms=1000)
            out += [m for m in batches.get(tp, []) if m.offset < end]
        return out
    finally:
        await consumer.stop()
