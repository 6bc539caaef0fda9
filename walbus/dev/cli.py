"""`walbus dev up | down | status | env`."""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from walbus.dev.stack import LocalStack, default_state_dir


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="walbus dev", description="The local PostgreSQL + Kafka stack.")
    parser.add_argument("--state-dir", type=Path, default=None, help="where data, logs and PIDs live (env WALBUS_STATE_DIR; default ./.walbus)")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("up", help="start PostgreSQL and Kafka (reuses a running stack)")
    down = sub.add_parser("down", help="stop both by their recorded PIDs")
    down.add_argument("--purge", action="store_true", help="also delete the state directory")
    sub.add_parser("status", help="what runs where (JSON)")
    sub.add_parser("env", help="print `export WALBUS_...` lines for the shell")
    args = parser.parse_args(argv)
    stack = LocalStack.load(args.state_dir or default_state_dir())
    if args.action == "up":
        was_running = stack.postgres.running() and stack.kafka.running()
        print(f"walbus dev: {'reusing' if was_running else 'starting'} the local stack in {stack.state_dir}", flush=True)
        stack.up()
        print(f"  postgres  {stack.postgres.dsn}  (pid {stack.postgres.pid})")
        print(f"  kafka     {stack.kafka.bootstrap}  (pid {stack.kafka.pid})")
        print("  `eval $(walbus dev env)` points the other commands at it")
    elif args.action == "down":
        stopped = stack.down(purge=args.purge)
        print("walbus dev: stopped " + (", ".join(stopped) if stopped else "nothing (not running)"))
    elif args.action == "status":
        print(json.dumps(stack.status(), indent=2))
        return 0 if stack.postgres.running() and stack.kafka.running() else 3
    elif args.action == "env":
        print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in stack.env().items()))
    return 0
