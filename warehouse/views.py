"""Temporary SQL views over a warehouse's Delta tables (see :mod:`warehouse.layout`)."""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from warehouse import layout
from warehouse.frame import DELETED
from warehouse.schema import quote
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
    """Register each table's live-rows, ``_all`` and ``_history`` views (names in
    :mod:`warehouse.layout`) for ``topic`` (default: the only topic), and
    ``_walbus_quarantine`` when the topic has quarantined records."""
    from delta.tables import DeltaTable

    if topic is None:
        found = topics(spark, warehouse)
        if len(found) != 1:
            raise ValueError(f"{warehouse} holds {len(found)} topics {found}: choose one with --topic")
        topic = found[0]
    root = layout.topic_root(warehouse, topic)
    names: list[str] = []
    quarantine = layout.quarantine_path(warehouse, topic)
    if DeltaTable.isDeltaTable(spark, quarantine):
        spark.read.format("delta").load(quarantine).createOrReplaceTempView(layout.QUARANTINE_VIEW)
        names.append(layout.QUARANTINE_VIEW)
    for segment in _list_dirs(spark, root):
        pair = layout.table_from_dir_name(segment)
        if pair is None:  # _walbus_loads, _walbus_quarantine
            continue
        paths = layout.table_paths(warehouse, topic, *pair)
        if DeltaTable.isDeltaTable(spark, paths.history):
            _view(spark.read.format("delta").load(paths.history), paths.view("history"))
            names.append(paths.view("history"))
        if DeltaTable.isDeltaTable(spark, paths.current):
            current = spark.read.format("delta").load(paths.current)
            _view(current, paths.view("all"))
            _view(current.where(~F.col(DELETED)).drop(DELETED), paths.view(""))
            names += [paths.view("all"), paths.view("")]
    return names


def _view(frame: DataFrame, name: str) -> None:
    # the name is parsed as an identifier: quoted, any table's name is one part
    frame.createOrReplaceTempView(quote(name))
