"""The `walbus` command: parses the subcommand and hands over. No logic here."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from walbus.config import ConfigError
from walbus.dev.processes import StackError

USAGE = """usage: walbus <command> [options]

commands:
  dev up|down|status|env   the local PostgreSQL + Kafka stack
  produce                  stream a database's changes into its Kafka topic
  demux                    re-key the database topic into compacted per-table topics
  warehouse load|sql       load history and current-state tables with Spark
  tail                     print a database topic's events as JSON lines
  demo                     run the whole pipeline on the local stack

`walbus <command> --help` for the options of one command.
"""


# Each command's module, imported only when it runs: `walbus dev` must not pay for Spark.
COMMANDS = {
    "dev": "walbus.dev.cli",
    "produce": "producer.service",
    "demux": "demux.service",
    "warehouse": "warehouse.cli",
    "tail": "walbus.tail",
    "demo": "walbus.demo",
}


def _load(command: str) -> Callable[[Sequence[str]], int]:
    module = importlib.import_module(COMMANDS[command])
    entry: Callable[[Sequence[str]], int] = module.main
    return entry


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"walbus: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return _load(args[0])(args[1:])
    except (ConfigError, StackError) as e:
        print(f"walbus {args[0]}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("producer", "demux", "warehouse", "walbus"):
            print(f"walbus {args[0]}: not implemented yet", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
