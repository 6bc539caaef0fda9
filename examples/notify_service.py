"""A service that reacts to new rows of ``public.transactions`` — what a RabbitMQ
notification used to do, without the other service publishing anything.

    walbus dev up && eval "$(walbus dev env)"
    walbus produce &
    python examples/notify_service.py          # one JSON line per new transaction

It subscribes to the database topic as the consumer group ``notify-service``. Its first
run starts at the latest event (``start="latest"``, the default: like binding a new queue,
no old history); a restarted service goes on where it stopped, skips events the producer
wrote twice, and its offsets are committed only after ``notify`` returned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from _env import bootstrap, database_topic

from walbus.client import ChangeEvent, Feed, Lsn


async def notify(event: ChangeEvent) -> None:
    """Stand-in for the real side effect (an e-mail, a push message…): print one line."""
    row: dict[str, Any] = event.row() or {}
    message = {
        "notify_user": row.get("user_id"),
        "transaction_id": row.get("transaction_id"),
        "amount": row.get("amount"),
        "commit_lsn": str(Lsn(event.commit_lsn)),
        "committed_at": event.timestamp,
    }
    print(json.dumps(message), flush=True)


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-id", default="notify-service")
    parser.add_argument("--max-events", type=int, default=0, help="exit after this many (0: run until stopped)")
    args = parser.parse_args(argv)
    handled = 0
    async with Feed(
        database_topic(),
        group_id=args.group_id,
        bootstrap_servers=bootstrap(),
        tables=["public.transactions"],
        operations=["insert"],
    ) as feed:
        print("listening", file=sys.stderr, flush=True)
        async for event in feed:
            await notify(event)
            handled += 1
            if args.max_events and handled >= args.max_events:
                break
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(sys.argv[1:])))
    except KeyboardInterrupt:
        sys.exit(130)
