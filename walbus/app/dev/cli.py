"""`walbus dev up | down | status | env`."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from walbus.app.dev.kafka import BROKER_COUNTS, KAFKA_VERSION
from walbus.app.dev.processes import exit_on_sigterm
from walbus.app.dev.stack import CorruptState, LocalStack, default_state_dir, purge_unreadable
from walbus.logs import redact_dsn


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="walbus dev", description="The local PostgreSQL + Kafka stack.")
    state_help = "where data, logs and PIDs live (env WALBUS_DEV_STATE_DIR; default ./.walbus)"
    parser.add_argument("--state-dir", type=Path, default=None, help=state_help)
    # Also after the action (`walbus dev up --state-dir DIR`, as the README writes it).
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS, help=state_help)
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", parents=[after], help="start PostgreSQL and Kafka (reuses a running stack)")
    up.add_argument(
        "--kafka-version", default=None,
        help=f"Apache Kafka version of a new stack, fetched from Maven Central (default: {KAFKA_VERSION}; 3.9.1 works too)",
    )
    up.add_argument(
        "--brokers", type=int, default=None, choices=BROKER_COUNTS,
        help="Kafka nodes of a new stack: 1, or 3 (each broker and controller: a quorum of 3; default: 1)",
    )
    down = sub.add_parser("down", parents=[after], help="stop both by their recorded PIDs")
    down.add_argument(
        "--purge", action="store_true",
        help="also delete walbus's files in the state directory, and the directory if that empties it",
    )
    sub.add_parser("status", parents=[after], help="what runs where (JSON; exit 3 when the stack is not running or there is none)")
    sub.add_parser("env", parents=[after], help="print `export WALBUS_...` lines for the shell (fails when the stack is not running)")
    args = parser.parse_args(argv)
    state_dir = args.state_dir or default_state_dir()
    if args.action == "down" and args.purge:
        try:
            stack = LocalStack.load(state_dir)
        except CorruptState:
            found = purge_unreadable(state_dir.resolve())
            print("walbus dev: stopped " + (f"servers (pid {', '.join(map(str, found))})" if found else "nothing (not running)"))
            return 0
    elif args.action == "up":
        exit_on_sigterm()  # a stop while starting stops what this `up` launched
        stack = LocalStack.load(state_dir, kafka_version=args.kafka_version, brokers=args.brokers)
    else:
        stack = LocalStack.load(state_dir)
    if args.action == "up":
        was_running = stack.postgres.running() and stack.kafka.running()
        print(f"walbus dev: {'reusing' if was_running else 'starting'} the local stack in {stack.state_dir}", flush=True)
        stack.up()
        # the password stays out of the terminal (and its scrollback); `walbus dev env` gives it
        print(f"  postgres  {redact_dsn(stack.postgres.dsn)}  (pid {stack.postgres.pid})")
        pids = ", ".join(str(n.pid) for n in stack.kafka.nodes)
        print(f"  kafka     {stack.kafka.bootstrap}  (Apache Kafka {stack.kafka.version}, pid {pids})")
        where = f" --state-dir {shlex.quote(str(stack.state_dir))}" if args.state_dir else ""
        print(f'  `eval "$(walbus dev env{where})"` points the other commands at it')
    elif args.action == "down":
        stopped = stack.down(purge=args.purge)
        print("walbus dev: stopped " + (", ".join(stopped) if stopped else "nothing (not running)"))
    elif args.action == "status":
        if not stack.record.is_file():
            # No made-up ports: nothing was ever set up here.
            print(json.dumps({"state_dir": str(stack.state_dir), "stack": None}, indent=2))
            print(f"walbus dev: no stack in {stack.state_dir} (`walbus dev up` creates one)", file=sys.stderr)
            return 3
        print(json.dumps(stack.status(), indent=2))
        return 0 if stack.postgres.running() and stack.kafka.running() else 3
    elif args.action == "env":
        print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in stack.env().items()))
    return 0
