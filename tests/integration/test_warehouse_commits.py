"""What a load commits to each Delta table: its data, nothing more (issue 19).

A commit is a Delta snapshot update for every later reader and writer of the table, so a
load of a table that exists commits exactly one history append and one current MERGE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.warehouse import Txn, kafka_options, produce_events, table_paths
from warehouse.job import LoadSpec, run_load

pytestmark = [pytest.mark.spark, pytest.mark.integration]

TX = "public.transactions"
TX_PK = ["transaction_id"]


def _row(tid: int, amount: int) -> dict[str, tuple[str, Any]]:
    return {"transaction_id": ("int4", tid), "amount": ("int4", amount)}


def _operations(spark: Any, path: str, after: int) -> list[str]:
    from delta.tables import DeltaTable

    rows = DeltaTable.forPath(spark, path).history().where(f"version > {after}").orderBy("version").collect()
    return [r["operation"] for r in rows]


def _version(spark: Any, path: str) -> int:
    from delta.tables import DeltaTable

    return int(DeltaTable.forPath(spark, path).history(1).first()["version"])


def test_a_load_of_existing_tables_commits_its_data_only(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    spec = LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path))
    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(TX, TX_PK, _row(1, 10)).events)
    run_load(spark, spec)
    paths = table_paths(tmp_path, unique_name, TX)
    before = {p: _version(spark, p) for p in (paths.history, paths.current)}
    produce_events(
        kafka_bootstrap, unique_name,
        Txn(0x2000).update(TX, TX_PK, _row(1, 20)).insert(TX, TX_PK, _row(2, 30)).events,
    )
    second = run_load(spark, spec)
    assert second.tables[TX].history_rows == 2
    assert (second.tables[TX].inserted, second.tables[TX].updated) == (1, 1)
    # the current table's protocol (3, 7: deletion vectors) is above the (2, 5) walbus asks
    # for: that is no reason to set its properties again on every load
    assert _operations(spark, paths.history, before[paths.history]) == ["WRITE"]
    assert _operations(spark, paths.current, before[paths.current]) == ["MERGE"]
