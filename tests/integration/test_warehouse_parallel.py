"""Issue 19: one load writes many tables at once (driver threads on one session), and
`walbus warehouse sql --as-of-lsn` rebuilds tables as of a commit LSN from their history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.warehouse import Txn, kafka_options, produce_events, table_paths
from warehouse.cli import run_sql
from warehouse.job import LoadSpec, run_load
from warehouse.txn import applied_load

pytestmark = [pytest.mark.spark, pytest.mark.integration]

PK = ["id"]


def row(key: int, amount: int) -> dict[str, tuple[str, Any]]:
    return {"id": ("int4", key), "amount": ("int4", amount)}


def _keys(table: str, commit: int, first: int) -> list[bytes]:
    """Inserts of keys first..first+2, an update of the first, a delete of the second."""
    txn = Txn(commit)
    for key in range(first, first + 3):
        txn.insert(table, PK, row(key, key * 10))
    txn.update(table, PK, row(first, 1))
    txn.delete(table, PK, {"id": ("int4", first + 1)})
    return txn.events


def test_tables_written_at_once_each_get_exactly_their_events(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # the MERGE's load marker is a session setting: set on the shared session, it would tag
    # the other tables' commits made meanwhile, and Delta then skips their own writes
    tables = [f"s.t{i}" for i in range(6)]
    for load_id, commit in enumerate((0x1000, 0x9000)):
        events = [e for i, t in enumerate(tables) for e in _keys(t, commit + i * 0x100, 1 + load_id * 10)]
        produce_events(kafka_bootstrap, unique_name, events)
        result = run_load(spark, LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path), parallel_tables=4))
        assert result.batches == [load_id]
        for table in tables:
            paths = table_paths(tmp_path, unique_name, table)
            history = spark.read.format("delta").load(paths.history)
            assert history.count() == 5 * (load_id + 1), table
            live = spark.read.format("delta").load(paths.current).where("NOT _walbus_deleted")
            expected = {(k, v) for n in range(load_id + 1) for k, v in ((1 + n * 10, 1), (3 + n * 10, 30 + n * 100))}
            assert {(r["id"], r["amount"]) for r in live.collect()} == expected, table
            for path in (paths.history, paths.current):
                assert applied_load(spark, path, f"walbus:{unique_name}") == load_id, (table, path)


def test_as_of_lsn_rebuilds_the_table_from_history(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    table = "public.accounts"
    events = (
        Txn(0x1000).insert(table, PK, row(1, 10)).insert(table, PK, row(2, 20)).events
        + Txn(0x2000).update(table, PK, row(1, 11)).events
        + Txn(0x3000).update(table, PK, row(3, 20), identity={"id": ("int4", 2)}).events  # key 2 -> 3
        + Txn(0x4000).delete(table, PK, {"id": ("int4", 1)}).events
        + Txn(0x5000).truncate(table, PK).events
        + Txn(0x6000).insert(table, PK, row(4, 40)).events
    )
    produce_events(kafka_bootstrap, unique_name, events)
    run_load(spark, LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path)))

    def state(lsn: int | None) -> set[tuple[int, int]]:
        _, rows = run_sql(spark, str(tmp_path), unique_name, "SELECT id, amount FROM public_accounts", 100, lsn)
        return {(r["id"], r["amount"]) for r in rows}

    assert state(0x0FFF) == set()
    assert state(0x1000) == {(1, 10), (2, 20)}
    assert state(0x2FFF) == {(1, 11), (2, 20)}
    assert state(0x3000) == {(1, 11), (3, 20)}
    assert state(0x4000) == {(3, 20)}
    assert state(0x5000) == set()
    assert state(0x6000) == {(4, 40)} == state(None)
    # Past a Spark long (FFFFFFFF/FFFFFFFF, "the latest"): a bare Py4JError before (a fuzz).
    assert state(0x8000_0000_0000_0000) == state(0xFFFF_FFFF_FFFF_FFFF) == {(4, 40)}
    _, history = run_sql(spark, str(tmp_path), unique_name, "SELECT count(*) AS n FROM public_accounts_history", 1, 0x3000)
    assert history[0]["n"] == 4
    _, tombstones = run_sql(spark, str(tmp_path), unique_name,
                            "SELECT id FROM public_accounts_all WHERE _walbus_deleted ORDER BY id", 10, 0x4000)
    assert [r["id"] for r in tombstones] == [1, 2]


def test_stream_available_now_loads_like_the_batch_load_and_resumes_from_its_checkpoint(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    from warehouse.stream import start_stream, stream_app_id

    spec = LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path))
    # The third run has a checkpoint of its own, whose micro-batches count from 0 again: under
    # the topic's marker alone its first one was taken for a batch the tables had committed,
    # and its new events were skipped (a fuzz).
    for run, commit in enumerate((0x1000, 0x9000, 0xA000)):
        produce_events(kafka_bootstrap, unique_name, _keys("s.t", commit, 1 + run * 10))
        query = start_stream(spark, spec, checkpoint=str(tmp_path / "other") if run == 2 else None)
        query.awaitTermination()
        paths = table_paths(tmp_path, unique_name, "s.t")
        assert spark.read.format("delta").load(paths.history).count() == 5 * (run + 1)
        live = spark.read.format("delta").load(paths.current).where("NOT _walbus_deleted").collect()
        expected = {(k, v) for n in range(run + 1) for k, v in ((1 + n * 10, 1), (3 + n * 10, 30 + n * 100))}
        assert {(r["id"], r["amount"]) for r in live} == expected
        assert applied_load(spark, paths.history, stream_app_id(unique_name, str(query.id))) == (run if run < 2 else 0)


def test_columns_named_like_the_loads_own_names_and_an_lsn_as_the_cli_parses_it(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """A key column named ``a`` failed every load (AMBIGUOUS_REFERENCE: the latest action per
    key was a struct named ``a``), a column named ``t`` every point-in-time query (the last
    TRUNCATE was ``t``), and ``--as-of-lsn`` from the command line always failed: its Lsn
    reached Spark's lit() as the text X/Y."""
    from walbus.contract import Lsn

    table = "public.odd"
    pk = ["a"]

    def odd(a: int, t: str) -> dict[str, tuple[str, Any]]:
        return {"a": ("int4", a), "t": ("text", t), "s": ("text", t)}

    events = (
        Txn(0x1000).insert(table, pk, odd(1, "x")).insert(table, pk, odd(2, "y")).events
        + Txn(0x2000).update(table, pk, odd(1, "z")).events
        + Txn(0x3000).truncate(table, pk).events
        + Txn(0x4000).insert(table, pk, odd(3, "w")).events
    )
    produce_events(kafka_bootstrap, unique_name, events)
    assert run_load(spark, LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path))).events == 5

    def state(lsn: int | None) -> set[tuple[int, str]]:
        _, rows = run_sql(spark, str(tmp_path), unique_name, "SELECT a, t FROM public_odd", 100, lsn)
        return {(r["a"], r["t"]) for r in rows}

    assert state(None) == {(3, "w")}
    assert state(Lsn.parse("0/2000")) == {(1, "z"), (2, "y")}
    assert state(Lsn.parse("0/3000")) == set()
