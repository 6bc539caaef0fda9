"""The load log: which slice of the topic each load covers, and whether it completed.

Small JSON files in ``<warehouse>/<topic>/_walbus_loads/``, like the offset and commit logs
of Spark Structured Streaming's checkpoints (read and written on the driver through the
Hadoop FileSystem API, so any warehouse URI works and no Spark job is spent on them):

* ``<N>.planned.json``   written before load N touches any table: its fixed offset range;
* ``<N>.committed.json`` written after every table has committed load N (with a summary).

Each file is written to a temporary name and renamed, so it is either complete or absent.
Together with the idempotent, load-tagged writes of :mod:`warehouse.txn` this is a two-phase protocol:

* last load committed -> the next load starts at its end offsets;
* last load only planned (the job died) -> the next run replays load N with exactly the same
  offsets; tables that had committed load N skip it, the others write it. Then it continues
  with a new load.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from pyspark.sql import SparkSession

from warehouse.read import Offsets
from warehouse.txn import hadoop_path, jvm_class

_NAME = re.compile(r"(\d{20})\.(planned|committed)\.json")


@dataclass(frozen=True)
class Load:
    batch_id: int
    status: str  # planned | committed
    start: Offsets
    end: Offsets


def _fs(spark: SparkSession, path: str) -> tuple[Any, Any]:
    hpath = hadoop_path(spark, path)
    return hpath.getFileSystem(spark._jsparkSession.sessionState().newHadoopConf()), hpath


def _offsets(obj: dict[str, int]) -> Offsets:
    return {int(p): int(o) for p, o in obj.items()}


def last_load(spark: SparkSession, path: str) -> Load | None:
    fs, dir_path = _fs(spark, path)
    if not fs.exists(dir_path):
        return None
    latest: tuple[int, bool] | None = None  # (load id, committed): committed sorts last
    for status in fs.listStatus(dir_path):
        m = _NAME.fullmatch(status.getPath().getName())
        if m is None:
            continue
        key = (int(m.group(1)), m.group(2) == "committed")
        if latest is None or key > latest:
            latest = key
    if latest is None:
        return None
    state = "committed" if latest[1] else "planned"
    obj = orjson.loads(_read(spark, f"{path}/{latest[0]:020d}.{state}.json"))
    return Load(latest[0], state, _offsets(obj["start"]), _offsets(obj["end"]))


def _read(spark: SparkSession, path: str) -> bytes:
    fs, hpath = _fs(spark, path)
    stream = fs.open(hpath)
    try:
        data = jvm_class(spark, "org.apache.commons.io.IOUtils").toByteArray(stream)
        return bytes(data)
    finally:
        stream.close()


def record(spark: SparkSession, path: str, load: Load, summary: dict[str, Any] | None = None) -> None:
    body = orjson.dumps(
        {
            "batch_id": load.batch_id,
            "status": load.status,
            "start": {str(p): o for p, o in sorted(load.start.items())},
            "end": {str(p): o for p, o in sorted(load.end.items())},
            "at": dt.datetime.now(dt.UTC).isoformat(),
            "summary": summary,
        },
        option=orjson.OPT_INDENT_2,
    )
    fs, dir_path = _fs(spark, path)
    fs.mkdirs(dir_path)
    final = hadoop_path(spark, f"{path}/{load.batch_id:020d}.{load.status}.json")
    tmp = hadoop_path(spark, f"{path}/.{uuid.uuid4().hex}.tmp")
    out = fs.create(tmp, False)
    try:
        out.write(bytearray(body))
        out.hsync()
    finally:
        out.close()
    if not fs.rename(tmp, final):
        fs.delete(tmp, False)
        raise OSError(f"could not record load {load.batch_id} ({load.status}) at {final}")
