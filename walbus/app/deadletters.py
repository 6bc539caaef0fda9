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

from walbus.client.deadletters import list_dead_letters, replay_dead_letters
from walbus.config import ConfigError, load_config, option
from walbus.kafka import KafkaOptions

ACTIONS = ("list", "replay")


@dataclass(kw_only=True)
class DeadLettersConfig(KafkaOptions):
    topic: str = option(help="the database topic the group reads, e.g. walbus.<database>")
    group_id: str = option(help="the consumer group whose dead letters these are")


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if not args or args[0] not in ACTIONS:
        if args and args[0] in ("-h", "--help"):
            print(f"usage: walbus dead-letters {{{'|'.join(ACTIONS)}}} --topic T --group-id G\n\n{__doc__}")
            return 0
        raise ConfigError(f"give an action: {' or '.join(ACTIONS)} (walbus dead-letters list --help)")
    action = args.pop(0)
    config = load_config(DeadLettersConfig, args, prog=f"walbus dead-letters {action}", description=__doc__, section="dead-letters")
    if not config.topic or not config.group_id:
        raise ConfigError("--topic and --group-id are required")
    kwargs = config.kafka_client_kwargs()
    run = list_dead_letters if action == "list" else replay_dead_letters
    letters = asyncio.run(run(kwargs, config.topic, config.group_id))
    for letter in letters:
        sys.stdout.write(orjson.dumps(letter.to_json_obj()).decode() + "\n")
    print(f"{len(letters)} dead letter(s) {'listed' if action == 'list' else 'replayed'}", file=sys.stderr)
    return 0
