"""Reading one load's slice of the database topic with Spark's own Kafka source.

The slice is fixed before Spark reads anything: ``start`` comes from the load log (where the
last successful load stopped), ``end`` is the topic's end offsets when the job starts. Both
are explicit per-partition offsets, so a replayed load reads exactly the same records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

import orjson
from pyspark.sql import DataFrame, SparkSession

from walbus.config import ConfigError
from walbus.kafka import KafkaAdmin, KafkaOptions, retry_retriable, topic_offsets

Offsets = dict[int, int]  # partition -> offset


class TopicError(RuntimeError):
    """The topic cannot be read as asked (missing, or records deleted before being loaded)."""


@dataclass(frozen=True)
class TopicBounds:
    earliest: Offsets
    latest: Offsets


async def _bounds(options: KafkaOptions, topic: str) -> TopicBounds:
    client_kwargs = options.kafka_client_kwargs()

    async def topics() -> set[str]:
        async with KafkaAdmin(client_kwargs=client_kwargs) as admin:
            return await admin.list_topics()

    # A broker that is down while the load starts is a transient fault, not a failed load.
    if topic not in await retry_retriable(topics, "listing the topics", client_kwargs=client_kwargs):
        raise TopicError(f"topic {topic!r} does not exist on {options.kafka_bootstrap}")
    earliest, latest = await topic_offsets(client_kwargs, topic)
    return TopicBounds(earliest, latest)


def topic_bounds(options: KafkaOptions, topic: str) -> TopicBounds:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_bounds(options, topic))
    # called from async code (a loop is running in this thread): use a thread of its own
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _bounds(options, topic)).result()


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
