"""The SparkSession the loader runs in: Delta and Spark's Kafka source via spark.jars.packages.

The Maven coordinates follow the installed ``pyspark`` and ``delta-spark`` versions, so the
JVM side always matches the Python side (pinned together in pyproject.toml). Nothing here
assumes local mode: ``master`` may be ``yarn``, ``k8s://…`` or ``spark://…``; the packages are
resolved by the driver and shipped to the executors by Spark itself.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping
from typing import Any

SCALA_VERSION = "2.13"


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
    kafka = f"org.apache.spark:spark-sql-kafka-0-10_{SCALA_VERSION}:{spark_version}"
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
        # a column named twice in one event keeps its last value (as the demux does), not a
        # failed load
        "spark.sql.mapKeyDedupPolicy": "LAST_WIN",
        # a key named twice in a record's JSON keeps its last value, as orjson (walbus.contract)
        # reads it, in the contract check's parse too (warehouse.read.checked)
        "spark.sql.variant.allowDuplicateKeys": "true",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        # Delta reconstructs its snapshot with this many tasks (50 by default): far too many
        # for small tables on a few cores.
        "spark.databricks.delta.snapshotPartitions": str(max(shuffle_partitions, 1)),
        "spark.ui.showConsoleProgress": "false",
    }


def build_session(
    *,
    master: str | None = None,
    app_name: str = "walbus-warehouse",
    conf: Mapping[str, str] | None = None,
    shuffle_partitions: int = 4,
) -> Any:
    """Create (or return the running) SparkSession with walbus' settings.

    ``master`` None leaves it to spark-submit / SPARK_MASTER (cluster deployments).
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    settings = base_conf(shuffle_partitions=shuffle_partitions)
    if master and master.startswith("local"):
        # local mode talks to itself only: bind the driver to loopback, not to whatever
        # address the host name resolves to
        settings["spark.driver.host"] = "127.0.0.1"
        settings["spark.driver.bindAddress"] = "127.0.0.1"
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # local Python workers run this interpreter (and so see walbus and its dependencies),
        # not whatever `python3` the PATH finds first
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
