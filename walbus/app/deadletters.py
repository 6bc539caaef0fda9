"""`walbus dead-letters list|replay`: a consumer group's dead letters, as JSON lines.

``list`` prints every dead letter of the group (error, attempts, original position);
``replay`` sends the ones not replayed yet back to the group (its replay topic, read by the
group's feeds) and prints them.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from walbus.client.deadletters import (
    DeadLetter,
    list_dead_letters,
    list_demux_dead_letters,
    replay_dead_letters,
)
from walbus.config import ConfigError, load_config, option
from walbus.contract import side_topic
from walbus.kafka import KafkaOptions, require_broker, require_topics
from walbus.logs import setup_logging

ACTIONS = ("list", "replay")


async def _letters(config: DeadLettersConfig, action: str) -> list[DeadLetter]:
    kwargs = config.kafka_client_kwargs()
    await require_broker(kwargs)
    await require_topics(kwargs, [config.topic])
    run = list_dead_letters if action == "list" else replay_dead_letters
    assert config.group_id is not None  # main checked
    return await run(kwargs, config.topic, config.group_id)


async def _demux_letters(config: DeadLettersConfig) -> list[DeadLetter]:
    kwargs = config.kafka_client_kwargs()
    await require_broker(kwargs)
    return await list_demux_dead_letters(kwargs, config.dlq_topic or side_topic(config.topic, "dlq"))


@dataclass(kw_only=True)
class DeadLettersConfig(KafkaOptions):
    topic: str = option(topic=True, help="the database topic the group reads, e.g. walbus.<database>")
    # Per command only, as tail's: a shared WALBUS_GROUP_ID is another service's group.
    group_id: str | None = option(None, help="the consumer group whose dead letters these are", env="command")
    demux: bool = option(False, help="list the demux's dead letters (<topic>.dlq, or --dlq-topic) instead of a group's")
    dlq_topic: str | None = option(None, topic=True, help="with --demux: the demux's --dlq-topic, when it set one")
    log_level: str = option("warning", help="log level", choices=["debug", "info", "warning", "error"])


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if not args or args[0] not in ACTIONS:
        if args and args[0] in ("-h", "--help"):
            print(f"usage: walbus dead-letters {{{'|'.join(ACTIONS)}}} --topic T --group-id G\n\n{__doc__}")
            return 0
        raise ConfigError(f"give an action: {' or '.join(ACTIONS)} (walbus dead-letters list --help)")
    action = args.pop(0)
    config = load_config(DeadLettersConfig, args, prog=f"walbus dead-letters {action}", description=__doc__, section="dead-letters")
    setup_logging(config.log_level)
    if config.demux:
        if action != "list" or not config.topic:
            raise ConfigError("--demux lists (the demux's dead letters are re-keyed again by fixing their cause "
                              "and reading the table again with execute-snapshot) and needs --topic")
        letters = asyncio.run(_demux_letters(config))
    else:
        if not config.topic or not config.group_id:
            raise ConfigError("--topic and --group-id are required (or --demux for the demux's dead letters)")
        letters = asyncio.run(_letters(config, action))
    for letter in letters:
        sys.stdout.write(orjson.dumps(letter.to_json_obj()).decode() + "\n")
    print(f"{len(letters)} dead letter(s) {'listed' if action == 'list' else 'replayed'}", file=sys.stderr)
    return 0
