"""The `walbus` command: parses the subcommand and hands over. No logic here."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from walbus.process import exit_on_sigterm

USAGE = """usage: walbus <command> [options]

commands:
  dev up|down|status|env   the local PostgreSQL + Kafka stack
  produce                  stream a database's changes into its Kafka topic
  demux                    re-key the database topic into compacted per-table topics
  warehouse load|sql       load history and current-state tables with Spark
  tail                     print a database topic's events as JSON lines
  dead-letters list|replay a consumer group's dead letters: show them, or send them back
  groups                   consumer groups on walbus topics, with their lag
  status                   where the data is: slot lag, topic offsets, group lag, warehouse
  demo                     run the whole pipeline on the local stack

`walbus <command> --help` for the options of one command; `walbus --version`.
"""


# Each command's module, imported only when it runs: `walbus dev` must not pay for Spark.
COMMANDS = {
    "dev": "walbus.app.dev.cli",
    "produce": "producer.service",
    "demux": "demux.service",
    "warehouse": "warehouse.cli",
    "tail": "walbus.app.tail",
    "dead-letters": "walbus.app.deadletters",
    "groups": "walbus.app.groups",
    "status": "walbus.app.status",
    "demo": "walbus.app.demo",
}


SERVICES = ("produce", "demux")  # long-running: stopped by SIGTERM


def _load(command: str) -> Callable[[Sequence[str]], int]:
    module = importlib.import_module(COMMANDS[command])
    entry: Callable[[Sequence[str]], int] = module.main
    return entry


def version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("walbus")
    except PackageNotFoundError:
        from walbus import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C while a command is imported or set up: no traceback
        return 130


def _main(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"walbus {version()}")
        return 0
    if args[0] not in COMMANDS:
        print(f"walbus: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    if args[0] in SERVICES:
        # First, before any import: a SIGTERM while a service starts is a clean stop (exit 0),
        # not a crash (-15); importing a service alone takes ~0.2 s, more on a loaded machine.
        exit_on_sigterm()
    from walbus.app.commands import register as register_commands
    from walbus.app.dev.processes import StackError
    from walbus.config import ConfigError
    from walbus.logs import redact_dsn, setup_logging

    # JSON lines from the start: the configuration's own warnings (an unknown key, a deprecated
    # env var) come before the command sets its --log-level, and were plain text.
    setup_logging("warning")
    register_commands()  # the configuration's typo check knows every command's options
    try:
        return _load(args[0])(args[1:])
    except (ConfigError, StackError) as e:
        print(f"walbus {args[0]}: error: {redact_dsn(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        # A fault we could not recover from: one clear line, the traceback in the log. Nothing
        # is lost: the producer confirms the slot only for what Kafka acknowledged, the demux
        # commits offsets only with its output.
        logging.getLogger("walbus").critical("fatal error", exc_info=True)
        print(f"walbus {args[0]}: fatal: {type(e).__name__}: {redact_dsn(str(e))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
