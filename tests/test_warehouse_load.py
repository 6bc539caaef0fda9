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


def _versions(spark: Any, warehouse: Path, topic: str, table: str = TX) -> tuple[int, int]:
    from delta.tables import DeltaTable

    paths = layout.table_paths(str(warehouse), topic, table)
    return tuple(  # type: ignore[return-value]
        int(DeltaTable.forPath(spark, p).history(1).first()["version"]) for p in (paths.history, paths.current)
    )


def test_duplicates_and_repeated_loads_change_nothing(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    events = []
    for i in range(5):
        events += Txn(0x1000 + i * 0x100, xid=600 + i).insert(TX, TX_PK, tx_row(i, 7, 100 + i)).events
    events += Txn(0x2000).update(TX, TX_PK, tx_row(1, 7, 999)).delete(TX, TX_PK, {"transaction_id": ("int4", 2)}).events
    produce(kafka_bootstrap, unique_name, events + events)  # every message twice in one load
    first = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert first.events == 14 and first.tables[TX].history_rows == 7
    versions = _versions(spark, tmp_path, unique_name)
    again = load(spark, kafka_bootstrap, unique_name, tmp_path)  # nothing new: nothing written
    assert again.lines() == ["no new events"]
    assert _versions(spark, tmp_path, unique_name) == versions
    produce(kafka_bootstrap, unique_name, events)  # the same messages a third time, later
    third = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert third.tables[TX].history_rows == 0
    assert third.tables[TX].inserted == third.tables[TX].updated == 0
    rows = history(spark, tmp_path, unique_name)
    assert len(rows) == 7
    assert sorted((r["transaction_id"], r["amount"]) for r in current(spark, tmp_path, unique_name)) == [
        (0, 100), (1, 999), (3, 103), (4, 104)
    ]


def test_older_update_after_delete_stays_deleted(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    insert = Txn(0x1000).insert(TX, TX_PK, tx_row(1, 1, 10)).events
    older_update = Txn(0x2000).update(TX, TX_PK, tx_row(1, 1, 20)).events
    delete = Txn(0x3000).delete(TX, TX_PK, {"transaction_id": ("int4", 1)}).events
    # a key seen for the first time as a delete, then an older insert of it
    late_key_delete = Txn(0x3100).delete(TX, TX_PK, {"transaction_id": ("int4", 2)}).events
    late_key_insert = Txn(0x1100).insert(TX, TX_PK, tx_row(2, 2, 22)).events
    produce(kafka_bootstrap, unique_name, insert + delete + late_key_delete)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce(kafka_bootstrap, unique_name, older_update + late_key_insert)
    second = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert second.tables[TX].history_rows == 2
    assert current(spark, tmp_path, unique_name) == []
    tombs = {r["transaction_id"]: int(r["pg_commit_lsn"]) for r in current(spark, tmp_path, unique_name, live=False)}
    assert tombs == {1: 0x3000, 2: 0x3100}
    assert [int(r["pg_commit_lsn"]) for r in history(spark, tmp_path, unique_name)] == [
        0x1000, 0x1100, 0x2000, 0x3000, 0x3100
    ]
