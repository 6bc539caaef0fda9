"""Connection plumbing shared by Feed and Table: client options and topic discovery."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.client import AIOKafkaClient

from walbus.kafka import (
    topic_partitions as topic_partitions,  # the one definition, re-exported for Feed and Table
)

log = logging.getLogger("walbus.client")


# What every aiokafka client takes (its shared AIOKafkaClient's connection options): a Feed or
# Table hands client_kwargs to consumers, producers and admin clients alike.
CONNECTION_OPTIONS: Final = frozenset(inspect.signature(AIOKafkaClient.__init__).parameters) - {"self", "loop"}


def client_kwargs(bootstrap_servers: str | None, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge a bootstrap address with aiokafka options (e.g. ``KafkaOptions.kafka_client_kwargs()``)."""
    kw = dict(extra or {})
    # A consumer's or producer's own option here (session_timeout_ms, say) was a TypeError from
    # inside aiokafka at start(), or at the first dead letter (an admin client's): said now.
    unknown = sorted(set(kw) - CONNECTION_OPTIONS)
    if unknown:
        raise ValueError(
            f"client_kwargs: {', '.join(unknown)} is not a Kafka connection option (those are: "
            f"{', '.join(sorted(CONNECTION_OPTIONS))}); a consumer's own options go in consumer_options="
        )
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
