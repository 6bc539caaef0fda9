"""Exactly-once writes per Delta table: the load id travels in the table's own commit.

Every write of load N to a table is exactly-once by what it writes: a history append leaves
out the events the table holds already (their ``(commit LSN, seq)``, :mod:`warehouse.history`),
and the current table's MERGE replaces a row only with a strictly later event
(:mod:`warehouse.current`), so a load written twice leaves the tables as once. A load replayed
after a crash (same N, same offsets, see :mod:`warehouse.loads`) therefore never needs to know
which tables had committed it; it asks only to skip their work and to say so.

That is what the load marker is for: each commit carries ``{"walbus.load": [<app id>, N]}`` in
its ``userMetadata`` (``walbus:<topic>`` for ``load``, ``walbus-stream:<topic>:<query id>`` for
``stream``), read back from the table's latest commit files (:func:`applied_load`). Delta's own
idempotent-transaction marker (``txnAppId``/``txnVersion``, which walbus wrote until stop 35
and still writes on the quarantine table, whose appends nothing de-duplicates) is not used on
the tables: Delta 4.4 checks it by computing the table's state, three Spark jobs a write, ~1.4 s
of a small table's load (docs/warehouse.md).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import orjson
from pyspark.sql import SparkSession

log = logging.getLogger("walbus.warehouse")


# The settings under which a small load runs interpreted (warehouse.job), which a tagged child
# session keeps from the loading session.
INTERPRETED_SETTINGS: Final = {"spark.sql.codegen.factoryMode": "NO_CODEGEN", "spark.sql.codegen.wholeStage": "false"}
# The key of a commit's userMetadata that names the load which made it: [app id, load id].
LOAD_KEY: Final = "walbus.load"
_USER_METADATA_CONF: Final = "spark.databricks.delta.commitInfo.userMetadata"


@dataclass(frozen=True)
class Txn:
    app_id: str
    batch_id: int
    replay: bool = False  # only a replayed load can find its marker in a table already

    def applied(self, spark: SparkSession, path: str) -> bool:
        """Whether the table at ``path`` already committed this load (or a later one)."""
        return self.replay and applied_load(spark, path, self.app_id) >= self.batch_id

    def user_metadata(self, extra: dict[str, str] | None = None) -> str:
        """A commit's userMetadata naming this load (and ``extra`` keys)."""
        return orjson.dumps({LOAD_KEY: [self.app_id, self.batch_id], **(extra or {})}).decode()

    def tagged_session(self, spark: SparkSession, extra: dict[str, str] | None = None) -> SparkSession:
        """A session whose MERGE (UPDATE…) commits carry this load's marker (and ``extra`` keys).

        Delta takes a DML statement's userMetadata from a session setting. A child session
        (same SparkContext, cache and Delta logs; settings of its own) keeps the tag off the
        other tables' commits, which other driver threads make at the same time on ``spark``.
        """
        tagged = spark.newSession()
        for key in INTERPRETED_SETTINGS:  # a child session starts from the defaults
            value = spark.conf.get(key, None)
            if value is not None:
                tagged.conf.set(key, value)
        tagged.conf.set(_USER_METADATA_CONF, self.user_metadata(extra))
        return tagged


def jvm(spark: SparkSession) -> Any:
    """The py4j view of the driver JVM (classic Spark, not Spark Connect)."""
    gateway: Any = spark.sparkContext._jvm
    if gateway is None:
        raise RuntimeError("no JVM gateway: walbus needs a classic (non-Connect) Spark session")
    return gateway


# The JVM classes walbus calls, per gateway. py4j resolves ``jvm.org.apache.x.Y`` one name at a
# time, a round trip each, and every package prefix is first tried as a class: a failed lookup
# through every jar on the classpath (and through each of pyspark's star imports for the first
# name), ~13 failed lookups for one class. A load asked for ~45 such classes a table.
_CLASSES: dict[int, tuple[Any, dict[str, Any]]] = {}
_CLASSES_LOCK = threading.Lock()


def jvm_class(spark: SparkSession, name: str) -> Any:
    """The JVM class ``name`` (fully qualified), looked up once per gateway."""
    gateway = jvm(spark)
    with _CLASSES_LOCK:
        held = _CLASSES.get(id(gateway))
        if held is None or held[0] is not gateway:  # a new gateway (a JVM started again)
            held = _CLASSES[id(gateway)] = (gateway, {})
        found = held[1].get(name)
    if found is None:
        found = getattr(gateway, name)  # one lookup of the whole name
        with _CLASSES_LOCK:
            held[1][name] = found
    return found


def _jvm_snapshot(spark: SparkSession, path: str) -> Any:
    log = jvm_class(spark, "org.apache.spark.sql.delta.DeltaLog").forTable(spark._jsparkSession, path)
    none = jvm_class(spark, "scala.Option").empty()
    return log.update(False, none, none)


def is_delta_table(spark: SparkSession, path: str) -> bool:
    """Whether ``path`` holds a Delta table (``DeltaTable.isDeltaTable``, its class looked up once)."""
    return bool(jvm_class(spark, "io.delta.tables.DeltaTable").isDeltaTable(spark._jsparkSession, path))


def hadoop_path(spark: SparkSession, path: str) -> Any:
    """A Hadoop ``Path`` object for ``path``."""
    return jvm_class(spark, "org.apache.hadoop.fs.Path")(path)


def applied_version(spark: SparkSession, path: str, app_id: str) -> int:
    """The last txnVersion the table committed for ``app_id`` (-1: none, or no table)."""
    if not is_delta_table(spark, path):
        return -1
    # Delta keeps the markers as SetTransaction actions in the log; read them with SQL on
    # the log's JSON/checkpoint files would couple us to its layout, so ask the snapshot.
    snapshot = _jvm_snapshot(spark, path)
    versions = snapshot.transactions()
    value = versions.get(app_id)
    return int(value.get()) if value.isDefined() else -1


# Commits looked back through for a load marker: a load makes one to three commits a table
# (an append or MERGE, a TRUNCATE's UPDATE and property), so the last load's marker is among
# the latest few unless other writers (OPTIMIZE, VACUUM) committed since.
_MARKER_COMMITS = 32


def applied_load(spark: SparkSession, path: str, app_id: str) -> int:
    """The last load of ``app_id`` the table committed (-1: none, or no table): the newest
    commit naming one, by its userMetadata (:data:`LOAD_KEY`) or, for a commit of an older
    walbus, Delta's transaction marker in it. Read from the latest commit files; Delta's
    computed state decides only when they cannot say (more commits than are looked through, a
    commit file removed by log cleanup)."""
    if not is_delta_table(spark, path):
        return -1
    try:
        for v, actions in _recent_commits(spark, path, _MARKER_COMMITS):
            found = next((n for a in actions if (n := _load_marker(a, app_id)) is not None), None)
            if found is not None:
                return found
            if v == 0:
                return -1  # every commit looked at: none of this app's
    except Exception:  # py4j, file-system or JSON trouble, a commit file gone, a huge commit: Delta decides
        log.debug("reading the table's load markers failed", extra={"path": path}, exc_info=True)
    return applied_version(spark, path, app_id)


def _load_marker(action: Any, app_id: str) -> int | None:
    """The load id of ``app_id`` that one action of a commit names, if it names one."""
    if not isinstance(action, dict):
        return None
    info = action.get("commitInfo")
    if isinstance(info, dict) and isinstance(info.get("userMetadata"), str):
        try:
            mark = orjson.loads(info["userMetadata"]).get(LOAD_KEY)
        except (orjson.JSONDecodeError, AttributeError):
            return None  # another writer's userMetadata
        if isinstance(mark, list) and len(mark) == 2 and mark[0] == app_id and isinstance(mark[1], int):
            return mark[1]
        return None
    txn = action.get("txn")
    if isinstance(txn, dict) and txn.get("appId") == app_id and isinstance(txn.get("version"), int):
        return int(txn["version"])
    return None


def table_version(spark: SparkSession, path: str) -> int:
    """The table's latest version."""
    return int(_jvm_snapshot(spark, path).version())


def last_commit_metrics(spark: SparkSession, path: str, since: int | None = None) -> dict[str, str]:
    """Operation metrics of the table's latest commit (the write just made: one writer); none
    when the table has no commit after version ``since`` (Delta commits nothing for a write
    that adds no file and carries no transaction marker).

    Read from that commit's own file, ``_delta_log/<version>.json`` (its ``commitInfo``
    action), through the table's Hadoop file system: DESCRIBE HISTORY cost ~220 ms a call, a
    fixed cost every table of a load paid twice. Delta's history is the fallback."""
    try:
        version = table_version(spark, path)
    except Exception:  # py4j trouble: Delta's own (slower) way decides below
        log.debug("reading the table's version failed", extra={"path": path}, exc_info=True)
        version = None
    if since is not None and version is not None and version <= since:
        return {}
    try:
        metrics = None if version is None else _commit_file_metrics(spark, path, version)
    except Exception:  # py4j or file-system trouble: Delta's own (slower) way decides
        log.debug("reading the last commit's file failed", extra={"path": path}, exc_info=True)
        metrics = None
    if metrics is not None:
        return metrics
    from delta.tables import DeltaTable

    row = DeltaTable.forPath(spark, path).history(1).select("operationMetrics").first()
    return dict(row["operationMetrics"] or {}) if row is not None else {}


_COMMIT_LINES = 64  # commitInfo is a commit file's first action; a few lines at most are read
_COMMIT_BYTES = 1 << 20  # ... out of the file's first MiB
_SCANNED_LINES = 4096  # a commit scanned whole for data changes: more actions, no answer
_SCANNED_BYTES = 8 << 20  # nor from a larger file (~2 KiB an action at most)
_SCANNED_COMMITS = 8  # commits looked back through for the history's high-water mark
# The history's highest commit LSN after a walbus append: in that commit's userMetadata.
HIGH_WATER_KEY = "walbus.history.maxCommitLsn"


def _commit_lines(
    spark: SparkSession, path: str, version: int, max_bytes: int | None = None, *, whole: bool = False
) -> Iterator[Any]:
    """The actions of the table's commit ``version`` (its ``_delta_log`` JSON file), in order:
    those of the whole lines in its first ``max_bytes`` bytes when given (``whole``: a larger
    file is a ValueError instead).

    The file comes over in one call (py4j: a round trip per line read cost more than the
    rest of a small table's log reads)."""
    commit = hadoop_path(spark, f"{path.rstrip('/')}/_delta_log/{version:020d}.json")
    fs = commit.getFileSystem(spark._jsc.hadoopConfiguration())
    size = int(fs.getFileStatus(commit).getLen())
    cut = size if max_bytes is None else min(size, max_bytes)
    if whole and cut < size:
        raise ValueError(f"commit {version} of {path} is larger than {max_bytes} bytes")
    stream = fs.open(commit)
    try:
        data = bytes(jvm_class(spark, "org.apache.commons.io.IOUtils").toByteArray(stream, cut))
    finally:
        stream.close()
    lines = data.split(b"\n")
    if cut < size:
        lines.pop()  # a line cut short
    for line in lines:
        if line.strip():
            yield orjson.loads(line)


def _commit_file_metrics(spark: SparkSession, path: str, version: int) -> dict[str, str] | None:
    for action in itertools.islice(_commit_lines(spark, path, version, _COMMIT_BYTES), _COMMIT_LINES):
        info = action.get("commitInfo") if isinstance(action, dict) else None
        if isinstance(info, dict):
            found = info.get("operationMetrics") or {}
            return {str(k): str(v) for k, v in found.items()}
    return None


@dataclass(frozen=True)
class HighWater:
    """What a table's own log says of the highest value of one of its columns (a walbus
    writer's mark): ``known`` False when it cannot say (the caller asks the data); ``value``
    None for a table without rows."""

    known: bool
    value: int | None = None


def _recent_commits(spark: SparkSession, path: str, limit: int = _SCANNED_COMMITS) -> Iterator[tuple[int, list[Any]]]:
    """The table's latest commits, newest first, each with its actions (at most ``limit`` of
    them; ValueError for a commit of more than ``_SCANNED_LINES`` actions or ``_SCANNED_BYTES``)."""
    version = table_version(spark, path)
    for v in range(version, max(version - limit, -1), -1):
        actions = list(itertools.islice(_commit_lines(spark, path, v, _SCANNED_BYTES, whole=True), _SCANNED_LINES + 1))
        if len(actions) > _SCANNED_LINES:
            raise ValueError(f"commit {v} of {path} has more than {_SCANNED_LINES} actions")
        yield v, actions


def high_water(spark: SparkSession, path: str, key: str) -> HighWater:
    """The highest value walbus noted under ``key`` in a commit's ``userMetadata``, from the
    table's latest commits: the last walbus write's mark, or an empty table, with only
    commits that add no rows since (schema changes, properties, OPTIMIZE). Unknown after any
    other commit that adds rows, a commit file gone (log cleanup) or too long a search."""
    try:
        for v, actions in _recent_commits(spark, path):
            adds_rows = False
            for action in actions:
                info = action.get("commitInfo") if isinstance(action, dict) else None
                if isinstance(info, dict) and isinstance(info.get("userMetadata"), str):
                    mark = orjson.loads(info["userMetadata"]).get(key)
                    if mark is not None:
                        return HighWater(True, int(mark))
                add = action.get("add") if isinstance(action, dict) else None
                if isinstance(add, dict) and add.get("dataChange", True):
                    adds_rows = True
            if adds_rows:
                return HighWater(False)
            if v == 0:
                return HighWater(True, None)  # created empty, no rows added since
    except Exception:  # py4j, file-system or JSON trouble: the data decides
        log.debug("reading a table's high-water mark failed", extra={"path": path, "key": key}, exc_info=True)
    return HighWater(False)


def history_high_water(spark: SparkSession, path: str) -> HighWater:
    """The history's highest commit LSN (:data:`HIGH_WATER_KEY`, see :func:`high_water`)."""
    return high_water(spark, path, HIGH_WATER_KEY)


def never_written(spark: SparkSession, path: str) -> bool:
    """Whether no commit since the table's creation added a data file (False when unsure:
    more commits than are looked through, a commit file gone, py4j trouble)."""
    try:
        for v, actions in _recent_commits(spark, path):
            if any(isinstance(a, dict) and "add" in a for a in actions):
                return False
            if v == 0:
                return True
    except Exception:
        log.debug("reading the table's commits failed", extra={"path": path}, exc_info=True)
    return False


def table_size_bytes(spark: SparkSession, path: str) -> int | None:
    """The table's data size from its latest checksum file (no Spark job), or None when the
    snapshot has none (computing it would be a job over the whole log: ~1 s)."""
    try:
        checksum = _jvm_snapshot(spark, path).checksumOpt()
        return int(checksum.get().tableSizeBytes()) if checksum.isDefined() else None
    except Exception:  # py4j trouble, or a Delta without checksums: unknown
        log.debug("reading the table's checksum failed", extra={"path": path}, exc_info=True)
        return None


def table_configuration(spark: SparkSession, path: str) -> dict[str, str]:
    """The table's properties as SHOW TBLPROPERTIES gives those walbus reads (its metadata's
    configuration and its protocol's reader and writer versions), from the Delta snapshot:
    SHOW TBLPROPERTIES cost ~50 ms a call, several times a table per load. The metadata and
    protocol actions come over as their log JSON, a round trip each (not one per property)."""
    snapshot = _jvm_snapshot(spark, path)
    metadata = orjson.loads(snapshot.metadata().json())["metaData"]
    protocol = orjson.loads(snapshot.protocol().json())["protocol"]
    found = {str(k): str(v) for k, v in (metadata.get("configuration") or {}).items()}
    found["delta.minReaderVersion"] = str(protocol["minReaderVersion"])
    found["delta.minWriterVersion"] = str(protocol["minWriterVersion"])
    return found
