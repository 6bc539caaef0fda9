"""``walbus warehouse load``, ``stream``, ``sql`` and ``prepare``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from walbus.config import INT32_MAX, PORT_MAX, ConfigError, load_config, option
from walbus.contract import ContractError, Lsn, NameMatcher
from walbus.kafka import KafkaOptions
from walbus.logs import setup_logging
from walbus.metrics import DEFAULT_METRICS_ADDR
from walbus.process import exit_on_sigterm
from warehouse import NUMERIC_SCALE
from warehouse.extra import spark_missing
from warehouse.layout import absolute_root
from warehouse.spark import stop_jvm  # no pyspark import: the commands that need none stay light

if TYPE_CHECKING:
    from warehouse.metrics import WarehouseMetrics

USAGE = """usage: walbus warehouse <command> [options]

commands:
  load    load the database topic into history and current tables (Delta)
  stream  the same load as a Spark Structured Streaming query (checkpointed; any Spark cluster)
  sql     run a Spark SQL query over a warehouse's tables
  prepare fetch Spark's connector jars and write the driver JVM's class archive (once a host)

`walbus warehouse <command> --help` for the options.
"""

log = logging.getLogger("walbus.warehouse")


@dataclass(kw_only=True)
class SparkOptions:
    master: str | None = option(
        None, help="Spark master (local[2], yarn, spark://…, k8s://…); default: spark-submit's or local[*]"
    )
    driver_memory: str = option("1g", help="spark.driver.memory when this command starts the driver")
    shuffle_partitions: int = option(4, minimum=1, maximum=INT32_MAX, help="spark.sql.shuffle.partitions")
    spark_conf: list[str] = option(
        [], help="extra Spark settings, key=value; repeat the flag or separate with commas (a value may hold commas)",
        key_values=True,
    )
    log_level: str = option("warning", help="log level", choices=["debug", "info", "warning", "error"])

    def spark_settings(self) -> dict[str, str]:
        conf = {"spark.driver.memory": self.driver_memory}
        for item in self.spark_conf:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"--spark-conf: {item!r} is not key=value")
            conf[key.strip()] = value.strip()
        return conf


@dataclass(kw_only=True)
class CatalogOptions:
    catalog_database: str | None = option(
        None,
        help="a database of Spark's Hive catalog: load/stream name each table's Delta tables in it "
        "(<name>_history, <name>_current; docs/warehouse.md), sql makes it the current database; a local "
        "warehouse keeps the metastore in <warehouse>/_walbus.catalog; default: no catalog",
    )

    def __post_init__(self) -> None:
        if self.catalog_database is not None:
            from warehouse.catalog import check_database

            check_database(self.catalog_database)  # ValueError: a configuration error


@dataclass(kw_only=True)
class LoadConfig(CatalogOptions, SparkOptions, KafkaOptions):
    topic: str = option(topic=True, help="the database topic, walbus.<database>")
    warehouse: str = option(help="warehouse root: a directory or a Hadoop filesystem URI (s3a://, hdfs://, …)")
    tables: list[str] = option([], help="only these tables: table patterns (docs/contract.md), comma-separated")
    numeric_scale: int = option(NUMERIC_SCALE, minimum=0, maximum=38, help="scale of decimal(38, s) for new numeric columns")
    skip_invalid: bool = option(
        False,
        help="quarantine records that are not contract-v1 events (<warehouse>/<topic>/_walbus_quarantine) "
        "and load the rest; default: such a record fails the load",
    )
    parallel_tables: int = option(
        8, minimum=1, maximum=256, help="tables written at once (driver threads): their fixed Spark/Delta costs overlap"
    )
    slice_reader: str = option(
        "auto",
        help="how load reads its slice of the topic: workers (the decoding Python workers fetch it; they need "
        "walbus' Kafka settings and TLS files on their host), spark (Spark's Kafka source); auto: workers when "
        "every executor runs on this host (local[…], a loopback cluster), else spark. stream: always spark",
        choices=["auto", "workers", "spark"],
    )
    metrics_file: str | None = option(
        None,
        help="write Prometheus metrics to this file after each load and at exit (node_exporter's textfile "
        "collector); default: none",
        env="command",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.warehouse = absolute_root(self.warehouse)
        if self.parallel_tables < 1:
            raise ValueError(f"--parallel-tables: {self.parallel_tables} is not a positive number")
        if self.metrics_file is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.metrics_file))):
            raise ValueError(f"--metrics-file: the directory of {self.metrics_file!r} does not exist")


@dataclass(kw_only=True)
class StreamConfig(LoadConfig):
    checkpoint: str | None = option(None, help="Spark checkpoint directory; default <warehouse>/<topic>/_walbus_stream")
    trigger: str = option(
        "available-now",
        help="available-now: load everything there is, then exit; or an interval ('30 seconds'): run until stopped",
    )

    metrics_port: int | None = option(
        None, minimum=0, maximum=PORT_MAX, help="serve Prometheus /metrics, /healthz and /readyz on this port; default: none", env="command"
    )
    metrics_addr: str = option(DEFAULT_METRICS_ADDR, help="address the metrics port binds (0.0.0.0: every interface)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.metrics_port is not None and not 0 < self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port: {self.metrics_port} is not a TCP port")
        if self.slice_reader == "workers":
            raise ValueError("--slice-reader workers: stream reads with Spark's Kafka source (its checkpoint holds the offsets)")
        if self.trigger != "available-now" and not re.fullmatch(r"[0-9]+ *(milliseconds?|seconds?|minutes?|hours?)", self.trigger):
            raise ValueError(f"--trigger: {self.trigger!r} is neither available-now nor an interval like '30 seconds'")


@dataclass(kw_only=True)
class SqlConfig(CatalogOptions, SparkOptions):
    warehouse: str = option(help="warehouse root: a directory or a Hadoop filesystem URI")
    topic: str | None = option(None, topic=True, help="the topic whose tables to expose (needed if the warehouse has several)")
    query: str | None = option(None, help="the SQL query (or give it as the one argument that is no option's value)")
    format: str = option("table", help="output format", choices=["table", "json"])
    limit: int = option(1000, minimum=0, maximum=INT32_MAX, help="print at most this many rows")
    as_of_lsn: str | None = option(
        None, help="show the tables as of this commit LSN (16/B374D848), rebuilt from their history"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.warehouse = absolute_root(self.warehouse)
        if self.as_of_lsn is not None:
            Lsn.parse(self.as_of_lsn)  # ValueError: a configuration error


@dataclass(kw_only=True)
class PrepareConfig(SparkOptions):
    force: bool = option(False, help="resolve the jars and write the class archive again even when they are there")


def _session(config: LoadConfig | SqlConfig) -> Any:
    from warehouse.spark import build_session

    conf = config.spark_settings()
    if config.catalog_database is not None:
        from warehouse.catalog import session_conf

        conf = {**conf, **session_conf(config.warehouse, conf)}
    return build_session(master=config.master, conf=conf, shuffle_partitions=config.shuffle_partitions)


def _spec(config: LoadConfig) -> Any:
    from warehouse.job import LoadSpec

    kafka = KafkaOptions(**{f.name: getattr(config, f.name) for f in dataclasses.fields(KafkaOptions)})
    return LoadSpec(
        kafka, config.topic, config.warehouse, tuple(config.tables), config.numeric_scale,
        skip_invalid=config.skip_invalid, parallel_tables=config.parallel_tables,
        catalog_database=config.catalog_database, slice_reader=config.slice_reader,
    )


def _failed(command: str, e: BaseException) -> int:
    """A Spark/JVM failure as one readable line on stderr (the trace goes to the log); exit 1."""
    log.debug("%s failed", command, exc_info=True)
    text = str(e).strip()
    detail = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
    print(f"walbus warehouse {command}: error: {detail}", file=sys.stderr)
    return 1


def _metrics(config: LoadConfig) -> WarehouseMetrics:
    from walbus.metrics import new_registry
    from warehouse.metrics import WarehouseMetrics

    return WarehouseMetrics(new_registry(), config.topic, config.metrics_file)


def load_main(argv: Sequence[str]) -> int:
    config = load_config(LoadConfig, argv, prog="walbus warehouse load", section="warehouse")
    config.kafka_client_kwargs()  # its Kafka settings checked before Spark starts
    try:
        NameMatcher(config.tables)
    except ContractError as e:
        raise ConfigError(f"--tables: {e}") from None
    setup_logging(config.log_level)
    from warehouse.job import LoadError, LoadResult, run_load
    from warehouse.read import TopicError

    spec = _spec(config)
    metrics = _metrics(config)
    spark = _session(config)
    result = LoadResult()
    started = time.monotonic()
    try:
        run_load(spark, spec, result)
    except (LoadError, TopicError) as e:
        metrics.failed(result)
        print(f"walbus warehouse load: error: {e}", file=sys.stderr)
        return 1
    except ConfigError:  # e.g. Kafka refusing the login: exit 2, as at any command's start
        metrics.failed(result)
        raise
    except Exception as e:  # Spark/JVM failures
        metrics.failed(result)
        return _failed("load", e)
    else:
        metrics.succeeded(result, time.monotonic() - started)
    finally:
        stop_jvm(spark)  # not spark.stop(): after a Ctrl-C the driver JVM ran on, orphaned
        metrics.write()
    for line in result.lines():
        print(line)
    print(f"loaded {result.events} events in {result.seconds:.1f} s (loads {result.batches})", file=sys.stderr)
    return 0


def stream_main(argv: Sequence[str]) -> int:
    # A SIGTERM (an orchestrator's stop) ends the stream as Ctrl-C does, through the finally
    # below (the query and Spark stopped, the metrics written): it killed the process at once
    # (-15), and its driver JVM ran on for 20-50 s after it.
    exit_on_sigterm()
    config = load_config(StreamConfig, argv, prog="walbus warehouse stream", section="warehouse")
    config.kafka_client_kwargs()  # its Kafka settings checked before Spark starts
    setup_logging(config.log_level)
    from walbus.metrics import serve_metrics
    from warehouse.stream import start_stream

    metrics = _metrics(config)
    queries: list[Any] = []  # the query, once started: ready while it runs
    failures: list[BaseException] = []  # what micro-batches raised
    server = serve_metrics(
        config.metrics_port, metrics.registry, addr=config.metrics_addr,
        ready=lambda: bool(queries) and bool(queries[0].isActive),
    )
    spark = _session(config)
    # From here a SIGTERM is a Ctrl-C (PySpark's handler cancels the running jobs), exit 0: a
    # SystemExit raised inside a Py4J call left the next one (spark.stop()) hanging.
    terminated: list[int] = []
    on_interrupt = signal.getsignal(signal.SIGINT)
    if callable(on_interrupt):
        def on_terminate(signum: int, frame: Any) -> None:
            terminated.append(signum)
            on_interrupt(signal.SIGINT, frame)

        signal.signal(signal.SIGTERM, on_terminate)
    try:
        query = start_stream(
            spark, _spec(config), checkpoint=config.checkpoint, trigger=config.trigger,
            metrics=metrics, failures=failures,
        )
        queries.append(query)
        query.awaitTermination()
    except KeyboardInterrupt:
        return 0 if terminated else 130
    except Exception as e:  # the query's failure
        if not metrics.failed_runs:  # not a micro-batch's (that one counted itself): the source's, say
            metrics.failed()
        # A micro-batch's own error (a schema change, say), as load says it; Spark's names
        # only the Python traceback that carried it.
        return _failed("stream", failures[-1] if failures else e)
    finally:
        if server is not None:  # first: a scrape would ask a stopped JVM whether the query runs
            server.shutdown()
        stop_jvm(spark)  # not spark.stop(): after a Ctrl-C the driver JVM ran on, orphaned
        metrics.write()
    return 0


def run_sql(
    spark: Any, warehouse: str, topic: str | None, query: str, limit: int, as_of_lsn: int | None = None,
    catalog_database: str | None = None, *, text_times: bool = False,
) -> tuple[list[str], list[Any]]:
    """Register the warehouse's views (as of ``as_of_lsn``) and run ``query``: (column names,
    rows). With ``catalog_database`` the other names are those of that catalog database.
    ``text_times``: timestamps as ISO 8601 text (:func:`warehouse.views.times_as_text`)."""
    from warehouse.schema import quote
    from warehouse.views import register_views, times_as_text

    names = register_views(spark, warehouse, topic, as_of_lsn)
    log.info("views", extra={"views": names})
    if catalog_database is not None:
        spark.sql(f"USE {quote(catalog_database)}")
    df = spark.sql(query)
    columns = list(df.columns)
    df = df.limit(limit)
    return columns, (times_as_text(df) if text_times else df).collect()


_SQL_PROG = "walbus warehouse sql"


def _query_argument(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the query given as the one argument that is no option's value, wherever it is; the
    other arguments). Only the first argument was taken so: a query after the options was
    counted word by word as "10 argument(s) this command does not take" (a fuzz)."""
    from walbus.config import build_parser

    parser = build_parser(SqlConfig, _SQL_PROG, command="warehouse")
    parser.add_argument("words", nargs="*", help=argparse.SUPPRESS)
    words: list[str] = getattr(parser.parse_intermixed_args(argv), "words", [])
    if not words:
        return None, list(argv)
    if len(words) > 1:
        raise ConfigError(
            f"{len(words)} arguments that are no option's value: the query is one argument, "
            'in quotes (walbus warehouse sql "SELECT …" --warehouse …)'
        )
    for i, token in enumerate(argv):
        rest = [*argv[:i], *argv[i + 1:]]
        if token == words[0] and not getattr(parser.parse_intermixed_args(rest), "words", []):
            return token, rest
    raise AssertionError("the query argument is one of the arguments")


def sql_main(argv: Sequence[str]) -> int:
    positional, args = _query_argument(argv)
    config = load_config(SqlConfig, args, prog=_SQL_PROG, section="warehouse")
    if config.query is not None and positional is not None:
        raise ConfigError("a query both as --query and as an argument: give one")
    query = config.query or positional
    if not query:
        raise ConfigError('a query is needed: walbus warehouse sql "SELECT …" --warehouse …')
    setup_logging(config.log_level)
    spark = _session(config)
    try:
        as_of = Lsn.parse(config.as_of_lsn) if config.as_of_lsn is not None else None
        columns, rows = run_sql(
            spark, config.warehouse, config.topic, query, config.limit, as_of, config.catalog_database, text_times=True
        )
    except Exception as e:
        return _failed("sql", e)
    finally:
        stop_jvm(spark)  # not spark.stop(): after a Ctrl-C the driver JVM ran on, orphaned
    if config.format == "json":
        try:
            lines = [json_line(row_dict(row)) for row in rows]  # all checked before the first is printed
        except ValueError as e:
            return _failed("sql", e)
        for line in lines:
            print(line)
    else:
        print_table(columns, [[row[i] for i in range(len(columns))] for row in rows])
    return 0


def prepare_main(argv: Sequence[str]) -> int:
    config = load_config(PrepareConfig, argv, prog="walbus warehouse prepare", section="warehouse")
    setup_logging(config.log_level)
    from warehouse.prepare import prepare

    try:
        done = prepare(master=config.master or "local[2]", conf=config.spark_settings(), force=config.force)
    except Exception as e:
        return _failed("prepare", e)
    print("spark jars:", " ".join(done.packages))
    print(f"jar list: {done.jars}" if done.jars else "jar list: none kept (WALBUS_SPARK_DRIVER_CACHE=off)")
    if done.archive is None:
        print("class archive: none (WALBUS_SPARK_DRIVER_CACHE=off, or no java found)")
    else:
        print(f"class archive: {done.archive} ({'written' if done.written else 'already there'})")
    return 0


def _json_safe(value: Any) -> Any:
    """A value as ``--format json`` writes it: JSON has no NaN or infinity (orjson wrote them as
    null, a SQL NULL to the reader: a fuzz), so they are PostgreSQL's text, ``NaN``,
    ``Infinity``, ``-Infinity``; binary is PostgreSQL's bytea text (``\\x00ff``), not Python's repr."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (bytes, bytearray)):
        return "\\x" + bytes(value).hex()
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def row_dict(row: Any) -> dict[str, Any]:
    """A result row as a dict for ``--format json``, its structs too. Two columns (or struct
    fields) of one name raise ValueError: a JSON object holds one (``SELECT 1 AS x, 2 AS x``
    printed ``{"x":2}``, the other value lost without a word)."""
    names = list(row.__fields__)
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"--format json: the result has more than one column (or struct field) named {', '.join(map(repr, twice))}, "
            "and a JSON object holds one: name them apart (… AS x2), or use --format table"
        )
    return {n: _plain(v) for n, v in zip(names, row, strict=True)}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple) and hasattr(value, "__fields__"):  # a struct: a pyspark Row
        return row_dict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def json_line(row: dict[str, Any]) -> str:
    """One row of ``walbus warehouse sql --format json`` (decimals as exact strings)."""
    return orjson.dumps(_json_safe(row), default=str).decode()


def print_table(columns: list[str], rows: list[list[Any]]) -> None:
    """Rows as an aligned text table (used by `walbus warehouse sql` and `walbus demo`)."""
    cells = [[("NULL" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    print(f"({len(rows)} rows)")


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    commands = {"load": load_main, "stream": stream_main, "sql": sql_main, "prepare": prepare_main}
    command = commands.get(args[0])
    if command is None:
        print(f"walbus warehouse: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    missing = spark_missing()
    if missing is not None and not {"-h", "--help"} & set(args[1:]):
        print(f"walbus warehouse {args[0]}: error: {missing}", file=sys.stderr)
        return 2
    return command(args[1:])
