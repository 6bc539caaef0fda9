"""Reading one load's slice of the database topic with Spark's own Kafka source.

The slice is fixed before Spark reads anything: ``start`` comes from the load log (where the
last successful load stopped), ``end`` is the topic's end offsets when the job starts. Both
are explicit per-partition offsets, so a replayed load reads exactly the same records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from walbus.contract import (
    FIELD_ORDER,
    ContractError,
    check_key,
    decode_event,
    qualify_table,
    split_table,
)
from walbus.kafka import KafkaAdmin, KafkaOptions
from warehouse.schema import quote

Offsets = dict[int, int]  # partition -> offset

# The Spark types of the contract-v1 fields (walbus.contract.FIELD_ORDER: a field added to
# the contract fails here until it is given a type). ``values`` as array<string>: Spark's
# JSON reader hands a string field the raw JSON text of a non-string value (2000 -> "2000",
# true -> "true"), so every value survives parsing exactly and the pg type decides how to
# read it (warehouse.types). Validity is decided by the contract itself (check_record).
_FIELD_TYPES: Final = {
    "v": "int",
    "lsn": "decimal(20,0)",
    "commit_lsn": "decimal(20,0)",
    "seq": "bigint",
    "xid": "bigint",
    "operation": "string",
    "table": "string",
    "timestamp": "string",
    "pk": "array<string>",
    "columns": "array<string>",
    "types": "array<string>",
    "values": "array<string>",
    "identity": "struct<columns: array<string>, types: array<string>, values: array<string>>",
    "unchanged": "array<string>",
}
ENVELOPE_SCHEMA: Final = ", ".join(f"{quote(name)} {_FIELD_TYPES[name]}" for name in FIELD_ORDER)
INVALID: Final = "invalid_reason"  # why a record is not a contract-v1 event; null if it is


class TopicError(RuntimeError):
    """The topic cannot be read as asked (missing, or records deleted before being loaded)."""


@dataclass(frozen=True)
class TopicBounds:
    earliest: Offsets
    latest: Offsets


async def _bounds(options: KafkaOptions, topic: str) -> TopicBounds:
    async with KafkaAdmin(client_kwargs=options.kafka_client_kwargs()) as admin:
        if topic not in await admin.list_topics():
            raise TopicError(f"topic {topic!r} does not exist on {options.kafka_bootstrap}")
        count = await admin.partitions(topic)
    consumer = AIOKafkaConsumer(**options.kafka_client_kwargs(), enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(count)]
        earliest = await consumer.beginning_offsets(tps)
        latest = await consumer.end_offsets(tps)
        return TopicBounds(
            {tp.partition: int(o) for tp, o in earliest.items()},
            {tp.partition: int(o) for tp, o in latest.items()},
        )
    finally:
        await consumer.stop()


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
    """The ``kafka.*`` options of Spark's Kafka source for walbus' Kafka settings."""
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
        user = orjson.dumps(options.kafka_sasl_username or "").decode()
        password = orjson.dumps(options.kafka_sasl_password or "").decode()
        out["kafka.sasl.mechanism"] = options.kafka_sasl_mechanism
        out["kafka.sasl.jaas.config"] = f"{module} required username={user} password={password};"
    if options.kafka_security_protocol in ("SSL", "SASL_SSL"):
        if options.kafka_ssl_cafile:
            out["kafka.ssl.truststore.type"] = "PEM"
            out["kafka.ssl.truststore.location"] = options.kafka_ssl_cafile
        if options.kafka_ssl_certfile:
            # PEM key material inline: the files need to exist on the driver only.
            with open(options.kafka_ssl_certfile) as fh:
                out["kafka.ssl.keystore.certificate.chain"] = fh.read()
            with open(options.kafka_ssl_keyfile or options.kafka_ssl_certfile) as fh:
                out["kafka.ssl.keystore.key"] = fh.read()
            out["kafka.ssl.keystore.type"] = "PEM"
    return out


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


def check_record(key: bytes | None, value: bytes | None) -> tuple[str | None, str | None]:
    """(why the record is not a contract-v1 event, or None; its table as qualify_table spells it).

    The contract's own checks (decode_event, check_key): the warehouse accepts exactly what
    every other consumer accepts.
    """
    if value is None:
        return "record without a value", None
    try:
        event = decode_event(bytes(value))
        check_key(bytes(key) if key is not None else None, event)
    except (ContractError, ValueError, TypeError) as e:
        return str(e) or type(e).__name__, None
    return None, qualify_table(*split_table(event.table))


def checked(raw: DataFrame) -> Column:
    """The struct (reason, table) of :func:`check_record` for Kafka rows."""
    check = F.udf(check_record, "struct<reason: string, table: string>")  # needs a session: not at import
    return check(raw["key"], raw["value"])


def parse_events(raw: DataFrame) -> DataFrame:
    """Kafka rows -> one row per event: partition/offset, :data:`INVALID`, envelope fields.

    ``table`` is respelled by :func:`walbus.contract.qualify_table`, so two spellings of one
    (schema, table) pair load as one table.
    """
    event = F.from_json(F.col("value").cast("string"), ENVELOPE_SCHEMA)
    return (
        raw.select(
            F.col("partition").alias("kafka_partition"),
            F.col("offset").alias("kafka_offset"),
            checked(raw).alias("c"),
            event.alias("e"),
        )
        .select("kafka_partition", "kafka_offset", F.col("c.reason").alias(INVALID), F.col("c.table").alias("_t"), "e.*")
        .withColumn("table", F.col("_t"))
        .drop("_t")
    )


def invalid_events() -> Column:
    """Rows that are not contract-v1 events (see :func:`check_record`)."""
    return F.col(INVALID).isNotNull()


def describe_invalid(topic: str, row: Any) -> str:
    return f"record at {topic} partition {row['kafka_partition']} offset {row['kafka_offset']}: {row[INVALID]}"
