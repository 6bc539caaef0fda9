"""``walbus warehouse stream``: the load as a Spark Structured Streaming query.

Spark's Kafka source reads the topic; Spark's checkpoint (``--checkpoint``, by default
``<warehouse>/<topic>/_walbus_stream``) is the offset store, in place of the load log of
``walbus warehouse load``. Each micro-batch runs the batch load's own per-slice logic
(:func:`warehouse.job.write_slice`), every Delta commit tagged with the load marker
``(walbus-stream:<topic>:<query id>, micro-batch id)`` (:mod:`warehouse.txn`): Spark replays an
unfinished micro-batch with the same id and offsets, the tables that had committed it skip it,
and a write made twice changes nothing. The query id is the checkpoint's (it persists across
restarts from it): a new checkpoint numbers its micro-batches from 0 again, and under the
topic alone its first batches were taken for ones the tables had committed and skipped. So the job runs unchanged
under spark-submit on any cluster (Databricks, EMR, YARN, Kubernetes).

Triggers: ``available-now`` (the default: everything up to now, in batches, then exit; the
nightly run) or a processing-time interval such as ``30 seconds`` (runs until stopped).
One writer per warehouse and topic: do not mix ``load`` and ``stream`` on one warehouse.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame, SparkSession

from warehouse import layout
from warehouse.job import LoadResult, LoadSpec, write_slice
from warehouse.read import spark_kafka_options
from warehouse.txn import Txn

if TYPE_CHECKING:
    from warehouse.metrics import WarehouseMetrics

log = logging.getLogger("walbus.warehouse")
AVAILABLE_NOW = "available-now"


def stream_app_id(topic: str, query_id: str) -> str:
    """The load marker's app id: the topic and the checkpoint's query id."""
    return f"walbus-stream:{topic}:{query_id}"


def start_stream(
    spark: SparkSession, spec: LoadSpec, *, checkpoint: str | None = None, trigger: str = AVAILABLE_NOW,
    metrics: WarehouseMetrics | None = None, failures: list[BaseException] | None = None,
) -> Any:
    """Start the query (a StreamingQuery); the caller awaits it. ``metrics`` count each
    micro-batch (and are written to their file after each one); ``failures`` gets what a
    micro-batch raised (Spark's own error wraps it in a Python traceback's text)."""
    reader = spark.readStream.format("kafka")
    for key, value in spark_kafka_options(spec.kafka).items():
        reader = reader.option(key, value)
    raw = (
        reader.option("subscribe", spec.topic)
        .option("startingOffsets", "earliest")
        # records deleted by retention before they were loaded: the query fails, nothing is skipped
        .option("failOnDataLoss", "true")
        .option("minPartitions", str(max(spark.sparkContext.defaultParallelism, 1)))
        .load()
    )

    query_id: list[str] = []  # the started query's, before its first micro-batch runs
    started_query = threading.Event()

    def micro_batch(frame: DataFrame, batch_id: int) -> None:
        result = LoadResult()
        started = time.monotonic()
        try:
            if not started_query.wait(600):
                raise RuntimeError("the streaming query did not say its id")
            # replay=True: any micro-batch may be one Spark re-runs after a failure
            txn = Txn(stream_app_id(spec.topic, query_id[0]), batch_id, replay=True)
            write_slice(frame.sparkSession, spec, frame, txn, result)
        except BaseException as e:
            if failures is not None:
                failures.append(e)
            if metrics is not None:
                metrics.failed(result)
                metrics.write()
            raise
        log.info("micro-batch", extra={"batch": batch_id, "events": result.events,
                                       "tables": {t: s.as_dict() for t, s in result.tables.items()}})
        if metrics is not None:
            metrics.succeeded(result, time.monotonic() - started)
            metrics.write()

    writer = raw.writeStream.foreachBatch(micro_batch).option(
        "checkpointLocation", checkpoint or layout.stream_checkpoint_path(spec.warehouse, spec.topic)
    )
    writer = writer.trigger(availableNow=True) if trigger == AVAILABLE_NOW else writer.trigger(processingTime=trigger)
    query = writer.start()
    query_id.append(str(query.id))
    started_query.set()
    return query
