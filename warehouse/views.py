"""Temporary SQL views over a warehouse's Delta tables (see :mod:`warehouse.layout`)."""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from warehouse import layout
from warehouse.frame import DELETED
from warehouse.txn import jvm


def _list_dirs(spark: SparkSession, path: str) -> list[str]:
    """Sub-directory names of ``path`` on any Hadoop filesystem."""
    hpath = jvm(spark).org.apache.hadoop.fs.Path(path)
    fs = hpath.getFileSystem(spark._jsparkSession.sessionState().newHadoopConf())
    if not fs.exists(hpath):
        return []
    return sorted(s.getPath().getName() for s in fs.listStatus(hpath) if s.isDirectory())


def topics(spark: SparkSession, warehouse: str) -> list[str]:
    return [layout.unescape_segment(d) for d in _list_dirs(spark, warehouse)]


def register_views(spark: SparkSession, warehouse: str, topic: str | None = None) -> list[str]:
    """Register ``<schema>_<table>_history``, ``<schema>_<table>`` (live rows) and
    ``<schema>_<table>_all`` for every table of ``topic`` (default: the only topic)."""
    from delta.tables import DeltaTable

    if topic is None:
        found = topics(spark, warehouse)
        if len(found) != 1:
            raise ValueError(f"{warehouse} holds {len(found)} topics {found}: choose one with --topic")
        topic = found[0]
    root = layout.topic_root(warehouse, topic)
    names: list[str] = []
    for segment in _list_dirs(spark, root):
        if segment == layout.LOADS_DIR:
            continue
        paths = layout.table_paths(warehouse, topic, layout.table_from_dir_name(segment))
        if DeltaTable.isDeltaTable(spark, paths.history):
            spark.read.format("delta").load(paths.history).createOrReplaceTempView(paths.view_base + "_history")
            names.append(paths.view_base + "_history")
        if DeltaTable.isDeltaTable(spark, paths.current):
            current = spark.read.format("delta").load(paths.current)
            current.createOrReplaceTempView(paths.view_base + "_all")
            current.where(~F.col(DELETED)).drop(DELETED).createOrReplaceTempView(paths.view_base)
            names += [paths.view_base + "_all", paths.view_base]
    return names
