"""Reading one load's slice of the database topic with Spark's own Kafka source.

The slice is fixed before Spark reads anything: ``start`` comes from the load log (where the
last successful load stopped), ``end`` is the topic's end offsets when the job starts, cut
before a transaction the producer is still writing (:func:`commit_cut`). Both are explicit
per-partition offsets, so a replayed load reads exactly the same records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from pyspark.sql import DataFrame, SparkSession

from walbus.config import ConfigError
from walbus.contract import ContractError, heartbeat_topic, heartbeats, parse_event_key
from walbus.kafka import METADATA_WAIT_S, KafkaAdmin, KafkaOptions, retry_retriable, topic_offsets

Offsets = dict[int, int]  # partition -> offset
T = TypeVar("T")

log = logging.getLogger("walbus.warehouse")

# Heartbeats read to find the highest confirmed position (the compacted topic's newest ones).
BEATS_READ = 32
# The newest heartbeat sent this long ago: the producers beat no more (stopped, heartbeats
# turned off, an interval longer than this) and the load is not cut (see commit_cut).
BEAT_STALE_MS = 60_000


class TopicError(RuntimeError):
    """The topic cannot be read as asked (missing, or records deleted before being loaded)."""


@dataclass(frozen=True)
class TopicBounds:
    earliest: Offsets
    latest: Offsets
    # The highest position a producer's heartbeat confirmed, read before ``latest``, and when
    # the newest heartbeat was sent (producer's clock, ms); None: no heartbeat topic.
    confirmed: int | None = None
    beat_ms: int | None = None


async def _bounds(options: KafkaOptions, topic: str) -> TopicBounds:
    client_kwargs = options.kafka_client_kwargs()

    async def topics() -> set[str]:
        async with KafkaAdmin(client_kwargs=client_kwargs) as admin:
            return await admin.list_topics()

    # A broker that is down while the load starts is a transient fault, not a failed load.
    names = await retry_retriable(topics, "listing the topics", client_kwargs=client_kwargs)
    if topic not in names:
        raise TopicError(f"topic {topic!r} does not exist on {options.kafka_bootstrap}")
    confirmed = beat_ms = None
    if heartbeat_topic(topic) in names:
        # Before the end offsets: every event a heartbeat confirmed is then within them.
        confirmed, beat_ms = await retry_retriable(
            lambda: _newest_beats(client_kwargs, heartbeat_topic(topic)), "reading the heartbeats",
            client_kwargs=client_kwargs,
        )
    earliest, latest = await topic_offsets(client_kwargs, topic)
    return TopicBounds(earliest, latest, confirmed, beat_ms)


async def _newest_beats(client_kwargs: dict[str, Any], topic: str) -> tuple[int | None, int | None]:
    """The highest confirmed position and the newest send time of the newest heartbeats."""
    confirmed: int | None = None
    beat_ms: int | None = None
    for records in (await _read_tails(client_kwargs, topic, None, BEATS_READ)).values():
        for beat in heartbeats(value for _offset, _key, value, _ts in records):
            confirmed = max(confirmed or 0, beat.confirmed_lsn)
            beat_ms = max(beat_ms or 0, beat.ts_ms)
    return confirmed, beat_ms


Record = tuple[int, bytes | None, bytes | None, int]  # offset, key, value, timestamp (ms)


async def _read_tails(
    client_kwargs: dict[str, Any], topic: str, ranges: dict[int, tuple[int, int]] | None, most: int,
) -> dict[int, list[Record]]:
    """Per partition, the records of ``ranges`` (``lo <= offset < hi``), or with ``ranges``
    None each partition's last ``most`` records."""
    count = 0
    if ranges is None:
        async with KafkaAdmin(client_kwargs=client_kwargs) as admin:
            count = await admin.partitions(topic, wait=METADATA_WAIT_S)
    consumer = AIOKafkaConsumer(**client_kwargs, enable_auto_commit=False)
    await consumer.start()
    try:
        if ranges is None:
            tps = [TopicPartition(topic, p) for p in range(count)]
            ends = await consumer.end_offsets(tps)
            ranges = {tp.partition: (max(0, int(ends[tp]) - most), int(ends[tp])) for tp in tps}
        out: dict[int, list[Record]] = {p: [] for p in ranges}
        todo = {TopicPartition(topic, p): hi for p, (lo, hi) in ranges.items() if hi > lo}
        consumer.assign(list(todo))
        for tp in todo:
            consumer.seek(tp, ranges[tp.partition][0])
        while todo:
            batches = await consumer.getmany(*todo, timeout_ms=1000)
            for tp, msgs in batches.items():
                for m in msgs:
                    if m.offset < todo[tp]:
                        out[tp.partition].append((m.offset, m.key, m.value, m.timestamp))
            for tp in list(todo):
                if await consumer.position(tp) >= todo[tp]:
                    del todo[tp]
        return out
    finally:
        await consumer.stop()


def _run(work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work())
    # called from async code (a loop is running in this thread): use a thread of its own
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work()).result()


def topic_bounds(options: KafkaOptions, topic: str) -> TopicBounds:
    return _run(lambda: _bounds(options, topic))


def commit_cut(options: KafkaOptions, topic: str, start: Offsets, bounds: TopicBounds) -> Offsets:
    """Where a load of ``start`` to ``bounds.latest`` ends, so that it holds no part of a
    transaction the producer is still writing (a large one goes over several batches, and a
    load that took its first ones left current tables in a state the database never had until
    the next load). Per partition: after the last record of a commit before the position the
    producers' heartbeats confirmed, which is where an acknowledged commit ended and where the
    next one may start; a record that is no event belongs to no transaction. Without
    heartbeats, or with the newest sent :data:`BEAT_STALE_MS` ago or longer (the producers
    beat no more: a load cut there would wait for ever), the end offsets themselves (with a
    warning when that takes in records past the confirmed position)."""
    latest = bounds.latest
    if bounds.confirmed is None or bounds.beat_ms is None:
        return dict(latest)
    confirmed, beat_ms = bounds.confirmed, bounds.beat_ms
    cut = _run(lambda: _cut(options.kafka_client_kwargs(), topic, start, latest, confirmed))
    held = sum(latest[p] - cut[p] for p in latest)
    if not held:
        return cut
    behind_ms = int(time.time() * 1000) - beat_ms
    if behind_ms >= BEAT_STALE_MS:
        log.warning(
            "the producers' last heartbeat is old: loading to the end offsets, past the position it "
            "confirmed (a transaction still being written may be partly loaded)",
            extra={"topic": topic, "heartbeat_age_s": behind_ms // 1000, "records_past_it": held},
        )
        return dict(latest)
    log.info(
        "load cut before a transaction still being written: its records are left for the next load",
        extra={"topic": topic, "records_left": held, "confirmed_lsn": confirmed},
    )
    return cut


async def _cut(client_kwargs: dict[str, Any], topic: str, start: Offsets, latest: Offsets, confirmed: int) -> Offsets:
    """Per partition, the offset after the last record (looking back from the end, further
    each round) that is no part of a commit past ``confirmed``."""
    cut = dict(latest)
    open_parts = {p: latest[p] for p in latest if latest[p] > start.get(p, 0)}
    step = 64
    while open_parts:
        ranges = {p: (max(start.get(p, 0), hi - step), hi) for p, hi in open_parts.items()}
        tails = await _read_tails(client_kwargs, topic, ranges, step)
        for p, records in tails.items():
            lo = ranges[p][0]
            done_at = None
            for offset, key, _value, _ts in reversed(records):
                try:
                    # Before, not at: a commit may start where the confirmed one ended (a re-fuzz).
                    whole = parse_event_key(key or b"")[0] < confirmed
                except ContractError:
                    whole = True  # no event: no part of a transaction
                if whole:
                    done_at = offset + 1
                    break
            if done_at is not None:
                cut[p] = done_at
                del open_parts[p]
            elif lo <= start.get(p, 0):
                cut[p] = start.get(p, 0)  # all of it is past the confirmed position
                del open_parts[p]
            else:
                open_parts[p] = lo
        step *= 4
    return cut


def check_no_gap(topic: str, start: Offsets, earliest: Offsets) -> None:
    """Fail when records between the last load and now were deleted by retention."""
    lost = {p: (s, earliest[p]) for p, s in start.items() if p in earliest and earliest[p] > s}
    if lost:
        detail = ", ".join(f"partition {p}: next to load {s}, earliest kept {e}" for p, (s, e) in sorted(lost.items()))
        raise TopicError(
            f"records of {topic} were deleted by Kafka retention before being loaded ({detail}); "
            "the warehouse would miss changes. Raise the topic's retention and reload the "
            "affected tables from a fresh warehouse path."
        )


def spark_kafka_options(options: KafkaOptions) -> dict[str, str]:
    """The ``kafka.*`` options of Spark's Kafka source for walbus' Kafka settings. PEM files
    are inlined: they need to exist on the driver only."""
    out = {
        "kafka.bootstrap.servers": options.kafka_bootstrap,
        "kafka.security.protocol": options.kafka_security_protocol,
    }
    if options.kafka_security_protocol.startswith("SASL"):
        module = (
            "org.apache.kafka.common.security.plain.PlainLoginModule"
            if options.kafka_sasl_mechanism == "PLAIN"
            else "org.apache.kafka.common.security.scram.ScramLoginModule"
        )
        for flag, value in (("--kafka-sasl-username", options.kafka_sasl_username),
                            ("--kafka-sasl-password", options.kafka_sasl_password)):
            # JSON's \u0001 is no JAAS escape: Spark's login would use another password
            if any(ord(c) < 32 or ord(c) == 127 for c in value or ""):
                raise ConfigError(f"{flag} holds a control character: Spark's Kafka source cannot take it")
        user = orjson.dumps(options.kafka_sasl_username or "").decode()
        password = orjson.dumps(options.kafka_sasl_password or "").decode()
        out["kafka.sasl.mechanism"] = options.kafka_sasl_mechanism
        out["kafka.sasl.jaas.config"] = f"{module} required username={user} password={password};"
    if options.kafka_security_protocol in ("SSL", "SASL_SSL"):
        if options.kafka_ssl_cafile:
            out["kafka.ssl.truststore.type"] = "PEM"
            out["kafka.ssl.truststore.certificates"] = _read(options.kafka_ssl_cafile, "--kafka-ssl-cafile")
        if options.kafka_ssl_certfile:
            out["kafka.ssl.keystore.certificate.chain"] = _read(options.kafka_ssl_certfile, "--kafka-ssl-certfile")
            key = _read(options.kafka_ssl_keyfile or options.kafka_ssl_certfile, "--kafka-ssl-keyfile")
            out["kafka.ssl.keystore.type"] = "PEM"
            # Kafka's PEM keystore takes PKCS#8 only (Python's ssl takes PKCS#1 too), and on
            # Java 17 cannot decrypt what `openssl pkey -aes256` writes (PBES2): Spark gets
            # the key unencrypted PKCS#8, as the client key file would be without a passphrase.
            out["kafka.ssl.keystore.key"] = (
                key if "-----BEGIN PRIVATE KEY-----" in key else _pkcs8(key, options.kafka_ssl_key_password)
            )
    return out


def _read(path: str, flag: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {path}: {getattr(e, 'strerror', None) or e}") from None


def _pkcs8(pem: str, password: str | None) -> str:
    """A PEM key (PKCS#1 or PKCS#8, encrypted or not) as unencrypted PKCS#8 PEM, in memory only."""
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(pem.encode(), password.encode() if password else None)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"--kafka-ssl-keyfile: {e}; Spark's Kafka source takes unencrypted PKCS#8 keys "
            "(openssl pkcs8 -topk8 -nocrypt -in KEY -out KEY8)"
        ) from None
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def offsets_json(topic: str, offsets: Offsets) -> str:
    return orjson.dumps({topic: {str(p): o for p, o in sorted(offsets.items())}}).decode()


def read_slice(
    spark: SparkSession, options: KafkaOptions, topic: str, start: Offsets, end: Offsets
) -> DataFrame:
    """The records ``start <= offset < end`` of each partition, as raw Kafka rows."""
    parts = sorted(p for p in end if end[p] > start.get(p, 0))
    reader = spark.read.format("kafka")
    for key, value in spark_kafka_options(options).items():
        reader = reader.option(key, value)
    return (
        reader.option("assign", orjson.dumps({topic: parts}).decode())
        .option("startingOffsets", offsets_json(topic, {p: start.get(p, 0) for p in parts}))
        .option("endingOffsets", offsets_json(topic, {p: end[p] for p in parts}))
        # a gap is checked before reading (check_no_gap) with a clearer message
        .option("failOnDataLoss", "true")
        # split each partition's offset range over the cores: one Kafka partition would
        # otherwise be read and parsed by a single task
        .option("minPartitions", str(max(spark.sparkContext.defaultParallelism, 1)))
        .load()
    )
