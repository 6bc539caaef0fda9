"""The producer service: wiring, the streaming loop, signals, retries with backoff.

Data walks one way: ReplicationStream (bytes) -> decoder (encoded events and
commits) -> KafkaSink (batches) -> Progress (acks) -> standby status update.
The slot is confirmed only up to the end of the last transaction whose every
event Kafka acknowledged: at-least-once, nothing lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson
import psycopg
from aiokafka.errors import (
    InvalidPartitionsError,
    InvalidReplicationFactorError,
    InvalidTopicError,
    KafkaError,
    PolicyViolationError,
)
from prometheus_client import CollectorRegistry

from producer import setup
from producer.catalog import Catalog
from producer.codec import CaptureFilter, ChangeRun, EncodedEvent
from producer.config import ProducerConfig, load
from producer.decoders import Decoder, LogicalMessage, TxnBegin, TxnEnd
from producer.decoders.pgoutput import PgoutputDecoder
from producer.decoders.wal2json import Wal2jsonDecoder
from producer.heartbeat import HeartbeatAction, Heartbeats, action_timeout, confirm_interval
from producer.incremental import IncrementalSnapshot
from producer.metrics import ProducerMetrics, SnapshotMetrics
from producer.offsets import COMPACTED, OffsetStore
from producer.progress import Progress
from producer.replication import ReplicationError, ReplicationStream, quote_ident
from producer.signal_topic import KafkaSignalChannel
from producer.sink import KafkaSink, SinkError
from producer.snapshot import InitialSnapshot, SnapshotAborted
from walbus.allocator import tune_collector, tune_for_large_buffers
from walbus.config import ConfigError, describe
from walbus.contract import (
    Lsn,
    heartbeat_topic,
    qualify_table,
    side_topic,
    split_pattern,
    split_table,
)
from walbus.kafka import (
    DEFAULT_MAX_MESSAGE_BYTES,
    METADATA_WAIT_S,
    KafkaAdmin,
    Stopped,
    TopicSpec,
    require_broker,
    until_stopped,
)
from walbus.logs import setup_logging
from walbus.metrics import new_registry, sample, serve_metrics
from walbus.process import exit_on_sigterm
from walbus.retry import Backoff

_T = TypeVar("_T")
log = logging.getLogger("walbus.producer")

PUBLICATION_CHECK_S = 10.0  # how often a table-list publication is checked for new captured tables
SLOT_LAG_CHECK_S = 10.0  # how often walbus_producer_slot_lag_bytes is read from the server

TRANSIENT = (ReplicationError, SinkError, KafkaError, psycopg.OperationalError, OSError, TimeoutError)




CAPTURE_FORM = 3  # records of another form (raw option strings; no signal table) are not compared


def capture_settings(cfg: ProducerConfig, capture: CaptureFilter, via_root: bool | None) -> dict[str, Any]:
    """What decides which events a producer writes and how (the settings recorded in its
    progress document, which another slot's producer on the same topic must share): the
    filters as parsed (``public."a"`` is ``public.a``; order and repeats do not count), the
    signal table (captured whatever the filters say), the plugin (wal2json writes no NaN),
    and whether the publication names partitions by their root (pgoutput's
    ``publish_via_partition_root``)."""

    def patterns(items: Sequence[str], parts: int) -> list[list[str]]:
        return [list(p) for p in sorted({split_pattern(i, parts) for i in items})]

    keys = [[list(split_pattern(p, 2)), list(cols)] for p, cols in capture.key_columns]
    named = [tuple(k[0]) for k in keys]
    if all(len(n) == 2 and "*" not in "".join(n) for n in named) and len(set(named)) == len(named):
        keys.sort()  # first match wins, but rules for distinct whole names cannot overlap
    return {
        "tables": patterns(capture.tables, 2), "exclude_tables": patterns(capture.exclude_tables, 2),
        "exclude_columns": patterns(capture.exclude_columns, 3), "mask_columns": patterns(capture.mask_columns, 3),
        "key_columns": keys,
        "signal_table": None if capture.signal_table is None else list(split_table(capture.signal_table)),
        "plugin": cfg.plugin, "publish_via_partition_root": via_root,
        "form": CAPTURE_FORM,
    }


def _setting_name(key: str) -> str:
    return "the publication's publish_via_partition_root" if key == "publish_via_partition_root" else "--" + key.replace("_", "-")


def partitions_to_write(topic_partitions: int, doc: dict[str, Any], others: dict[str, dict[str, Any]], *,
                        repartition: bool = False) -> tuple[int, int]:
    """How many of the database topic's partitions the producer writes over, and when that
    count was decided (a counter, ``partitions_since`` in the progress records): the count
    decided last among this slot's and the other slots' records, else the topic's.

    A table's partition is murmur2(table) % count: with partitions added, most tables move,
    and a consumer (the demux) reads their new events before their last old ones, in
    another partition (a delete applied before an older insert brought the row back; a
    fuzz). The count changes only when asked (``repartition``), or when the topic now has
    fewer partitions than decided (it was deleted and created again). Every slot follows the
    count decided last (each slot writes every event: two counts put a table in two
    partitions at once; a re-fuzz), not the largest: a slot's record from before the topic
    was made again smaller moved tables once partitions were added back (a re-fuzz)."""
    recorded = [(since if isinstance(since := d.get("partitions_since", 0), int) else 0, n)
                for d in (doc, *others.values()) if isinstance(n := d.get("partitions"), int) and n >= 1]
    if not recorded:
        return topic_partitions, 0
    latest = max(recorded)
    if repartition or latest[1] > topic_partitions:
        return topic_partitions, latest[0] + 1
    return latest[1], latest[0]


class Producer:
    """Streams one database's slot into its Kafka topic until :meth:`stop`."""

    def __init__(self, config: ProducerConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or new_registry()
        self.metrics = ProducerMetrics(self.registry)
        self.snapshot_metrics = SnapshotMetrics(self.registry)
        self.offsets: OffsetStore | None = None
        self.incremental: IncrementalSnapshot | None = None
        self.signal_channel: KafkaSignalChannel | None = None
        self.capture = CaptureFilter(
            tables=setup.table_patterns(config.tables, "--tables"),
            exclude_tables=setup.table_patterns(config.exclude_tables, "--exclude-tables", exact=False),
            exclude_columns=setup.column_patterns(config.exclude_columns, "--exclude-columns"),
            mask_columns=setup.column_patterns(config.mask_columns, "--mask-columns"),
            signal_table=setup.table_name(config.signal_table, "--signal-table") if config.signal_table else None,
            key_columns=setup.key_column_rules(config.key_columns),
        )
        self._stopping = asyncio.Event()
        self._partitions = 1
        self._source: dict[str, Any] = {}  # which database this is (setup.source_identity)
        self._via_root: bool | None = None  # the pgoutput publication's publish_via_partition_root
        self._max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES
        self._client_kwargs: dict[str, Any] = {}  # built once per run (an SSL context is costly)
        self.progress: Progress | None = None
        self._failed_at = -1  # the confirmed position when the stream last failed
        self._until: int | None = None  # stream only until this commit is confirmed (see run)
        self.ready = asyncio.Event()  # set once streaming started (tests, demo)
        action = (
            HeartbeatAction(config.pg_dsn, config.heartbeat_action_query, timeout_s=action_timeout(config.heartbeat_interval), metrics=self.metrics)
            if config.heartbeat_action_query else None
        )
        self.heartbeats = Heartbeats(
            interval=config.heartbeat_interval, source_topic=config.topic_name, slot=config.slot_name, metrics=self.metrics, action=action,
        )

    def stop(self) -> None:
        self._stopping.set()

    # -- set-up -----------------------------------------------------------------------------

    def _prepare_database(self) -> tuple[list[setup.TableName], setup.SlotState]:
        cfg = self.config
        with setup.connect(cfg.pg_dsn) as conn:
            setup.check_server(conn)
            setup.check_encoding(conn, cfg.plugin)
            self._source = setup.source_identity(conn)
            tables = setup.resolve_tables(conn, self.capture)
            setup.check_key_columns(conn, self.capture, tables)
            setup.warn_lost_changes(conn, cfg.plugin, tables)
            if cfg.plugin == "pgoutput":
                setup.ensure_publication(conn, cfg.publication_name, self.capture, tables)
                row = conn.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = %s", (cfg.publication_name,)).fetchone()
                self._via_root = bool(row and row[0])
            if self.capture.signal_table:
                setup.check_signal_table(conn, split_table(self.capture.signal_table), via_root=bool(self._via_root))
            state = setup.check_slot(conn, cfg.slot_name, cfg.plugin, cfg.database)
        return tables, state

    async def _prepare_kafka(self, client_kwargs: dict[str, Any]) -> None:
        try:
            await self._ensure_topics(client_kwargs)
        except InvalidTopicError as e:
            # e.g. a name Kafka finds colliding with an existing topic's ('.' and '_' alike:
            # the topic of database "x_public_t" and database x's table topic of public.t)
            raise ConfigError(f"Kafka refuses the topic: {e}. Choose another --topic") from None
        except (InvalidPartitionsError, InvalidReplicationFactorError, PolicyViolationError) as e:
            raise ConfigError(f"Kafka refuses the topic: {str(e).rstrip('.')}. Check --partitions and --replication-factor") from None

    async def _ensure_topics(self, client_kwargs: dict[str, Any]) -> None:
        cfg = self.config
        limit = (("max.message.bytes", str(DEFAULT_MAX_MESSAGE_BYTES)),)
        async with KafkaAdmin(client_kwargs=client_kwargs) as admin:
            await admin.ensure_topic(TopicSpec(cfg.topic_name, cfg.partitions, cfg.replication_factor, limit))
            if cfg.transaction_metadata:
                await admin.ensure_topic(TopicSpec(side_topic(cfg.topic_name, "transaction"), 1, cfg.replication_factor, limit))
            if cfg.heartbeat_interval:
                # Compacted: the last heartbeat of each slot is what a consumer needs.
                await admin.ensure_topic(TopicSpec(heartbeat_topic(cfg.topic_name), 1, cfg.replication_factor, COMPACTED))
            self._partitions = await admin.partitions(cfg.topic_name, wait=METADATA_WAIT_S)
            # An existing topic keeps its own limit: records are checked against what it takes.
            self._max_message_bytes = await admin.max_message_bytes(cfg.topic_name, wait=METADATA_WAIT_S)

    def _unpublished_signal(self, ev: EncodedEvent, sink: KafkaSink) -> None:
        """A signal row too large for the topic: applied, not published. Any row above the
        limit stops the producer (a configuration fault); a signal row must not (anyone who
        may insert signals could stop the stream, on every restart)."""
        self.snapshot_metrics.ignored.labels("signal-unpublished").inc()
        log.error(
            "a signal table row is above the topic's size limit: applied, not published",
            extra={"table": ev.table, "event": ev.key.decode(), "bytes": len(ev.key) + len(ev.value), "limit": sink.max_message_bytes},
        )

    async def _claim_topic(self, offsets: OffsetStore) -> None:
        """One topic per database: refuse a topic another database's producer writes.

        Positions are one database's commit LSNs, which only rise within its own stream; events
        of two databases interleave in no order, and every consumer that skips re-sent
        positions (the demux, Feed, Table) dropped whichever came late (a fuzz found it). Other
        producers of the same database (another slot) only repeat its events, which consumers
        drop by position. The source is recorded in this slot's progress document."""
        cfg = self.config
        capture = capture_settings(cfg, self.capture, self._via_root)
        self._check_own_record(offsets.doc, offsets.topic)
        self._check_claims(offsets.others, offsets.topic, capture)
        if cfg.repartition:
            await self._check_no_slot_streams(offsets)
        partitions, since = partitions_to_write(self._partitions, offsets.doc, offsets.others, repartition=cfg.repartition)
        if partitions != self._partitions:
            log.warning(
                "the database topic has more partitions than the producer writes over: partitions added later are left "
                "unused (a table moved to another partition would have its changes read out of order). To use them, stop "
                "the producer, let the demux and every Feed reach the topic's end, then start it once with --repartition",
                extra={"topic": cfg.topic_name, "partitions": self._partitions, "written": partitions},
            )
            self._partitions = partitions
        recorded = {"source": self._source, "partitions": partitions, "partitions_since": since, "capture": capture}
        if any(offsets.doc.get(k) != v for k, v in recorded.items()):
            offsets.doc.update(recorded)
            ours = dict(offsets.doc)
            at = await offsets.save()
            # Two producers starting at once both passed the check above before either wrote
            # its claim (a fuzz): the progress log's order decides. The claims written before
            # ours are read again (this slot's own too: a producer of another cluster may use
            # the same slot name); if one conflicts, ours is taken back and this one stops.
            own_before, others_before = await offsets.claims_before(at)
            try:
                self._check_own_record(own_before, offsets.topic)
                self._check_claims(others_before, offsets.topic, capture)
            except ConfigError:
                # Back to what the slot's record was before ours, unless it was written since.
                if await offsets.latest() == {**ours, "v": 1, "slot": offsets.slot}:
                    offsets.doc = own_before
                    if own_before:
                        await offsets.save()
                    else:
                        await offsets.delete()
                raise

    async def _check_partition_count(self) -> None:
        """ConfigError when another slot decided a new partition count since this producer
        started: a --repartition while this one was reconnecting passed the check for streaming
        slots, and this one went on with the old count (tables in two partitions; a re-fuzz)."""
        offsets = self.offsets
        if offsets is None:
            return
        ours = offsets.doc.get("partitions_since", 0)
        ours = ours if isinstance(ours, int) else 0
        newer = sorted(
            slot for slot, doc in (await offsets.others_now()).items()
            if isinstance(since := doc.get("partitions_since"), int) and since > ours and doc.get("partitions") != self._partitions
        )
        if newer:
            raise ConfigError(
                f"slot {newer[0]!r} changed the partition count of topic {self.config.topic_name} (--repartition) while this "
                f"producer ran with {self._partitions}: start it again to follow the new count"
            )

    async def _check_no_slot_streams(self, offsets: OffsetStore) -> None:
        """ConfigError when another slot of the topic streams: ``--repartition`` while it
        writes with the old count put every moved table in two partitions at once (a re-fuzz)."""
        cfg = self.config
        names = sorted(offsets.others)
        if not names:
            return

        def active() -> list[str]:
            with setup.connect(cfg.pg_dsn) as conn:
                rows = conn.execute(
                    "SELECT slot_name FROM pg_replication_slots WHERE active AND slot_name = ANY(%s) ORDER BY 1", (names,)
                ).fetchall()
            return [str(r[0]) for r in rows]

        streaming = await asyncio.to_thread(active)
        if streaming:
            raise ConfigError(
                f"--repartition while other slots of topic {cfg.topic_name} stream ({', '.join(streaming)}): they would go on "
                f"writing with the old partition count. Stop their producers first, then start them again after this one"
            )

    def _check_own_record(self, doc: dict[str, Any], offsets_topic: str) -> None:
        """ConfigError when this slot's record names another database: a database of another
        cluster (or one dropped and created again) with the same name has the same default
        slot and topic, and the two went on writing one topic, their positions interleaved
        (a fuzz)."""
        source = doc.get("source")
        if isinstance(source, dict) and not setup.same_source(source, self._source):
            slot = self.config.slot_name
            raise ConfigError(
                f"topic {self.config.topic_name} is written by the producer of another database ({source.get('database')!r}, "
                f"system {source.get('system')}, oid {source.get('database_oid')}) under this slot's name {slot!r} (its record "
                f"in {offsets_topic}): its positions and this database's would interleave and consumers would drop events. "
                f"Give this database a topic of its own (--topic), or, if that producer is gone for good (e.g. the database "
                f"was created again), delete its record (key {slot!r}) from {offsets_topic}"
            )

    def _check_claims(self, others: dict[str, dict[str, Any]], offsets_topic: str, capture: dict[str, Any]) -> None:
        """ConfigError when another slot's record on the topic forbids this producer there."""
        cfg = self.config
        for slot, doc in sorted(others.items()):
            source = doc.get("source")
            if isinstance(source, dict) and not setup.same_source(source, self._source):
                raise ConfigError(
                    f"topic {cfg.topic_name} is written by the producer of another database ({source.get('database')!r}, "
                    f"system {source.get('system')}, slot {slot!r}, recorded in {offsets_topic}): its positions and this "
                    f"database's would interleave and consumers would drop events. Give this database a topic of its own "
                    f"(--topic), or, if that producer is gone for good, delete its record (key {slot!r}) from {offsets_topic}"
                )
            # Another slot of this database repeats its events only when it captures the same:
            # seq numbers a transaction's captured changes, so under other filters one position
            # names two different events, and consumers kept whichever came first (a fuzz).
            theirs = doc.get("capture")
            differ = sorted(k for k in set(capture) | set(theirs) if capture.get(k) != theirs.get(k)) \
                if isinstance(theirs, dict) else []
            if isinstance(source, dict) and isinstance(theirs, dict) and theirs.get("form") == CAPTURE_FORM and differ:
                raise ConfigError(
                    f"topic {cfg.topic_name} is written by another producer of this database (slot {slot!r}, recorded in "
                    f"{offsets_topic}) that captures otherwise ({', '.join(_setting_name(k) for k in differ)}: "
                    f"theirs {[theirs.get(k) for k in differ]}, ours {[capture.get(k) for k in differ]}): one position would "
                    f"name two different events and consumers would drop one. Capture the same, give this producer a topic "
                    f"of its own (--topic), or, if that producer is gone for good, delete its record (key {slot!r}) from "
                    f"{offsets_topic}"
                )

    # -- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.config
        log.info("producer starting", extra={"config": describe(cfg)})
        client_kwargs = self._client_kwargs = cfg.kafka_client_kwargs()
        # The broker answers (nothing created), then the database is checked and set up, then
        # the topics: a refusal by the database (a mistyped name, a missing privilege) left its
        # topics behind (a fuzz). A topic Kafka refuses leaves at most the publication, which
        # the next start takes as it is. The database's set-up needs nothing of Kafka; what
        # needs both (the topic's claims and partition count, the progress records) comes after.
        # Nothing in these steps looks at the stop flag, and each may wait long for an answer (a
        # broker's retries, PostgreSQL's 10 s connect timeout): a stop abandons them.
        prepared: tuple[list[setup.TableName], setup.SlotState] | Stopped = Stopped.STOPPED
        if await until_stopped(require_broker(client_kwargs), self._stopping) is not Stopped.STOPPED:
            prepared = await until_stopped(in_daemon_thread(self._prepare_database), self._stopping)
        if prepared is Stopped.STOPPED or await until_stopped(self._prepare_kafka(client_kwargs), self._stopping) is Stopped.STOPPED:
            log.info("stopped while starting")
            return
        tables, slot = prepared
        signal_table = self.capture.signal_table
        if signal_table and split_table(signal_table) not in tables:
            raise ConfigError(
                f"signal table {signal_table} does not exist: CREATE TABLE {setup.sql_table(split_table(signal_table))} "
                "(id varchar(64) PRIMARY KEY, type varchar(32) NOT NULL, data text)"
            )
        offsets = self.offsets = OffsetStore(client_kwargs, cfg.topic_name, cfg.slot_name, replication_factor=cfg.replication_factor)
        await offsets.start()
        backoff = Backoff(maximum=cfg.retry_max_delay, attempts=cfg.retry_attempts)
        watch: asyncio.Task[None] | None = None
        lag_watch: asyncio.Task[None] | None = None
        try:
            await self._claim_topic(offsets)
            # Snapshot hook: creates the slot (with an exported snapshot when one is due) and reads it.
            initial = InitialSnapshot(
                cfg, self.capture, offsets=offsets, metrics=self.snapshot_metrics, client_kwargs=client_kwargs,
                partitions=self._partitions, stopping=self._stopping, new_sink=self._new_sink,
            )
            if cfg.signal_table or cfg.signal_topic:
                self.incremental = IncrementalSnapshot(cfg, self.capture, offsets=offsets, metrics=self.snapshot_metrics)
            if cfg.signal_topic:
                assert self.incremental is not None
                self.signal_channel = KafkaSignalChannel(
                    client_kwargs, cfg.signal_topic, own_key=cfg.topic_name, replication_factor=cfg.replication_factor,
                )
                await self.signal_channel.start(self.incremental.signal_offset)
            if cfg.plugin == "pgoutput":
                watch = asyncio.create_task(self._watch_publication(), name="walbus-publication-watch")
            lag_watch = asyncio.create_task(self._watch_slot_lag(), name="walbus-slot-lag")
            target = await initial.open_transaction_position(slot)
            if target is not None:
                # The topic's last transaction may be only partly in it (stopped in the middle):
                # the slot sends it again after the snapshot, with its own commit LSN, below the
                # reads', and consumers skipped its missing events (a row deleted in it stayed
                # live; found by a fuzz). Complete it first: stream up to its commit, then read.
                log.info(
                    "completing the topic's last transaction from the slot before the snapshot",
                    extra={"slot": cfg.slot_name, "commit_lsn": str(Lsn(target)), "confirmed_lsn": str(Lsn(slot.confirmed_flush_lsn))},
                )
                await self._stream(backoff, until=target)
                if self._stopping.is_set():
                    return
                slot = await asyncio.to_thread(self._slot_state)
            if not await self._initial_snapshot(initial, slot):
                return
            await self._stream(backoff)
        finally:
            for task in (watch, lag_watch):
                if task is not None:
                    task.cancel()
            self.metrics.connected.set(0)
            await self.heartbeats.close()
            if self.signal_channel is not None:
                await self.signal_channel.stop()
            await offsets.stop()
            if self.incremental is not None:
                self.incremental.close()
            if cfg.drop_slot_on_exit:
                await asyncio.to_thread(setup.drop_slot, cfg.pg_dsn, cfg.slot_name)

    async def _initial_snapshot(self, initial: InitialSnapshot, slot: setup.SlotState) -> bool:
        """The slot and snapshot as the mode says; False when the producer should stop now.

        A transient fault (Kafka rejecting a batch, a lost connection) is retried as in
        streaming (--retry-attempts, --retry-max-delay): here it ended the producer with exit 1
        (a fuzz). A retry redoes the snapshot as the next start would: its progress record says
        it was interrupted, and the slot a failed attempt created is dropped again."""
        cfg = self.config
        backoff = Backoff(maximum=cfg.retry_max_delay, attempts=cfg.retry_attempts)
        while True:
            try:
                if not await initial.prepare(slot):
                    log.info("initial snapshot done, exiting (--snapshot-mode initial_only)")
                    return False
                return True
            except SnapshotAborted:
                log.warning("stopped during the initial snapshot: the next start redoes it")
                return False
            except TRANSIENT as e:
                if self._stopping.is_set():
                    log.warning("stopped during the initial snapshot: the next start redoes it", extra={"error": describe_error(e)})
                    return False
                log.warning("initial snapshot failed", extra={"error": describe_error(e)})
                try:
                    await backoff.wait(log, "initial snapshot", e, stop=self._stopping)
                except type(e):
                    log.error(
                        "giving up: the initial snapshot failed as often as --retry-attempts allows",
                        extra={"attempts": backoff.failures, "error": describe_error(e)},
                    )
                    raise
                if self._stopping.is_set():
                    log.warning("stopped during the initial snapshot: the next start redoes it")
                    return False
                slot = await asyncio.to_thread(self._slot_state)

    async def _watch_publication(self) -> None:
        """A table-list publication does not publish a table created later that the capture
        filter takes: its changes were lost without a word (a fuzz found it). Such a table is
        added to the publication when the role may, else said loudly, and counted."""
        cfg = self.config
        told: set[setup.TableName] = set()
        while True:
            await asyncio.sleep(PUBLICATION_CHECK_S)
            try:
                added, left = await asyncio.to_thread(self._publish_new_tables)
            except Exception as e:  # the database away (setup.connect's ConfigError too): tried again
                log.warning("checking the publication for new tables failed", extra={"error": describe_error(e)})
                continue
            self.metrics.unpublished_tables.set(len(left))
            for table in added:
                log.warning(
                    "a table created since the start is captured: added to the publication. Its changes before now were "
                    "not streamed: read it with an incremental snapshot (execute-snapshot) if it had any",
                    extra={"table": qualify_table(*table), "publication": cfg.publication_name},
                )
            for table in left:
                if table not in told:
                    told.add(table)
                    log.error(
                        "a table created since the start is captured but not published: its changes are not streamed. "
                        f"Have its owner or a superuser run ALTER PUBLICATION {quote_ident(cfg.publication_name)} "
                        f"ADD TABLE {setup.sql_table(table)}, then read it with an incremental snapshot (execute-snapshot)",
                        extra={"table": qualify_table(*table), "publication": cfg.publication_name},
                    )

    async def _watch_slot_lag(self) -> None:
        """walbus_producer_slot_lag_bytes as pg_replication_slots has it: the server's WAL
        position minus the slot's confirmed one, one small query every SLOT_LAG_CHECK_S (on a
        connection of its own, as the publication check: nothing shared with a thread that a
        stop may leave running). From the stream's positions it read 0 while the slot held
        megabytes (the keepalive's wal_end is how far the walsender has read, not the server's
        WAL end, and it was sampled just as the producer had confirmed it; a fuzz); the
        server's own view is right also during the snapshot and while the stream reconnects."""
        while True:
            try:
                lag = await asyncio.to_thread(self._slot_lag)
            except Exception as e:  # the database away (setup.connect's ConfigError too): read again later
                log.debug("the slot's lag could not be read", extra={"error": describe_error(e)})
            else:
                if lag is not None:
                    self.metrics.slot_lag_bytes.set(lag)
            await asyncio.sleep(SLOT_LAG_CHECK_S)

    def _slot_lag(self) -> int | None:
        with setup.connect(self.config.pg_dsn, "walbus-slot-lag") as conn:
            return setup.slot_lag_bytes(conn, self.config.slot_name)

    def _publish_new_tables(self) -> tuple[list[setup.TableName], list[setup.TableName]]:
        with setup.connect(self.config.pg_dsn) as conn:
            return setup.publish_new_tables(conn, self.config.publication_name, self.capture)

    async def _stream(self, backoff: Backoff, *, until: int | None = None) -> None:
        """Stream until :meth:`stop`, retrying transient faults; with ``until``, only until the
        transaction committed there (or a later one) is acknowledged and confirmed."""
        self._until = until
        try:
            while not self._stopping.is_set() and not self._caught_up():
                try:
                    await self._stream_session(backoff)
                except TRANSIENT as e:
                    self.metrics.connected.set(0)
                    if self._stopping.is_set():
                        break
                    if self.config.plugin == "pgoutput" and _publication_gone(e):
                        # pgoutput decodes each change with the catalog of its time: changes
                        # written while the publication did not exist never decode, whatever is
                        # done later. Retrying forever at warning level said nothing (a fuzz).
                        slot = self.config.slot_name
                        raise ConfigError(
                            f"{describe_error(e)}: the slot cannot stream the changes written since it was dropped. "
                            f"Create the publication again, drop the slot (SELECT pg_drop_replication_slot('{slot}')) "
                            "and start again: the new slot's snapshot reads the tables"
                        ) from None
                    self.metrics.reconnects.inc()
                    # Retries count per position: only a confirmed position past this one resets them.
                    self._failed_at = self.progress.confirmed_lsn if self.progress is not None else 0
                    log.warning("stream failed", extra={"error": describe_error(e), "confirmed_lsn": str(Lsn(self._failed_at))})
                    try:
                        await asyncio.wait_for(self._check_partition_count(), 30)
                    except TRANSIENT as unread:  # Kafka itself may be what failed: checked at the next retry
                        log.info("the progress records could not be read again", extra={"error": describe_error(unread)})
                    try:
                        await backoff.wait(log, "stream", e, stop=self._stopping)
                    except type(e):
                        log.error(
                            "giving up: the stream failed at the same position as often as --retry-attempts allows",
                            extra={"attempts": backoff.failures, "confirmed_lsn": str(Lsn(self._failed_at)), "error": describe_error(e)},
                        )
                        raise
        finally:
            self._until = None

    def _caught_up(self) -> bool:
        return self._until is not None and self.progress is not None and self.progress.confirmed_lsn > self._until

    def _slot_state(self) -> setup.SlotState:
        with setup.connect(self.config.pg_dsn) as conn:
            return setup.slot_state(conn, self.config.slot_name)

    def _new_sink(self, progress: Progress, *, on_ack: Callable[[float, int], None] | None = None) -> KafkaSink:
        """The sink of the database topic, for the stream and the snapshot alike: both check
        records against the limit the topic has (read in :meth:`_prepare_kafka`)."""
        cfg = self.config
        return KafkaSink(
            client_kwargs=self._client_kwargs, topic=cfg.topic_name, partitions=self._partitions, progress=progress,
            max_batch_bytes=cfg.max_batch_bytes, max_in_flight=cfg.max_in_flight, on_ack=on_ack,
            request_timeout_ms=cfg.kafka_request_timeout_ms, compression=cfg.compression,
            max_message_bytes=self._max_message_bytes,
        )

    def _decoder(self, catalog: Catalog) -> Decoder:
        decoder: PgoutputDecoder | Wal2jsonDecoder
        if self.config.plugin == "wal2json":
            decoder = Wal2jsonDecoder(catalog, self.capture)
        else:
            decoder = PgoutputDecoder(catalog, self.capture)
        decoder.encoder.partitioned = self._partitions > 1
        return decoder

    async def _stream_session(self, backoff: Backoff) -> None:
        cfg = self.config
        catalog = Catalog(cfg.pg_dsn)
        stream: ReplicationStream | None = None
        sink: KafkaSink | None = None
        try:
            await asyncio.to_thread(catalog.load_types)
            state = self._slot_state()
            if not state.exists:
                raise ConfigError(f"replication slot {cfg.slot_name} disappeared (dropped by someone else?)")
            # One extra counter slot for side records (transaction metadata), see KafkaSink.
            progress = Progress(self._partitions + 1, state.confirmed_flush_lsn)
            self.progress = progress
            metrics = self.metrics

            def on_ack(seconds: float, records: int) -> None:
                metrics.send_latency.observe(seconds)
                # Idle (nothing open: the read may wait up to 1 s): confirm what Kafka acknowledged
                # now. While batches are open the read waits 2 ms at most, and an early wake would
                # send them half full.
                if stream is not None and sink is not None and not sink.has_open():
                    stream.wake()

            sink = self._new_sink(progress, on_ack=on_ack)
            await sink.start()
            decoder = self._decoder(catalog)
            stream = await asyncio.to_thread(ReplicationStream.connect, cfg.pg_dsn)
            stream.start(cfg.slot_name, 0, decoder.start_options(cfg.publication_name))
            if self.incremental is not None:
                self.incremental.reset()  # the stream replays from the confirmed position
                if self.signal_channel is not None:
                    await self.signal_channel.seek(self.incremental.signal_offset)  # and the signals from the saved offset
            metrics.connected.set(1)
            self.ready.set()
            await self._pump(stream, decoder, sink, progress, backoff)
        finally:
            if sink is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sink.stop(), 30)
            if stream is not None:
                stream.close()
            catalog.close()

    async def _pump(self, stream: ReplicationStream, decoder: Decoder, sink: KafkaSink, progress: Progress, backoff: Backoff) -> None:
        cfg = self.config
        metrics = self.metrics
        sent_lsn = -1
        last_feedback = 0.0
        in_txn = False
        xid = 0  # of the transaction being decoded
        txn_topic = side_topic(cfg.topic_name, "transaction") if cfg.transaction_metadata else None
        inc = self.incremental  # incremental snapshot hooks: signals, watermarks, positions
        signal_table = self.capture.signal_table
        heartbeats = self.heartbeats
        confirm_every = confirm_interval(cfg.heartbeat_interval)
        until = self._until
        reached = False  # until's transaction is in (what was read after it is dropped: it comes again)
        while not self._stopping.is_set() and not (until is not None and not in_txn and self._caught_up()):
            # Short reads while a batch is open (it is sent once the stream idles) or a beat
            # waits for an acknowledgement (it goes out once that came).
            messages = await stream.read(timeout=0.002 if sink.has_open() else 0.005 if heartbeats.owing else 1.0)
            if not messages:
                await sink.flush()  # the stream is idle: nothing will fill the open batches soon
            else:
                heartbeats.streaming(time.monotonic())
                for it in decoder.decode(messages):
                    match it:
                        case EncodedEvent():
                            if inc is not None:
                                inc.observe(it, xid)
                                if it.relation.qualified == signal_table and not sink.fits(it):
                                    self._unpublished_signal(it, sink)
                                    continue
                            if not sink.append(it):  # no coroutine per event: put() only for a full batch
                                await sink.put(it)
                        case ChangeRun():
                            stream.pull()  # the walsender goes on while this run is sent
                            if inc is not None and it.relation.qualified == signal_table:
                                for ev in it.events():  # rare, small: one at a time
                                    inc.observe(ev, xid)
                                    if sink.fits(ev):
                                        await sink.put(ev)
                                    else:
                                        self._unpublished_signal(ev, sink)
                                continue
                            if inc is not None and inc.watches(it.relation):
                                for ev in it.events():  # its keys; the records go as a run
                                    inc.observe(ev, xid)
                            await sink.put_run(it)
                        case TxnEnd():
                            in_txn = False
                            await self._commit(it, sink, progress, txn_topic)
                            if it.counts:
                                heartbeats.committed(it.end_lsn)
                            if until is not None and it.commit_lsn >= until:
                                # Stop at this transaction's end: the rest of what was read
                                # comes again from the slot (a stop inside the next one is
                                # the very thing the catch-up is for).
                                await sink.wait_acked(timeout=60)
                                reached = True
                                break
                        case TxnBegin():
                            in_txn = True
                            xid = it.xid
                            if txn_topic:
                                await self._transaction_record(sink, txn_topic, "BEGIN", it.xid, it.commit_lsn, it.timestamp, None)
                        case LogicalMessage():
                            if inc is not None:
                                for ev in inc.on_message(it, self._partitions > 1):
                                    await sink.put(ev)
                if reached:
                    break  # not past here: the server's position covers what was dropped
                await sink.flush_idle()
                if progress.confirmed_lsn > self._failed_at:
                    backoff.reset()
            sink.raise_if_failed()
            if inc is not None:
                if self.signal_channel is not None:
                    await self._topic_signals(self.signal_channel, inc, sink)
                await inc.tick(progress.confirmed_lsn)
            now = time.monotonic()
            if not in_txn and (until is not None or stream.position.reply_requested or now - last_feedback >= confirm_every):
                progress.advance_idle(stream.position.wal_end)
            if heartbeats.due(now):  # inside a long transaction too: the producer is alive
                await heartbeats.beat(sink, progress, now)
            elif not messages and not in_txn and heartbeats.owed(progress.confirmed_lsn, now):
                await heartbeats.beat(sink, progress, now, prompt=True)
            confirmed = progress.confirmed_lsn
            if confirmed != sent_lsn or stream.position.reply_requested or now - last_feedback >= min(confirm_every, 10.0):
                await stream.send_feedback(confirmed)
                sent_lsn = confirmed
                last_feedback = now
                metrics.confirmed_lsn.set(confirmed)
                metrics.in_flight.set(progress.in_flight_of(self._partitions))  # events: not the beat just sent
        # Graceful stop: everything read is flushed and acknowledged, then confirmed.
        await sink.wait_acked(timeout=60)
        await stream.send_feedback(progress.confirmed_lsn)
        if heartbeats.interval > 0:
            # A last beat: readers that go by them (Table.wait_until, Feed.transactions(), a
            # warehouse load's cut) learn now, not at the next start, that all of it is in.
            await heartbeats.beat(sink, progress, time.monotonic(), prompt=True)
            await sink.wait_acked(timeout=60)
        if inc is not None:
            await inc.save_confirmed(progress.confirmed_lsn)
        if until is None:
            log.info("producer stopped", extra={"confirmed_lsn": str(Lsn(progress.confirmed_lsn))})
        else:
            log.info("the topic's last transaction is complete", extra={"confirmed_lsn": str(Lsn(progress.confirmed_lsn))})


    async def _commit(self, end: TxnEnd, sink: KafkaSink, progress: Progress, txn_topic: str | None) -> None:
        """A transaction's end: its metadata record, the incremental snapshot's save, the
        position the slot may be confirmed to once Kafka acknowledged what came before."""
        if txn_topic:
            await self._transaction_record(sink, txn_topic, "END", end.xid, end.commit_lsn, end.timestamp, end.counts)
        inc = self.incremental
        if inc is not None and inc.on_commit(end.end_lsn):
            await sink.wait_acked(timeout=60)
            await inc.save_now()
        progress.commit(end.end_lsn)
        metrics = self.metrics
        metrics.transactions.inc()
        for (table, op), n in end.counts.items():
            metrics.events.labels(table, op).inc(n)
        metrics.behind_source_ms.set(max(0.0, time.time() * 1000 - end.commit_unix_us / 1000))

    @staticmethod
    async def _topic_signals(channel: KafkaSignalChannel, inc: IncrementalSnapshot, sink: KafkaSink) -> None:
        """Signals from Kafka, between batches. When they changed the position it is saved,
        with the topic offset after them, before the next poll (a crash before that reads
        them again: they had no durable effect yet)."""
        signals = await channel.poll()
        if not signals:
            return
        inc.topic_signals(signals)
        if inc.take_eager():
            await sink.wait_acked(timeout=60)
            await inc.save_now()

    @staticmethod
    async def _transaction_record(
        sink: KafkaSink, topic: str, status: str, xid: int, commit_lsn: int, timestamp: str,
        counts: dict[tuple[str, str], int] | None,
    ) -> None:
        """Debezium's transaction metadata: BEGIN and END (with event counts per table)."""
        txn_id = f"{xid}:{commit_lsn}"
        value: dict[str, Any] = {"status": status, "id": txn_id, "commit_lsn": commit_lsn, "ts": timestamp}
        if counts is not None:
            per_table: dict[str, int] = {}
            for (table, _op), n in counts.items():
                per_table[table] = per_table.get(table, 0) + n
            value["event_count"] = sum(per_table.values())
            value["data_collections"] = [{"data_collection": t, "event_count": n} for t, n in sorted(per_table.items())]
        await sink.send_side_record(topic, b"%016X" % commit_lsn, orjson.dumps(value))


async def in_daemon_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` in a thread of its own that does not hold the process: asyncio.to_thread's
    executor is joined at exit, so a stop while ``fn`` waited for PostgreSQL (a 10 s connect
    timeout) waited that out. An abandoned ``fn`` ends with the process; PostgreSQL rolls
    back what its connection had not finished."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, error: BaseException | None) -> None:
        if future.done():  # abandoned
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: _T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as e:
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="walbus-start-up", daemon=True).start()
    return await future


def _publication_gone(e: BaseException) -> bool:
    text = str(e)
    return 'publication "' in text and "does not exist" in text


def describe_error(e: BaseException) -> str:
    """An exception as its type and message: some (TimeoutError()) have an empty message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def main(argv: Sequence[str]) -> int:
    exit_on_sigterm()  # until the event loop takes it over
    cfg = load(argv)
    setup_logging(cfg.log_level)
    tune_for_large_buffers()  # aiokafka's batch copies: see walbus.allocator
    tune_collector()  # the same records, kept out of the cyclic collector's young passes
    producer = Producer(cfg)
    # Ready while streaming from the slot (the gauge the stream loop keeps).
    server = serve_metrics(
        cfg.metrics_port, producer.registry, addr=cfg.metrics_addr,
        ready=lambda: sample(producer.registry, "walbus_producer_connected") == 1,
    )

    async def _run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, producer.stop)
        await producer.run()

    try:
        asyncio.run(_run())
    finally:
        if server is not None:
            server.shutdown()
    return 0
