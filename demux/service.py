"""`walbus demux`: database topic -> compacted per-table topics, exactly once.

The exactly-once design (one transactional producer per source partition): docs/demux.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    KafkaError,
    ProducerFenced,
)
from prometheus_client import CollectorRegistry

from demux.config import DemuxConfig, parse_config
from demux.metrics import DemuxMetrics
from demux.rekey import Rekeyer
from demux.state import check_state_dir
from demux.topics import TopicManager
from demux.worker import PartitionWorker
from walbus.aiokafka_shortcuts import SHORTCUTS, flatten, read_in_runs
from walbus.allocator import tune_collector, tune_for_large_buffers
from walbus.config import describe
from walbus.kafka import KafkaAdmin, stop_consumer, wait_for_broker
from walbus.logs import setup_logging
from walbus.metrics import new_registry, sample, serve_metrics
from walbus.process import exit_on_sigterm
from walbus.retry import Backoff

log = logging.getLogger("walbus.demux")

POLL_MAX_MS = 200
SOURCE_TOPIC_POLL_S = 2.0  # how often a demux started before its source topic asks for it
# Per partition and fetch. aiokafka fetches a partition again only once its buffer is
# drained, so each getmany takes all that is buffered, and the worker turns the event
# loop as it goes (demux.worker.YIELD_EVERY): the next fetch is then served while this
# one is re-keyed. 4 MiB is ~10-40k events. With 8 MiB fetches and getmany capped at
# txn_max_records the buffer was never drained in one go: every fetch waited for the
# previous run to end, and the demux sat idle ~13% of the time.
FETCH_BYTES = 4 * 1024 * 1024


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, demux: Demux) -> None:
        self._demux = demux

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._demux.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._demux.on_assigned(assigned)


class Demux:
    def __init__(self, config: DemuxConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.client_kwargs = config.kafka_client_kwargs()
        self.registry = registry or new_registry()
        self.metrics = DemuxMetrics(self.registry)
        for shortcut, taken in SHORTCUTS.as_labels().items():
            self.metrics.aiokafka_shortcuts.labels(shortcut).set(taken)
        self.rekeyer = Rekeyer(
            prefix=config.topic_prefix,
            database=config.database_name,
            emit_delete_records=config.emit_delete_records,
        )
        self.workers: dict[TopicPartition, PartitionWorker] = {}
        # Partitions assigned but not (yet, or again) opened: tp -> not before (monotonic).
        self.pending: dict[TopicPartition, float] = {}
        self._failures: dict[TopicPartition, Backoff] = {}
        self._stop = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: KafkaAdmin | None = None
        self._topics: TopicManager | None = None

    def stop(self) -> None:
        if not self._stop.is_set():
            log.info("stopping: finishing the open transactions")
        self._stop.set()

    # -- rebalance callbacks (run inside the consumer's coordinator task) ----------

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        for tp in revoked:
            self.pending.pop(tp, None)
            worker = self.workers.pop(tp, None)
            if worker is not None:
                async with worker.lock:
                    # Graceful hand-over: commit what is done. The partition is not
                    # assigned to anyone else before this callback returns.
                    await worker.close(commit=worker.ready)
                log.info("partition revoked", extra={"partition": tp.partition})
        self.metrics.assigned_partitions.set(len(self.workers))

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        for tp in assigned:
            if tp in self.workers:
                continue
            # Paused until opened: nothing is processed before the fencing and the seek.
            consumer.pause(tp)
            self.workers[tp] = self._new_worker(tp)
            self.pending[tp] = 0.0
        self.metrics.assigned_partitions.set(len(self.workers))

    def _new_worker(self, tp: TopicPartition) -> PartitionWorker:
        assert self._topics is not None and self._admin is not None
        return PartitionWorker(
            tp=tp,
            config=self.config,
            client_kwargs=self.client_kwargs,
            rekeyer=self.rekeyer,
            topics=self._topics,
            admin=self._admin,
            metrics=self.metrics,
        )

    # -- main loop -------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.config
        log.info("demux starting", extra={"config": describe(cfg)})
        if not await wait_for_broker(self.client_kwargs, stop=self._stop):
            return  # stopped (SIGTERM) before Kafka answered
        self._admin = KafkaAdmin(client_kwargs=self.client_kwargs)
        if not await self._start_with_retry(self._admin.start, "admin client"):
            await self._admin.close()
            return
        self._topics = TopicManager(self._admin, cfg, stop=self._stop)
        consumer = AIOKafkaConsumer(
            **self.client_kwargs,
            group_id=cfg.group,
            # Static membership: a restart under the same name takes over its old member's
            # partitions at once. Fencing is unchanged: it is the per-partition transactional
            # producers' InitProducerId (see above), not the group generation.
            group_instance_id=cfg.group_instance_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=max(1000, cfg.session_timeout_ms // 3),
            max_partition_fetch_bytes=FETCH_BYTES,
            fetch_max_bytes=64 * 1024 * 1024,
        )
        self._consumer = consumer
        try:
            if not await self._start_with_retry(consumer.start, "consumer"):
                return  # stopped (SIGTERM) before the consumer could start
            # Records in runs, without a ConsumerRecord each: see walbus.aiokafka_shortcuts.
            self.metrics.aiokafka_shortcuts.labels("runs").set(read_in_runs(consumer))
            if cfg.source_topic not in await consumer.topics():
                log.warning("source topic does not exist yet; waiting for it", extra={"topic": cfg.source_topic})
                # Asked again every few seconds: subscribed to a missing topic, the consumer
                # noticed it only at its next metadata refresh, up to 5 minutes later.
                while cfg.source_topic not in await consumer.topics():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), SOURCE_TOPIC_POLL_S)
                    if self._stop.is_set():
                        return
                log.info("source topic exists", extra={"topic": cfg.source_topic})
            consumer.subscribe([cfg.source_topic], listener=_Listener(self))
            await self._loop(consumer)
        finally:
            await self._shutdown(consumer)

    async def _start_with_retry(self, start: Any, what: str) -> bool:
        """Start a client, retrying transient faults; False when stopped before it started
        (a SIGTERM during the retries is a clean shutdown, not a failure)."""
        backoff = Backoff()
        while True:
            try:
                await start()
                return True
            except (KafkaError, OSError) as e:
                if self._stop.is_set():
                    log.info(f"stopped before the {what} started", extra={"error": str(e)})
                    return False
                await backoff.wait(log, f"starting the {what}", e, stop=self._stop)
                if self._stop.is_set():
                    return False

    async def _loop(self, consumer: AIOKafkaConsumer) -> None:
        getmany_backoff = Backoff(initial=0.5, maximum=30.0)
        while not self._stop.is_set():
            await self._open_pending(consumer)
            now = time.monotonic()
            wait_s = min([w.time_left(now) for w in self.workers.values()] + [POLL_MAX_MS / 1000])
            try:
                data = await consumer.getmany(timeout_ms=int(wait_s * 1000))  # all that is buffered: see FETCH_BYTES
                getmany_backoff.reset()
            except KafkaError as e:
                await getmany_backoff.wait(log, "fetching from the source topic", e)
                continue
            for tp, runs in data.items():
                worker = self.workers.get(tp)
                if worker is None or not worker.ready or not runs:
                    continue  # re-read from the committed offset once it is opened
                async with worker.lock:
                    if not worker.ready:
                        continue
                    try:
                        await worker.process(flatten(runs))
                        await worker.send_batches()
                        if worker.due(time.monotonic()):
                            await worker.commit()
                            self._failures.pop(tp, None)
                    except Exception as e:
                        await self._fail(worker, e)
            await self._commit_due()
            self._update_lag(consumer)

    async def _commit_due(self) -> None:
        now = time.monotonic()
        for tp, worker in list(self.workers.items()):
            if not worker.ready or not worker.due(now):
                continue
            async with worker.lock:
                if not worker.ready:
                    continue
                try:
                    await worker.commit()
                    self._failures.pop(tp, None)
                except Exception as e:
                    await self._fail(worker, e)

    async def _open_pending(self, consumer: AIOKafkaConsumer) -> None:
        now = time.monotonic()
        for tp, not_before in list(self.pending.items()):
            if not_before > now or self._stop.is_set():
                continue
            worker = self.workers.get(tp)
            if worker is None:
                self.pending.pop(tp, None)
                continue
            async with worker.lock:
                if self.workers.get(tp) is not worker:
                    continue  # revoked while waiting for the lock
                try:
                    await worker.open(consumer)
                except Exception as e:
                    await self._fail(worker, e)
                    continue
            if self.workers.get(tp) is worker and worker.ready:
                self.pending.pop(tp, None)
                consumer.resume(tp)

    async def _fail(self, worker: PartitionWorker, error: BaseException) -> None:
        """Close a broken worker (abort) and schedule a fresh one: start again from the committed offset."""
        tp = worker.tp
        backoff = self._failures.setdefault(tp, Backoff(initial=1.0, maximum=60.0))
        backoff.failures += 1
        delay = backoff.next_delay()
        if self._topics is not None:
            # The output topics as they are now: a max.message.bytes lowered after it was read
            # (what no longer fits goes to the DLQ instead of failing again), a topic deleted
            # meanwhile (created again; its records timed out, and it stayed cached as there).
            self._topics.forget()
        if isinstance(error, ProducerFenced):
            # Another process owns the partition now; our consumer learns it at the
            # next heartbeat and the revoke callback drops the partition. Wait that long.
            delay = max(delay, self.config.session_timeout_ms / 1000)
        log.warning(
            "partition worker failed; aborting and reopening from the committed offset",
            extra={"partition": tp.partition, "error": repr(error), "retry_in_s": delay},
        )
        await worker.close(commit=False)
        # Unless a rebalance replaced or removed it meanwhile, a fresh worker takes over.
        if self._consumer is not None and self.workers.get(tp) is worker:
            self._consumer.pause(tp)
            self.workers[tp] = self._new_worker(tp)
            self.pending[tp] = time.monotonic() + delay

    def _update_lag(self, consumer: AIOKafkaConsumer) -> None:
        for tp, worker in self.workers.items():
            if worker.next_offset is None:
                continue
            high = consumer.highwater(tp)
            if high is not None:
                self.metrics.consumer_lag.labels(str(tp.partition)).set(max(0, high - worker.next_offset))

    async def _shutdown(self, consumer: AIOKafkaConsumer) -> None:
        for tp, worker in list(self.workers.items()):
            async with worker.lock:
                await worker.close(commit=worker.ready)
            self.workers.pop(tp, None)
        self.pending.clear()
        try:
            # Workers are gone, so the revoke callback of the final leave has nothing to do.
            await stop_consumer(consumer)
        finally:
            if self._admin is not None:
                await self._admin.close()
        log.info("demux stopped")


async def run_demux(config: DemuxConfig, *, registry: CollectorRegistry | None = None) -> None:
    demux = Demux(config, registry=registry)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, demux.stop)
    try:
        await demux.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()  # until the event loop takes it over
    config = parse_config(argv)  # ConfigError -> `walbus` prints it and exits 2
    setup_logging(config.log_level)
    tune_for_large_buffers()  # aiokafka's batch copies: see walbus.allocator
    tune_collector()  # see walbus.allocator
    registry = new_registry()
    config.kafka_client_kwargs()  # raises ConfigError on incomplete security options, before any I/O
    check_state_dir(Path(config.state_dir))
    # Ready while it owns source partitions to consume.
    server = serve_metrics(
        config.metrics_port, registry, addr=config.metrics_addr,
        ready=lambda: (sample(registry, "walbus_demux_assigned_partitions") or 0) > 0,
    )
    try:
        asyncio.run(run_demux(config, registry=registry))
    finally:
        if server is not None:
            server.shutdown()
    return 0
