"""``walbus warehouse prepare``: what a host needs before its first load, done once.

What :mod:`warehouse.driver_cache` keeps, each made by a driver JVM of its own:

1. the Delta and Kafka connector jars resolved by Ivy (the session's own
   ``spark.jars.packages``, fetched into Ivy's cache), and their list;
2. the driver JVM's class archive, written by a JVM started as later ones will be (the jars
   on its class path, no Ivy) that rehearses a load: a few thousand synthetic contract-v1
   events of one table, decoded and written by :func:`warehouse.job.write_slice` into a
   temporary warehouse twice (a first load, then updates and deletes: CTAS, append, MERGE),
   once interpreted and once with generated code, as loads of each size run. No Kafka
   broker is needed.

Each is written under a temporary name and renamed once whole (the archive once its JVM has
exited cleanly), so a JVM never maps a half-written archive, and two runs at once each write
their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from walbus.contract import encode_event, event_key
from walbus.kafka import KafkaOptions
from warehouse import driver_cache
from warehouse.spark import stop_jvm

log = logging.getLogger("walbus.warehouse")

_TABLE: Final = "public.walbus_prepare"
# the column types a load meets most: each converted the way a load converts it
_COLUMNS: Final = (
    ("id", "int8"), ("name", "text"), ("amount", "numeric"), ("rate", "float8"), ("active", "bool"),
    ("created", "timestamptz"), ("day", "date"), ("doc", "jsonb"), ("ref", "uuid"), ("tags", "_text"),
    ("score", "int4"),
)
# one load run interpreted, one with generated code (warehouse.job.INTERPRETED_BELOW_RECORDS)
_REHEARSAL_EVENTS: Final = (200, 6_000)
_JVM_EXIT_SECONDS: Final = 600.0  # writing the archive as the JVM exits takes ~10 s on 2 cores


@dataclass(frozen=True)
class Prepared:
    packages: list[str]
    jars: Path | None  # the resolved jars' list; None: the cache is off
    archive: Path | None  # None: the cache is off, or no java was found
    written: bool  # False: an archive for this JVM and these jars was there already
    seconds: float


def _values(key: int) -> list[Any]:
    return [
        key, f"name {key}", f"{key}.25", key / 3, key % 2 == 0, "2024-01-02 03:04:05.123456+00",
        "1990-05-06", '{"plan": "pro"}', str(uuid.UUID(int=key)), '{red,"dark blue"}', key % 100,
    ]


def rehearsal_records(events: int, first_commit: int, *, changes: bool) -> list[tuple[bytes, bytes, int, int]]:
    """``events`` records of one table as Kafka rows (key, value, partition, offset): inserts
    of keys 1..events, or (``changes``) updates and deletes of them among the inserts."""
    names = [c for c, _ in _COLUMNS]
    types = [t for _, t in _COLUMNS]
    out = []
    for i in range(events):
        commit, seq = first_commit + (i // 100) * 0x100, i % 100
        key = i + 1
        common: dict[str, Any] = {
            "lsn": commit - 100 + seq, "commit_lsn": commit, "seq": seq, "xid": 1000 + i // 100,
            "table": _TABLE, "timestamp": "2024-01-02T03:04:05+00:00", "pk": ["id"],
        }
        identity: dict[str, list[Any]] = {"columns": ["id"], "types": ["int8"], "values": [key]}
        if changes and i % 7 == 0:
            value = encode_event(operation="delete", new=None, identity=identity, **common)
        else:
            update = changes and i % 3 == 0
            value = encode_event(
                operation="update" if update else "insert",
                new={"columns": names, "types": types, "values": _values(key)},
                identity=identity if update else None, **common,
            )
        out.append((event_key(commit, seq), value, 0, i))
    return out


def _rehearse(spark: Any, root: str) -> None:
    from warehouse.job import LoadResult, LoadSpec, interpreted_if_small, write_slice
    from warehouse.txn import Txn

    spec = LoadSpec(KafkaOptions(kafka_bootstrap="127.0.0.1:9"), "walbus-prepare", root)  # never contacted
    batch = 0
    for events in _REHEARSAL_EVENTS:
        for changes in (False, True):
            raw = spark.createDataFrame(
                rehearsal_records(events, (batch + 1) << 32, changes=changes),
                "key binary, value binary, partition int, offset long",
            )
            with interpreted_if_small(spark, events):
                write_slice(spark, spec, raw, Txn("walbus:prepare", batch, False), LoadResult())
            batch += 1


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="walbus-prepare-")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _resolve_jars(master: str, conf: dict[str, str]) -> list[str]:
    """Start a driver JVM that resolves the packages with Ivy; the jar files it got."""
    from warehouse.spark import build_session

    spark = build_session(master=master, app_name="walbus-prepare", conf=conf, use_driver_cache=False)
    try:
        return driver_cache.jar_files(spark.sparkContext.getConf().get("spark.jars", ""))
    finally:
        stop_jvm(spark, _JVM_EXIT_SECONDS)


def prepare(*, master: str = "local[2]", conf: dict[str, str] | None = None, force: bool = False) -> Prepared:
    """Resolve the connector jars and keep their list, and write the driver's class archive
    (each when the cache is on and it is not there yet for this JVM and these jars, or
    ``force``)."""
    from pyspark import SparkContext

    from warehouse.spark import base_conf, build_session, packages

    if SparkContext._gateway is not None:
        raise RuntimeError("walbus warehouse prepare needs a process without a running Spark driver")
    started = time.monotonic()
    conf = {"spark.ui.enabled": "false", "spark.driver.memory": "1g", **(conf or {})}
    settings = {**base_conf(), **conf}
    where = driver_cache.cache_dir()
    if where is not None and where.is_dir():
        driver_cache.remove_leftovers(where)
    kept = driver_cache.jars_path(settings) if driver_cache.resolved_jars(settings) is not None else None
    if force or kept is None:
        jars = _resolve_jars(master, conf)
        kept = driver_cache.save_jars(settings, jars) if jars else None
    stem = driver_cache.archive_for(settings, master)
    archive = driver_cache.find_archive(stem)
    write = stem is not None and (force or archive is None)
    if stem is not None and write:
        driver_cache.private_dir(stem.parent)
        temporary = stem.with_name(f"{stem.name}.{os.getpid()}.tmp")
        temporary.unlink(missing_ok=True)
        spark = build_session(master=master, app_name="walbus-prepare", conf=conf, shuffle_partitions=2,
                              archive_output=str(temporary))
        try:
            with _scratch() as root:
                _rehearse(spark, root)
        finally:
            status = stop_jvm(spark, _JVM_EXIT_SECONDS)
        if status != 0 or not temporary.is_file() or temporary.stat().st_size == 0:
            temporary.unlink(missing_ok=True)
            raise RuntimeError(f"the driver JVM exited with status {status} without writing {temporary}; see the Spark log")
        archive = driver_cache.archive_file(stem, temporary.stat().st_size)
        os.replace(temporary, archive)
        for older in stem.parent.glob(f"{stem.name}-*{driver_cache.SUFFIX}"):
            if older != archive:  # this JVM's earlier archive (--force)
                older.unlink(missing_ok=True)
        log.info("spark driver class archive written", extra={"archive": str(archive)})
    return Prepared(packages(), kept, archive, write, round(time.monotonic() - started, 1))
