"""The soak's warehouse check: prints, per table, its live current rows and history counts.

    python -m bench.soak_warehouse WAREHOUSE TOPIC TABLE [TABLE ...]

One JSON line per table: ``{"table", "rows": [live rows without metadata columns],
"history": rows in history, "history_positions": distinct (pg_commit_lsn, pg_seq)}``.
A table the warehouse does not hold yet gives ``rows: null``. One Spark session for all.
"""

from __future__ import annotations

import sys
from typing import Any

import orjson

from walbus.contract import split_table
from walbus.logs import setup_logging

METADATA_PREFIXES = ("pg_", "_walbus")


def _row(row: Any) -> dict[str, Any]:
    return {k: v for k, v in row.asDict().items() if not k.startswith(METADATA_PREFIXES)}


def main(warehouse: str, topic: str, tables: list[str]) -> None:
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from warehouse import layout
    from warehouse.frame import DELETED
    from warehouse.spark import build_session

    setup_logging("warning")
    spark = build_session(master="local[1]", conf={"spark.driver.memory": "1g"}, shuffle_partitions=2)
    try:
        for table in tables:
            paths = layout.table_paths(warehouse, topic, *split_table(table))
            out: dict[str, Any] = {"table": table, "rows": None, "history": 0, "history_positions": 0}
            if DeltaTable.isDeltaTable(spark, paths.history):
                history = spark.read.format("delta").load(paths.history)
                out["history"] = history.count()
                out["history_positions"] = history.select("pg_commit_lsn", "pg_seq").distinct().count()
            if DeltaTable.isDeltaTable(spark, paths.current):
                current = spark.read.format("delta").load(paths.current).where(~F.col(DELETED))
                out["rows"] = [_row(r) for r in current.collect()]
            print(orjson.dumps(out, default=str).decode(), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
