"""The producer's one config object (flags = WALBUS_* env vars = TOML keys)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from walbus.config import INT32_MAX, PORT_MAX, ConfigError, load_config, option, parse_dsn
from walbus.contract import MAX_DATABASE_TOPIC_LENGTH, database_topic, topic_name_error
from walbus.kafka import KafkaOptions
from walbus.metrics import DEFAULT_METRICS_ADDR

# PostgreSQL's rule for replication slot names.
_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")
_SLOT_UNSAFE = re.compile(r"[^a-z0-9_]")
_SLOT_PREFIX = "walbus_"
SNAPSHOT_MODES = ("initial", "when_needed", "always", "never", "no_data", "initial_only")


def default_slot_name(database: str) -> str:
    """``walbus_<database>`` as a valid slot name (lower-case letters, digits, '_', at most 63
    bytes). When the database's name had to be changed for that, a hash of the exact name
    is appended, so two databases never share a slot name."""
    body = _SLOT_UNSAFE.sub("_", database.lower())
    if body == database and len(_SLOT_PREFIX) + len(body) <= 63:
        return _SLOT_PREFIX + body
    digest = hashlib.sha256(database.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{_SLOT_PREFIX}{body[: 63 - len(_SLOT_PREFIX) - 9]}_{digest}"


MIN_HEARTBEAT_S = 0.1  # a shorter one means a record at every loop


@dataclass(kw_only=True)
class ProducerConfig(KafkaOptions):
    pg_dsn: str = option(help="PostgreSQL connection string (URI or key=value); needs the REPLICATION privilege")
    slot: str | None = option(None, help="logical replication slot (default walbus_<database>)")
    plugin: str = option("pgoutput", help="output plugin", choices=["pgoutput", "wal2json"])
    publication: str | None = option(None, help="pgoutput publication (default walbus_<database>), created if missing")
    topic: str | None = option(None, topic=True, help="database topic (default <topic-prefix>.<database>)")
    topic_prefix: str = option("walbus", topic=True, help="prefix of the default topic name")
    partitions: int = option(1, minimum=1, maximum=INT32_MAX, help="partitions of the database topic when it is created (1: one total order)")
    repartition: bool = option(
        False, help="write over every partition the database topic has now, not the count recorded at its first start "
        "(after partitions were added: stop the producer, let the demux and every Feed reach the topic's end, then start "
        "it once with this flag)", env="command",
    )
    replication_factor: int | None = option(
        None, minimum=1, maximum=32767, help="replication factor of the topics when created (default: 3 with min.insync.replicas=2 on a cluster of 3+ brokers, else 1)"
    )
    tables: list[str] = option([], help="include list: table patterns (docs/contract.md), comma-separated")
    exclude_tables: list[str] = option([], help="exclude list: table patterns")
    exclude_columns: list[str] = option([], help="schema.table.column patterns left out of events")
    mask_columns: list[str] = option([], help="schema.table.column patterns whose values are replaced by ****")
    heartbeat_interval: float = option(
        10.0, minimum=0, maximum=86400, help="seconds between heartbeat records on <topic>.heartbeat (and confirmations of the server's position while "
        "captured tables are idle); 0: no heartbeat records, the position is still confirmed every 10 s",
    )
    heartbeat_action_query: str | None = option(
        None, help="SQL run on a normal connection at each heartbeat (e.g. an UPDATE of a heartbeat table, so that the slot of "
        "a quiet database advances); a failure is logged, counted and tried again at the next beat",
    )
    metrics_port: int = option(0, minimum=0, maximum=PORT_MAX, help="serve Prometheus /metrics, /healthz and /readyz on this port (0: off)", env="legacy")
    metrics_addr: str = option(DEFAULT_METRICS_ADDR, help="address the metrics port binds (0.0.0.0: every interface)")
    drop_slot_on_exit: bool = option(False, help="drop the replication slot when the producer exits")
    transaction_metadata: bool = option(False, help="emit BEGIN/END records on <topic>.transaction")
    max_batch_bytes: int = option(1 << 20, minimum=1024, maximum=INT32_MAX, help="Kafka record batch size in bytes")
    max_in_flight: int = option(8, minimum=1, maximum=1000, help="unacknowledged Kafka batches before reading pauses (backpressure)")
    compression: str = option("none", help="Kafka batch compression (lz4, zstd, snappy and gzip; all but gzip need the cramjam package; lz4 batches are built natively, at a fraction of the cost)", choices=["none", "gzip", "lz4", "zstd", "snappy"])
    kafka_request_timeout_ms: int = option(30000, minimum=1, maximum=INT32_MAX, help="how long a Kafka batch may wait for its acknowledgement before the stream restarts")
    retry_attempts: int = option(0, minimum=0, help="give up after this many consecutive failures at one position (N-1 reconnects; 0: never give up)")
    retry_max_delay: float = option(60.0, minimum=0.001, maximum=86400, help="longest backoff between reconnects, seconds")
    snapshot_mode: str = option(
        "initial", help="when to read the tables at start (Debezium's snapshot.mode; docs/operations.md)",
        choices=list(SNAPSHOT_MODES),
    )
    snapshot_workers: int = option(1, minimum=1, maximum=256, help="parallel connections reading the initial snapshot")
    snapshot_fetch_rows: int = option(10000, minimum=1, maximum=INT32_MAX, help="rows fetched per round trip while snapshotting")
    key_columns: str | None = option(
        None, help="message key columns per table, Debezium's message.key.columns: 'public.orders:col1,col2;inventory.*:sku' "
        "(table patterns as --tables; a name holding , : ; or a dot in double quotes)",
    )
    signal_table: str | None = option(None, help="schema.table of the signal table (incremental snapshots)")
    signal_topic: str | None = option(
        None, topic=True, help="Kafka topic of signals (records keyed with the database topic's name), created with one partition if missing",
    )
    incremental_chunk_size: int = option(1024, minimum=1, maximum=INT32_MAX, help="rows per incremental-snapshot chunk")
    incremental_filter_timeout: float = option(
        300.0, minimum=0, maximum=INT32_MAX, help="seconds one query of a table with an additional-conditions filter may run; longer fails the table (0: no limit)",
    )
    incremental_lock_timeout: float = option(
        10.0, minimum=0.001, maximum=INT32_MAX, help="seconds an incremental-snapshot query may wait for its table's lock "
        "(held by another session); then the table is retried later, behind the tables queued after it when its reading "
        "has not begun",
    )
    log_level: str = option("info", help="log level", choices=["debug", "info", "warning", "error"])

    @property
    def database(self) -> str:
        params = parse_dsn(self.pg_dsn, "--pg-dsn")
        db = params.get("dbname") or params.get("user")
        if not db:
            raise ConfigError("--pg-dsn must name a database (dbname=… or /dbname in the URI)")
        return str(db)

    @property
    def slot_name(self) -> str:
        return self.slot or default_slot_name(self.database)

    @property
    def publication_name(self) -> str:
        return self.publication or f"walbus_{self.database}".replace("-", "_").lower()

    @property
    def topic_name(self) -> str:
        return self.topic or database_topic(self.topic_prefix, self.database)


def load(argv: Sequence[str] | None) -> ProducerConfig:
    cfg = load_config(
        ProducerConfig, argv, prog="walbus produce",
        description="Stream a PostgreSQL database's changes into its Kafka topic.", section="produce",
    )
    _ = cfg.database  # validates the DSN now
    # The side topics (<topic>.transaction, .heartbeat, …) must be legal names too.
    problem = topic_name_error(cfg.topic_name, limit=MAX_DATABASE_TOPIC_LENGTH)
    if problem is not None:
        raise ConfigError(f"--topic (or --topic-prefix) {problem}")
    if cfg.slot is not None and not _SLOT_NAME.fullmatch(cfg.slot):
        raise ConfigError(f"--slot {cfg.slot!r}: a slot name has 1 to 63 lower-case letters, digits and underscores")
    if cfg.partitions < 1 or (cfg.replication_factor is not None and cfg.replication_factor < 1):
        raise ConfigError("--partitions and --replication-factor must be at least 1")
    if not cfg.heartbeat_interval >= 0:  # also refuses NaN
        raise ConfigError("--heartbeat-interval must be 0 (off) or a number of seconds")
    if 0 < cfg.heartbeat_interval < MIN_HEARTBEAT_S:  # 1e-9 wrote a record each loop (a re-fuzz)
        raise ConfigError(f"--heartbeat-interval must be 0 (off) or at least {MIN_HEARTBEAT_S} s")
    if cfg.heartbeat_action_query is not None and not cfg.heartbeat_action_query.strip():
        raise ConfigError("--heartbeat-action-query is empty")
    if cfg.heartbeat_action_query and not cfg.heartbeat_interval:
        raise ConfigError("--heartbeat-action-query runs at each heartbeat: set --heartbeat-interval above 0")
    return cfg
