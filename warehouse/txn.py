"""Exactly-once writes per Delta table: the load id travels in the table's own commit.

Every write of load N to a table carries Delta's idempotent-transaction marker
``(txnAppId = walbus:<topic>, txnVersion = N)`` in the same atomic commit as the data. Delta
skips a write whose marker the table already has, so a load replayed after a crash (same N,
same offsets, see :mod:`warehouse.loads`) redoes exactly the tables it had not committed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson
from pyspark.sql import SparkSession

log = logging.getLogger("walbus.warehouse")


@dataclass(frozen=True)
class Txn:
    app_id: str
    batch_id: int
    replay: bool = False  # only a replayed load can find its marker in a table already

    def applied(self, spark: SparkSession, path: str) -> bool:
        """Whether the table at ``path`` already committed this load (or a later one)."""
        return self.replay and applied_version(spark, path, self.app_id) >= self.batch_id

    def tagged_session(self, spark: SparkSession) -> SparkSession:
        """A session whose DML commits (MERGE) carry this load's marker.

        Delta takes a DML statement's marker from session settings. A child session (same
        SparkContext, cache and Delta logs; settings of its own) keeps the tag off the other
        tables' commits, which other driver threads make at the same time on ``spark``.
        """
        tagged = spark.newSession()
        tagged.conf.set("spark.databricks.delta.write.txnAppId", self.app_id)
        tagged.conf.set("spark.databricks.delta.write.txnVersion", str(self.batch_id))
        return tagged


def jvm(spark: SparkSession) -> Any:
    """The py4j view of the driver JVM (classic Spark, not Spark Connect)."""
    gateway: Any = spark.sparkContext._jvm
    if gateway is None:
        raise RuntimeError("no JVM gateway: walbus needs a classic (non-Connect) Spark session")
    return gateway


def _jvm_snapshot(spark: SparkSession, path: str) -> Any:
    gw = jvm(spark)
    log = gw.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)
    return log.update(False, gw.scala.Option.empty(), gw.scala.Option.empty())


def applied_version(spark: SparkSession, path: str, app_id: str) -> int:
    """The last txnVersion the table committed for ``app_id`` (-1: none, or no table)."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return -1
    # Delta keeps the markers as SetTransaction actions in the log; read them with SQL on
    # the log's JSON/checkpoint files would couple us to its layout, so ask the snapshot.
    snapshot = _jvm_snapshot(spark, path)
    versions = snapshot.transactions()
    value = versions.get(app_id)
    return int(value.get()) if value.isDefined() else -1


def last_commit_metrics(spark: SparkSession, path: str) -> dict[str, str]:
    """Operation metrics of the table's latest commit (the write just made: one writer).

    Read from that commit's own file, ``_delta_log/<version>.json`` (its ``commitInfo``
    action), through the table's Hadoop file system: DESCRIBE HISTORY cost ~220 ms a call, a
    fixed cost every table of a load paid twice. Delta's history is the fallback."""
    try:
        metrics = _commit_file_metrics(spark, path)
    except Exception:  # py4j or file-system trouble: Delta's own (slower) way decides
        log.debug("reading the last commit's file failed", extra={"path": path}, exc_info=True)
        metrics = None
    if metrics is not None:
        return metrics
    from delta.tables import DeltaTable

    row = DeltaTable.forPath(spark, path).history(1).select("operationMetrics").first()
    return dict(row["operationMetrics"] or {}) if row is not None else {}


_COMMIT_LINES = 64  # commitInfo is a commit file's first action; a few lines at most are read


def _commit_file_metrics(spark: SparkSession, path: str) -> dict[str, str] | None:
    gw = jvm(spark)
    version = int(_jvm_snapshot(spark, path).version())
    commit = gw.org.apache.hadoop.fs.Path(f"{path.rstrip('/')}/_delta_log/{version:020d}.json")
    fs = commit.getFileSystem(spark._jsc.hadoopConfiguration())
    reader = gw.java.io.BufferedReader(gw.java.io.InputStreamReader(fs.open(commit), "UTF-8"))
    try:
        for _ in range(_COMMIT_LINES):
            line = reader.readLine()
            if line is None:
                return None
            action = orjson.loads(line)
            info = action.get("commitInfo") if isinstance(action, dict) else None
            if isinstance(info, dict):
                found = info.get("operationMetrics") or {}
                return {str(k): str(v) for k, v in found.items()}
        return None
    finally:
        reader.close()


def table_configuration(spark: SparkSession, path: str) -> dict[str, str]:
    """The table's properties as SHOW TBLPROPERTIES gives those walbus reads (its metadata's
    configuration and its protocol's reader and writer versions), from the Delta snapshot:
    SHOW TBLPROPERTIES cost ~50 ms a call, several times a table per load."""
    gw = jvm(spark)
    snapshot = _jvm_snapshot(spark, path)
    configuration = gw.scala.jdk.javaapi.CollectionConverters.asJava(snapshot.metadata().configuration())
    found = {str(k): str(v) for k, v in dict(configuration).items()}
    protocol = snapshot.protocol()
    found["delta.minReaderVersion"] = str(protocol.minReaderVersion())
    found["delta.minWriterVersion"] = str(protocol.minWriterVersion())
    return found
