"""A live per-user balance, kept from the compacted ``public.transactions`` topic (a KTable).

    walbus dev up && eval "$(walbus dev env)"
    walbus produce & walbus demux --source-topic walbus.postgres &
    python examples/balances_ktable.py          # {"balances": …} once loaded, then one line per change

The table topic holds the latest row of every transaction (deleted ones are tombstones), so
the balance of a user is the sum of the amounts of their current transactions. The change
callback keeps the sums up to date: subtract the old row, add the new one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from _env import bootstrap, database_topic

from walbus.client import Table, TableChange


class Balances:
    """Sum of ``amount`` per ``user_id`` over the current rows."""

    def __init__(self) -> None:
        self.by_user: dict[int, int] = {}
        self._rows: dict[int, int] = {}  # current rows per user: drop a user with none left
        self.loaded = False

    def on_change(self, change: TableChange) -> None:
        touched: list[int] = []
        for row, sign in ((change.old, -1), (change.new, 1)):
            if row is None or row.get("user_id") is None:
                continue
            user = int(row["user_id"])
            self.by_user[user] = self.by_user.get(user, 0) + sign * int(row.get("amount") or 0)
            self._rows[user] = self._rows.get(user, 0) + sign
            if self._rows[user] == 0:
                del self._rows[user], self.by_user[user]
            if user not in touched:
                touched.append(user)
        if self.loaded:  # live changes only; the loaded state is printed once
            for user in touched:
                line = {"user_id": user, "balance": self.by_user.get(user, 0), "commit_lsn": change.commit_lsn}
                print(json.dumps(line), flush=True)

    def snapshot(self) -> dict[str, int]:
        return {str(user): total for user, total in sorted(self.by_user.items())}


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topic", help="the compacted topic (default: <database topic>.public.transactions)")
    parser.add_argument("--once", action="store_true", help="print the balances once loaded, then exit")
    args = parser.parse_args(argv)
    balances = Balances()
    topic = args.topic or f"{database_topic()}.public.transactions"
    async with Table(topic, bootstrap_servers=bootstrap(), on_change=balances.on_change):
        balances.loaded = True
        print(json.dumps({"balances": balances.snapshot()}), flush=True)
        if not args.once:
            await asyncio.Event().wait()  # follow until stopped
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(sys.argv[1:])))
    except KeyboardInterrupt:
        sys.exit(130)
