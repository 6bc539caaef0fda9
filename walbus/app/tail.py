"""`walbus tail`: print a database topic's events as JSON lines (contract v1), for debugging.

Reads without a consumer group by default (nothing committed, every partition); with
``--group-id`` it reads as that group and commits what it printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from walbus.client import Feed
from walbus.client.deadletters import group_topics
from walbus.client.filters import EventFilter
from walbus.config import ConfigError, load_config, option
from walbus.kafka import KafkaAdmin, KafkaOptions, require_broker
from walbus.logs import setup_logging


@dataclass(kw_only=True)
class TailConfig(KafkaOptions):
    topic: str = option(topic=True, help="database topic to read, e.g. walbus.<database>")
    table: list[str] = option([], help="only these tables: fnmatch patterns on schema.table, comma-separated or repeated")
    operation: list[str] = option([], help="only these operations: insert, update, delete, truncate, read")
    from_beginning: bool = option(False, help="start at the oldest event instead of new events only")
    max_events: int = option(0, minimum=0, help="exit after printing this many events (0: no limit)")
    until_end: bool = option(False, help="exit once the events present at start are printed")
    # Per command only: a shared WALBUS_GROUP_ID would make tail commit another service's offsets.
    group_id: str | None = option(None, help="read as this consumer group and commit offsets", env="command")
    log_level: str = option("warning", help="log level (skipped records are errors, with their offset)",
                            choices=["debug", "info", "warning", "error"])


async def tail(config: TailConfig, out: TextIO) -> int:
    """Print events until stopped; returns how many were printed."""
    printed = 0
    feed = Feed(
        config.topic,
        group_id=config.group_id,
        client_kwargs=config.kafka_client_kwargs(),
        tables=config.table,
        operations=config.operation,
        from_beginning=config.from_beginning,
        until_end=config.until_end,
    )
    async with feed:
        async for event in feed:
            out.write(event.to_json().decode() + "\n")
            out.flush()
            printed += 1
            if config.max_events and printed >= config.max_events:
                break
    return printed


async def _check(config: TailConfig) -> None:
    """Brokers that do not answer, or (--until-end) a topic that does not exist, end tail with
    a configuration error: it waited for them without a word (an operations fuzz)."""
    kwargs = config.kafka_client_kwargs()
    await require_broker(kwargs)
    async with KafkaAdmin(client_kwargs=kwargs) as admin:
        if config.topic not in await admin.list_topics():
            if config.until_end:
                raise ConfigError(f"topic {config.topic} does not exist")
            print(f"waiting for topic {config.topic} to exist", file=sys.stderr)


async def _run(config: TailConfig) -> None:
    await _check(config)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await tail(config, sys.stdout)


def main(argv: Sequence[str]) -> int:
    config = load_config(TailConfig, argv, prog="walbus tail", description=__doc__, section="tail")
    setup_logging(config.log_level)
    if config.max_events < 0:
        raise ConfigError("--max-events: 0 (no limit) or more")
    try:
        EventFilter(config.table, config.operation)
        if config.group_id is not None:
            group_topics(config.topic, config.group_id)  # the Feed's dead-letter topics: names Kafka takes
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        asyncio.run(_run(config))
    except BrokenPipeError:  # `walbus tail ... | head`
        return 0
    return 0
