"""`walbus groups`: each consumer group on walbus topics, with its lag in records and seconds.

One JSON line per (group, topic) on stdout, with per-partition detail; a table on stderr.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from walbus.client.groups import GroupLag, group_lags
from walbus.config import load_config, option
from walbus.kafka import KafkaOptions, require_broker, require_topics
from walbus.logs import setup_logging


@dataclass(kw_only=True)
class GroupsConfig(KafkaOptions):
    topic: list[str] = option([], topic=True, help="only these topics, comma-separated (default: every topic named <topic-prefix>.…)")
    topic_prefix: str = option("walbus", topic=True, help="prefix of the walbus topics")
    log_level: str = option("warning", help="log level", choices=["debug", "info", "warning", "error"])


async def _lags(config: GroupsConfig) -> list[GroupLag]:
    kwargs = config.kafka_client_kwargs()
    await require_broker(kwargs)
    if config.topic:
        await require_topics(kwargs, config.topic)
    return await group_lags(kwargs, topics=config.topic, prefix=config.topic_prefix + ".")


def main(argv: Sequence[str]) -> int:
    config = load_config(GroupsConfig, list(argv), prog="walbus groups", description=__doc__, section="groups")
    setup_logging(config.log_level)
    lags = asyncio.run(_lags(config))
    for lag in lags:
        sys.stdout.write(orjson.dumps(lag.to_json_obj()).decode() + "\n")
    print(f"{'group':<40} {'topic':<40} {'lag records':>12} {'lag seconds':>12}", file=sys.stderr)
    for lag in lags:
        print(f"{lag.group:<40} {lag.topic:<40} {lag.records:>12} {lag.seconds:>12.1f}", file=sys.stderr)
    return 0
