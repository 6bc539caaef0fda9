"""Loads of contract-v1 events from a real topic into Delta history and current tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.warehouse_helpers import Txn, kafka_options, produce
from warehouse import layout
from warehouse.job import LoadSpec, run_load

pytestmark = [pytest.mark.spark, pytest.mark.integration]

TX = "public.transactions"
TX_PK = ["transaction_id"]


def tx_row(tid: int, uid: int, amount: int) -> dict[str, tuple[str, Any]]:
    return {"transaction_id": ("int4", tid), "user_id": ("int4", uid), "amount": ("int4", amount)}


def load(spark: Any, bootstrap: str, topic: str, warehouse: Path, **kw: Any) -> Any:
    return run_load(spark, LoadSpec(kafka_options(bootstrap), topic, str(warehouse), **kw))


def history(spark: Any, warehouse: Path, topic: str, table: str = TX) -> list[Any]:
    path = layout.table_paths(str(warehouse), topic, table).history
    return spark.read.format("delta").load(path).orderBy("pg_commit_lsn", "pg_seq").collect()


def current(spark: Any, warehouse: Path, topic: str, table: str = TX, *, live: bool = True) -> list[Any]:
    path = layout.table_paths(str(warehouse), topic, table).current
    df = spark.read.format("delta").load(path)
    if live:
        df = df.where("NOT _walbus_deleted")
    return df.collect()


def test_pgkafka_transactions_example(spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    events = (
        Txn(0x1000, xid=501).insert(TX, TX_PK, tx_row(54441, 36036, 2000)).events
        + Txn(0x2000, xid=502).update(TX, TX_PK, tx_row(54441, 36036, 2500)).events
        + Txn(0x3000, xid=503).delete(TX, TX_PK, {"transaction_id": ("int4", 54441)}).events
    )
    produce(kafka_bootstrap, unique_name, events)
    result = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert result.events == 3
    assert result.tables[TX].history_rows == 3
    rows = history(spark, tmp_path, unique_name)
    assert [r["pg_operation"] for r in rows] == ["insert", "update", "delete"]
    assert [int(r["pg_lsn"]) for r in rows] == sorted(int(r["pg_lsn"]) for r in rows)
    assert [int(r["pg_commit_lsn"]) for r in rows] == [0x1000, 0x2000, 0x3000]
    assert [r["pg_txn_id"] for r in rows] == [501, 502, 503]
    assert all(r["pg_txn_timestamp"] is not None and r["pg_seq"] == 0 for r in rows)
    assert [r["amount"] for r in rows] == [2000, 2500, None]
    assert rows[2]["transaction_id"] == 54441  # the delete carries its identity
    assert current(spark, tmp_path, unique_name) == []
    tomb = current(spark, tmp_path, unique_name, live=False)
    assert len(tomb) == 1 and tomb[0]["_walbus_deleted"] and tomb[0]["pg_operation"] == "delete"
    print(result.lines())
