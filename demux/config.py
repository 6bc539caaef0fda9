"""`walbus demux` options: flags, ``WALBUS_*`` env vars and TOML keys (section ``[demux]``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from walbus.config import INT32_MAX, PORT_MAX, ConfigError, load_config, option
from walbus.contract import demux_group, side_topic, topic_name_error, unescape_topic_part
from walbus.kafka import DEFAULT_MAX_MESSAGE_BYTES, KafkaOptions
from walbus.metrics import DEFAULT_METRICS_ADDR

# What Kafka accepts in a topic name (table names are escaped into it; these are taken as given).

# Logging levels accepted by --log-level.
LOG_LEVELS = ["debug", "info", "warning", "error"]


@dataclass(kw_only=True)
class DemuxConfig(KafkaOptions):
    source_topic: str = option(topic=True, help="the database topic to consume, e.g. walbus.shop")
    group_id: str | None = option(
        None, help="consumer group (default walbus-demux.<source-topic>); also names the transactional ids",
        env="legacy",
    )
    group_instance_id: str | None = option(
        None,
        help="static group membership (KIP-345): a name stable across restarts and unique to this process in the "
        "group (a StatefulSet pod name, say). A demux restarted under the same name gets its partitions back at "
        "once instead of after --session-timeout-ms; one stopped for good hands them over only after it",
    )
    topic_prefix: str = option("walbus", topic=True, help="per-table topics are <prefix>.<database>.<schema>.<table>")
    database: str | None = option(
        None, help="database name in the per-table topic names (default: the source topic without '<prefix>.')"
    )
    dlq_topic: str | None = option(None, topic=True, help="dead-letter topic (default <source-topic>.dlq)")
    emit_delete_records: bool = option(
        False, help="on delete, emit a record with __op=d (the last row) before the tombstone"
    )
    skip_replayed: bool = option(
        True,
        help="skip source events whose (commit_lsn, seq) key is not after the last one processed: the producer's "
        "at-least-once replays. Turn off after restoring the database to an earlier LSN (PITR)",
    )
    state_dir: str = option(
        "walbus-demux-state", help="directory of the last-row stores (SQLite, one per source partition)",
        env="legacy",
    )
    txn_max_records: int = option(20000, minimum=1, maximum=INT32_MAX, help="commit the Kafka transaction after this many source records")
    txn_max_ms: int = option(200, minimum=1, maximum=INT32_MAX, help="... or after this many milliseconds, whichever comes first")
    topic_partitions: int = option(1, minimum=1, maximum=INT32_MAX, help="partitions of the per-table topics created by the demux")
    topic_replication_factor: int | None = option(
        None, minimum=1, maximum=32767, help="replication factor of the topics created by the demux (default: 3 with min.insync.replicas=2 "
        "on a cluster of 3+ brokers, else 1)"
    )
    min_compaction_lag_ms: int | None = option(None, minimum=0, maximum=2**63 - 1, help="min.compaction.lag.ms of created per-table topics")
    delete_retention_ms: int | None = option(None, minimum=0, maximum=2**63 - 1, help="delete.retention.ms of created per-table topics (tombstone lifetime)")
    segment_ms: int | None = option(None, minimum=1, maximum=2**63 - 1, help="segment.ms of created per-table topics")
    session_timeout_ms: int = option(10000, minimum=1, maximum=INT32_MAX, help="consumer group session timeout")
    transaction_timeout_ms: int = option(60000, minimum=1, maximum=INT32_MAX, help="Kafka transaction timeout (an orphaned transaction is aborted after it)")
    metrics_port: int | None = option(None, minimum=0, maximum=PORT_MAX, help="serve Prometheus /metrics, /healthz and /readyz on this port", env="legacy")
    metrics_addr: str = option(DEFAULT_METRICS_ADDR, help="address the metrics port binds (0.0.0.0: every interface)")
    log_level: str = option("info", help="log level", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        if not self.source_topic.strip():
            raise ConfigError("--source-topic must not be empty")
        for name in ("txn_max_records", "txn_max_ms", "topic_partitions", "topic_replication_factor",
                     "session_timeout_ms", "transaction_timeout_ms"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive integer, got {getattr(self, name)}")
        for name in ("min_compaction_lag_ms", "delete_retention_ms", "segment_ms"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
        for flag, name in (("--source-topic", self.source_topic), ("--topic-prefix", self.topic_prefix),
                           ("--dlq-topic", self.dlq)):
            problem = topic_name_error(name)
            if problem is not None:
                raise ConfigError(f"{flag} {problem}")
        if self.group_instance_id is not None and not self.group_instance_id.strip():
            raise ConfigError("--group-instance-id must not be empty (leave it unset for dynamic membership)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be a TCP port, got {self.metrics_port}")

    @property
    def group(self) -> str:
        return self.group_id or demux_group(self.source_topic)

    @property
    def dlq(self) -> str:
        return self.dlq_topic or side_topic(self.source_topic, "dlq")

    @property
    def database_name(self) -> str:
        """The database whose per-table topics are written (table_topic escapes it again).

        Derived from a source topic named by walbus.contract.database_topic, whose database
        part is escaped: read back, so that ``my db`` gives ``walbus.my-20db.<schema>.<table>``,
        not a twice-escaped ``my-2D20db``.
        """
        if self.database:
            return self.database
        head = self.topic_prefix + "."
        part = self.source_topic[len(head):] if self.source_topic.startswith(head) and len(self.source_topic) > len(head) else self.source_topic
        try:
            return unescape_topic_part(part)
        except UnicodeDecodeError:
            # Not walbus's escaping (a --topic of the user's choice, "walbus.shop-DE"): the
            # name as it is. Before, the demux stopped with a bare UnicodeDecodeError (a fuzz).
            return part

    def topic_configs(self, *, compact: bool) -> tuple[tuple[str, str], ...]:
        """Configs of a topic created by the demux (per-table topics and the DLQ).

        max.message.bytes is set explicitly: the broker default (1 MB) is too small for
        rows with big TOAST values (walbus.kafka.DEFAULT_MAX_MESSAGE_BYTES).
        """
        out: list[tuple[str, str]] = [
            ("cleanup.policy", "compact" if compact else "delete"),
            ("max.message.bytes", str(DEFAULT_MAX_MESSAGE_BYTES)),
        ]
        if compact and self.min_compaction_lag_ms is not None:
            out.append(("min.compaction.lag.ms", str(self.min_compaction_lag_ms)))
        if compact and self.delete_retention_ms is not None:
            out.append(("delete.retention.ms", str(self.delete_retention_ms)))
        if self.segment_ms is not None:
            out.append(("segment.ms", str(self.segment_ms)))
        return tuple(out)


def parse_config(argv: Sequence[str] | None) -> DemuxConfig:
    return load_config(
        DemuxConfig,
        argv,
        prog="walbus demux",
        description="Re-key a walbus database topic into compacted per-table topics, exactly once.",
        section="demux",
    )
