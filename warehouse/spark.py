"""The SparkSession the loader runs in: Delta and Spark's Kafka source via spark.jars.packages.

The Maven coordinates follow the installed ``pyspark`` and ``delta-spark`` versions, so the
JVM side always matches the Python side (their ranges in pyproject.toml's warehouse extra). Nothing here
assumes local mode: ``master`` may be ``yarn``, ``k8s://…`` or ``spark://…``; the packages are
resolved by the driver and shipped to the executors by Spark itself.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from warehouse import driver_cache

log = logging.getLogger("walbus.warehouse")

SCALA_VERSION = "2.13"
# The Kafka connector release per Spark minor version: one whose dependency
# spark-token-provider-kafka-0-10 Maven Central serves (not every patch release has it, e.g.
# 4.0.1); a connector runs on any patch release of its minor version.
KAFKA_CONNECTOR = {"4.0": "4.0.0", "4.1": "4.1.1", "4.2": "4.2.0"}


def packages() -> list[str]:
    """Maven coordinates of the Delta and Kafka connector jars matching the Python packages."""
    import pyspark

    spark_version = pyspark.__version__
    delta_version = importlib.metadata.version("delta-spark")
    major, minor = (int(p) for p in delta_version.split(".")[:2])
    # delta-spark >= 4.1 publishes one artifact per Spark minor version (delta-spark_4.1_2.13).
    if (major, minor) >= (4, 1):
        spark_mm = ".".join(spark_version.split(".")[:2])
        delta = f"io.delta:delta-spark_{spark_mm}_{SCALA_VERSION}:{delta_version}"
    else:
        delta = f"io.delta:delta-spark_{SCALA_VERSION}:{delta_version}"
    spark_minor = ".".join(spark_version.split(".")[:2])
    kafka_version = KAFKA_CONNECTOR.get(spark_minor, spark_version)
    kafka = f"org.apache.spark:spark-sql-kafka-0-10_{SCALA_VERSION}:{kafka_version}"
    return [delta, kafka]


def base_conf(*, shuffle_partitions: int = 4) -> dict[str, str]:
    """Settings every walbus Spark session needs, whatever the master."""
    return {
        "spark.jars.packages": ",".join(packages()),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        # PostgreSQL timestamps without time zone are read as UTC wall-clock times, and
        # timestamptz values are normalized to UTC: the warehouse never depends on the
        # driver's or the executors' local zone.
        "spark.sql.session.timeZone": "UTC",
        # PostgreSQL identifiers are case-sensitive ("Amount" and amount are two columns).
        "spark.sql.caseSensitive": "true",
        # The Python workers that decode a load's records (warehouse.decode) take them in Arrow
        # batches of at most 10,000 records (Spark's default) and this many bytes, so a slice of
        # huge rows does not put gigabytes in one worker's batch (it holds two at a time).
        "spark.sql.execution.arrow.maxBytesPerBatch": str(16 << 20),
        # a column named twice in one event keeps its last value (as the demux does), not a
        # failed load
        "spark.sql.mapKeyDedupPolicy": "LAST_WIN",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        # Constraint propagation infers filters from every projection's predicates; over the fill
        # of unchanged TOAST values (a self-union and two joins of rows with many columns) its
        # constraint sets grew past the driver's memory from ~16 columns on: a 2-event load died
        # in OutOfMemoryError (a types fuzz). Nothing a load runs gains from the filters it infers.
        "spark.sql.constraintPropagation.enabled": "false",
        # Delta reconstructs its snapshot with this many tasks (50 by default): far too many
        # for small tables on a few cores.
        "spark.databricks.delta.snapshotPartitions": str(max(shuffle_partitions, 1)),
        "spark.ui.showConsoleProgress": "false",
        # pyspark 4 notes the Python call site of every DataFrame and Column call for error
        # messages: ~4 py4j round trips and a failed `import IPython` each, 3/4 of the
        # commands building a table's DataFrames costs (a 16-table insert-only load: 16.5-16.7
        # -> 10.1-14.3 s). A load's DataFrames are walbus' own code: the note names its lines.
        "spark.python.sql.dataFrameDebugging.enabled": "false",
    }


# local[…], or a standalone master on loopback (spark://127.0.0.1:7077, spark://localhost:7077)
_THIS_HOST_MASTER = re.compile(r"local.*|spark://(localhost|127(\.[0-9]{1,3}){3})(:[0-9]+)?")


def on_this_host(master: str) -> bool:
    """Whether ``master`` runs every executor on this host (local mode or a loopback cluster)."""
    return _THIS_HOST_MASTER.fullmatch(master) is not None


def default_log_path() -> str:
    """Where the driver JVM's own output goes (Ivy's jar resolution, log4j's console)."""
    return os.environ.get("WALBUS_SPARK_LOG") or os.path.join(tempfile.gettempdir(), f"walbus-spark-{os.getuid()}.log")


def default_sql_warehouse() -> str:
    """Spark's session-catalog directory for a driver on this host (see :func:`sql_warehouse_conf`)."""
    return os.path.join(tempfile.gettempdir(), f"walbus-spark-warehouse-{os.getuid()}")


def sql_warehouse_conf(master: str | None) -> dict[str, str]:
    """``spark.sql.warehouse.dir`` in the temp directory when the driver runs on this host: a
    local or loopback master, or none outside spark-submit (PySpark's ``local[*]``).

    Spark's in-memory catalog creates its default database's directory on its first use (a
    load's too), by default ``./spark-warehouse``: an empty directory left in the working
    directory; walbus' tables live at their Delta paths. A cluster keeps its own setting.
    """
    here = on_this_host(master) if master else "PYSPARK_GATEWAY_PORT" not in os.environ
    return {"spark.sql.warehouse.dir": default_sql_warehouse()} if here else {}


LOG_ROTATE_BYTES = 64 << 20  # the driver JVM's log is rotated at start once this large
LOG_GENERATIONS = 3  # rotated logs kept beside it: .1 (newest) to .3


def rotate_log(path: str, *, max_bytes: int = LOG_ROTATE_BYTES, keep: int = LOG_GENERATIONS) -> bool:
    """Move ``path`` to ``path.1`` (``.1`` to ``.2`` and so on, the oldest dropped) once it has
    reached ``max_bytes``; True when it did. The JVM writes its output to an inherited file
    descriptor, which nothing can rotate under it, so a log is rotated when a JVM starts:
    nightly loads no longer grow one file forever."""
    try:
        if os.path.getsize(path) < max_bytes:
            return False
    except OSError:  # not there yet
        return False
    for generation in range(keep - 1, 0, -1):
        older = f"{path}.{generation}"
        if os.path.exists(older):
            os.replace(older, f"{path}.{generation + 1}")
    os.replace(path, f"{path}.1")
    return True


def _start_gateway(conf: Any, classpath: str, log_path: str) -> Any:
    from pyspark.java_gateway import launch_gateway

    before = os.environ.get(driver_cache.DIST_CLASSPATH)
    if classpath:  # PySpark's launcher passes this process' environment on
        os.environ[driver_cache.DIST_CLASSPATH] = f"{before}:{classpath}" if before else classpath
    try:
        with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
            return launch_gateway(conf, popen_kwargs={"stdout": out, "stderr": out})  # type: ignore[no-untyped-call]
    finally:
        if classpath:
            if before is None:
                os.environ.pop(driver_cache.DIST_CLASSPATH, None)
            else:
                os.environ[driver_cache.DIST_CLASSPATH] = before


def _launch_jvm(launch: driver_cache.Launch, log_path: str, plain: Mapping[str, str] | None = None) -> None:
    """Start the driver JVM with its stdout/stderr appended to ``log_path``.

    PySpark would start it with this process' terminal as its output, where Ivy prints some
    hundred lines on a first run and log4j its warnings; Spark's own launcher takes the
    same settings (``--conf``) either way. Nothing happens when a JVM is already there or
    when spark-submit started this process (PYSPARK_GATEWAY_PORT). ``launch`` may append
    jars to its class path and map or write a class archive (:mod:`warehouse.driver_cache`);
    a JVM that does not start that way is started again with ``plain`` settings, without them.
    """
    from pyspark import SparkConf, SparkContext

    with SparkContext._lock:
        if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
            return
        conf = SparkConf(loadDefaults=False).setAll(list(launch.settings.items()))
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        rotate_log(log_path)
        log.debug("spark driver launch", extra={"archive": str(launch.archive) if launch.archive else None,
                                                "ivy": not launch.classpath})
        try:
            gateway = _start_gateway(conf, launch.classpath, log_path)
        except Exception:
            if not launch.cached or plain is None:
                raise
            # never a driver that cannot start because of walbus' cache: without it, as before
            log.warning("the driver JVM did not start with walbus' driver cache (see the Spark log); "
                        "starting it without", extra={"archive": str(launch.archive) if launch.archive else None})
            gateway = _start_gateway(SparkConf(loadDefaults=False).setAll(list(plain.items())), "", log_path)
        SparkContext._gateway = gateway
        SparkContext._jvm = gateway.jvm


def build_session(
    *,
    master: str | None = None,
    app_name: str = "walbus-warehouse",
    conf: Mapping[str, str] | None = None,
    shuffle_partitions: int = 4,
    log_path: str | None = None,
    archive_output: str | None = None,
    use_driver_cache: bool = True,
) -> Any:
    """Create (or return the running) SparkSession with walbus' settings.

    ``master`` None leaves it to spark-submit / SPARK_MASTER (cluster deployments). The
    JVM's own output goes to ``log_path`` (default: :func:`default_log_path`), not the terminal.
    A driver JVM this starts skips Ivy and maps a class archive when ``walbus warehouse
    prepare`` kept them (:mod:`warehouse.driver_cache`); with ``archive_output`` it writes
    its class archive there as it exits instead (see :mod:`warehouse.prepare`);
    ``use_driver_cache`` False: neither (Ivy resolves the packages).
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    settings = base_conf(shuffle_partitions=shuffle_partitions)
    if master and on_this_host(master):
        # local mode, or a cluster on this host's loopback: its executors reach the driver
        # on loopback, not on whatever address the host name resolves to
        settings["spark.driver.host"] = "127.0.0.1"
        settings["spark.driver.bindAddress"] = "127.0.0.1"
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # Python workers (local or this host's executors) run this interpreter, which sees
        # walbus and its dependencies, not whatever `python3` the PATH finds first
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    settings.update(sql_warehouse_conf(master))
    settings.update(conf or {})
    log_path = log_path or default_log_path()
    if "-XX:ErrorFile=" not in settings.get(driver_cache.JAVA_OPTIONS, ""):
        # a JVM that dies writes its crash report beside the log, not in the working directory
        crash = os.path.join(os.path.dirname(os.path.abspath(log_path)), f"walbus-spark-crash-{os.getuid()}-%p.log")
        settings = driver_cache.with_java_option(settings, f"-XX:ErrorFile={crash}")
    launch = (
        driver_cache.plan_launch(settings, master, archive_output=Path(archive_output) if archive_output else None)
        if use_driver_cache
        else driver_cache.Launch(settings)
    )
    for key, value in launch.settings.items():
        builder = builder.config(key, value)
    named = {"spark.app.name": app_name, **({"spark.master": master} if master else {})}
    _launch_jvm(
        dataclasses.replace(launch, settings={**launch.settings, **named}),
        log_path,
        {**settings, **named} if archive_output is None else None,
    )
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    _import_hot_classes(session)
    return session


# The classes pyspark names without their package on every column operation (``F.col``, ``==``,
# ``&``: ``jvm.functions``), found through its star imports: py4j tries the bare name, then
# each star-imported package in turn, each miss a lookup through every jar on the classpath.
# A single import names the same class at once (JFR of a 16-table load: py4j's class lookups
# were 10% of the driver's samples).
_HOT_CLASSES: Final = (
    "org.apache.spark.sql.functions",
    "org.apache.spark.api.python.PythonUtils",
    "org.apache.spark.sql.api.python.PythonSQLUtils",
)


def _import_hot_classes(session: Any) -> None:
    from py4j.java_gateway import java_import  # type: ignore[import-untyped]

    view = session.sparkContext._jvm
    if view is None:  # Spark Connect: no gateway
        return
    for name in _HOT_CLASSES:
        java_import(view, name)


def stop_jvm(spark: Any, timeout: float = 60.0) -> int:
    """Stop the session and the driver JVM this process started; the JVM's exit status (-1: none).

    ``spark.stop()`` alone leaves the JVM to notice this process's exit (its stdin closing):
    after a Ctrl-C inside a Py4J call (``awaitTermination``) it did not, and ran on orphaned."""
    from pyspark import SparkContext

    spark.stop()
    with SparkContext._lock:
        gateway = SparkContext._gateway
        SparkContext._gateway = None
        SparkContext._jvm = None
    if gateway is None:
        return -1
    proc = gateway.proc
    # Not gateway.close(): with a stream's callback server (foreachBatch) it joined a thread
    # that never ended, and this process hung there, holding the JVM's stdin open.
    proc.stdin.close()  # PySpark's gateway exits when its stdin closes
    try:
        return int(proc.wait(timeout))
    except subprocess.TimeoutExpired:
        log.warning("the driver JVM did not exit; killed", extra={"seconds": timeout, "pid": proc.pid})
        proc.kill()
        return int(proc.wait())
