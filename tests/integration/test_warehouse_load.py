"""Loads of contract-v1 events from a real topic into Delta history and current tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.warehouse import Txn, kafka_options, produce_events, table_paths
from warehouse.job import LoadSpec, run_load

pytestmark = [pytest.mark.spark, pytest.mark.integration]

TX = "public.transactions"
TX_PK = ["transaction_id"]


def tx_row(tid: int, uid: int, amount: int) -> dict[str, tuple[str, Any]]:
    return {"transaction_id": ("int4", tid), "user_id": ("int4", uid), "amount": ("int4", amount)}


def load(spark: Any, bootstrap: str, topic: str, warehouse: Path, **kw: Any) -> Any:
    return run_load(spark, LoadSpec(kafka_options(bootstrap), topic, str(warehouse), **kw))


def history(spark: Any, warehouse: Path, topic: str, table: str = TX) -> list[Any]:
    path = table_paths(warehouse, topic, table).history
    return spark.read.format("delta").load(path).orderBy("pg_commit_lsn", "pg_seq").collect()


def current(spark: Any, warehouse: Path, topic: str, table: str = TX, *, live: bool = True) -> list[Any]:
    path = table_paths(warehouse, topic, table).current
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
    produce_events(kafka_bootstrap, unique_name, events)
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

    paths = table_paths(warehouse, topic, table)
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
    produce_events(kafka_bootstrap, unique_name, events + events)  # every message twice in one load
    first = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert first.events == 14 and first.tables[TX].history_rows == 7
    versions = _versions(spark, tmp_path, unique_name)
    again = load(spark, kafka_bootstrap, unique_name, tmp_path)  # nothing new: nothing written
    assert again.lines() == ["no new events"]
    assert _versions(spark, tmp_path, unique_name) == versions
    produce_events(kafka_bootstrap, unique_name, events)  # the same messages a third time, later
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
    produce_events(kafka_bootstrap, unique_name, insert + delete + late_key_delete)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, older_update + late_key_insert)
    second = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert second.tables[TX].history_rows == 2
    assert current(spark, tmp_path, unique_name) == []
    tombs = {r["transaction_id"]: int(r["pg_commit_lsn"]) for r in current(spark, tmp_path, unique_name, live=False)}
    assert tombs == {1: 0x3000, 2: 0x3100}
    assert [int(r["pg_commit_lsn"]) for r in history(spark, tmp_path, unique_name)] == [
        0x1000, 0x1100, 0x2000, 0x3000, 0x3100
    ]


def test_schema_evolution_no_pk_table_and_incompatible_change(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    from warehouse.job import LoadError

    t, pk = "app.items", ["id"]
    log_table = "app.log"  # no primary key: history only

    def item(i: int, **cols: tuple[str, Any]) -> dict[str, tuple[str, Any]]:
        return {"id": ("int4", i), **cols}

    first = (
        Txn(0x1000).insert(t, pk, item(1, a=("text", "x"), b=("int4", 1)))
        .insert(log_table, [], {"msg": ("text", "hello")}).events
    )
    produce_events(kafka_bootstrap, unique_name, first)
    r1 = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert "no primary key: history only" in r1.tables[log_table].line()
    assert not table_paths(tmp_path, unique_name, log_table).current or True
    from delta.tables import DeltaTable

    assert not DeltaTable.isDeltaTable(spark, table_paths(tmp_path, unique_name, log_table).current)
    # column c added, then b dropped
    second = (
        Txn(0x2000).insert(t, pk, item(2, a=("text", "y"), b=("int4", 2), c=("numeric", "1.50"))).events
        + Txn(0x3000).update(t, pk, item(1, a=("text", "x2"), c=("numeric", "7"))).events
        + Txn(0x3100).insert(log_table, [], {"msg": ("text", "again")}).events
    )
    produce_events(kafka_bootstrap, unique_name, second)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    hist = history(spark, tmp_path, unique_name, t)
    assert hist[0].asDict().keys() >= {"id", "a", "b", "c"}
    assert [(r["id"], r["a"], r["b"], None if r["c"] is None else str(r["c"].normalize())) for r in hist] == [
        (1, "x", 1, None), (2, "y", 2, "1.5"), (1, "x2", None, "7")
    ]
    cur = {r["id"]: (r["a"], r["b"], r["c"]) for r in current(spark, tmp_path, unique_name, t)}
    assert cur[1][:2] == ("x2", None) and cur[2][1] == 2
    assert len(history(spark, tmp_path, unique_name, log_table)) == 2
    # an incompatible change: a becomes an int8
    versions = _versions(spark, tmp_path, unique_name, t)
    produce_events(kafka_bootstrap, unique_name, Txn(0x4000).update(t, pk, item(2, a=("int8", 5), c=("numeric", "1"))).events)
    with pytest.raises(LoadError, match=r"'a' changed type from text \(string\) to int8 \(bigint\)"):
        load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert _versions(spark, tmp_path, unique_name, t) == versions
    # leaving the table out lets the load (and later ones) through
    r4 = load(spark, kafka_bootstrap, unique_name, tmp_path, tables=("app.log",))
    assert t not in r4.tables


def test_a_column_widened_in_postgresql_is_widened_in_the_tables(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # int -> bigint (the key too), real -> double, numeric(12,2) -> numeric(16,4) across loads
    # failed the table, and every load after replayed and failed until someone fixed it (a fuzz).
    from decimal import Decimal

    t, pk = "public.w", ["id"]

    def row(key: tuple[str, int], a: tuple[str, int], r: tuple[str, float], d: tuple[str, str]) -> dict[str, tuple[str, Any]]:
        return {"id": key, "a": a, "r": r, "d": d}

    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(t, pk, row(("int4", 1), ("int4", 10), ("float4", 1.5),
                                                                                ("numeric(12,2)", "1.25"))).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    big = 9_000_000_000
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).insert(t, pk, row(("int8", big), ("int8", big), ("float8", 0.1),
                                                                                ("numeric(16,4)", "123456789012.3456")))
                   .update(t, pk, row(("int8", 1), ("int8", 11), ("float8", 2.5), ("numeric(16,4)", "1.2345"))).events)
    second = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert second.tables[t].error is None
    paths = table_paths(tmp_path, unique_name, t)
    for path in (paths.history, paths.current):
        types = {f.name: f.dataType.simpleString() for f in spark.read.format("delta").load(path).schema.fields}
        assert {k: types[k] for k in ("id", "a", "r", "d")} == {"id": "bigint", "a": "bigint", "r": "double", "d": "decimal(16,4)"}
    assert types["_walbus_deleted"] == "boolean"
    hist_types = {f.name: f.dataType.simpleString() for f in spark.read.format("delta").load(paths.history).schema.fields}
    assert hist_types["_walbus_prev_id"] == "bigint"
    live = {r["id"]: (r["a"], r["r"], r["d"], r["pg_raw_values"]) for r in current(spark, tmp_path, unique_name, t)}
    assert live == {1: (11, 2.5, Decimal("1.2345"), {}), big: (big, 0.1, Decimal("123456789012.3456"), {})}
    # and the loads after go on
    produce_events(kafka_bootstrap, unique_name, Txn(0x3000).delete(t, pk, {"id": ("int8", big)}).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert [r["id"] for r in current(spark, tmp_path, unique_name, t)] == [1]


@pytest.mark.parametrize("generated_code", [False, True], ids=["interpreted", "generated-code"])
def test_types(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    generated_code: bool,
) -> None:
    """Every type, through both of Spark's ways to evaluate the load's expressions (a small load
    runs interpreted; a large one with generated code)."""
    import datetime as dt
    import math
    from decimal import Decimal

    from warehouse import job

    if generated_code:
        monkeypatch.setattr(job, "INTERPRETED_BELOW_RECORDS", 0)

    t, pk = "public.all_types", ["id"]
    row = {
        "id": ("int8", 9007199254740993),
        "small": ("int2", -32768),
        "num": ("numeric", "12345678901234567890.0123456789"),
        "huge": ("numeric", "123456789012345678901234567890123456789"),
        "nan_num": ("numeric", "NaN"),
        "f4": ("float4", 1.5),
        "f8_nan": ("float8", "NaN"),
        "f8_inf": ("float8", "-Infinity"),
        "flag": ("bool", True),
        "d": ("date", "2024-02-29"),
        "d_bc": ("date", "0044-03-15 BC"),
        "ts": ("timestamp", "2024-01-02 03:04:05.123456"),
        "tstz": ("timestamptz", "2024-01-02 03:04:05.5+02"),
        "ts_inf": ("timestamptz", "infinity"),
        "blob": ("bytea", "\\x00ff10"),
        "txt": ("text", "één ☃ \"q\""),
        "u": ("uuid", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        "j": ("jsonb", '{"a": [1, 2]}'),
        "mood": ("mood", "happy"),
        "ints": ("_int4", "{1,NULL,3}"),
        "texts": ("_text", '{"a,b","c\\"d",NULL,"NULL",plain}'),
        "bools": ("_bool", "{t,f}"),
        "grid": ("_int4", "{{1,2},{3,4}}"),
        "odd name": ("text", "spaces ok"),
        "nothing": ("text", None),
    }
    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(t, pk, row).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    (h,) = history(spark, tmp_path, unique_name, t)
    assert h["id"] == 9007199254740993 and h["small"] == -32768
    assert h["num"] == Decimal("12345678901234567890.0123456789")
    assert h["huge"] is None and h["nan_num"] is None
    assert h["f4"] == 1.5 and math.isnan(h["f8_nan"]) and h["f8_inf"] == -math.inf
    assert h["flag"] is True and h["d"] == dt.date(2024, 2, 29) and h["d_bc"] is None
    assert h["ts"] == dt.datetime(2024, 1, 2, 3, 4, 5, 123456)
    assert h["tstz"] == dt.datetime(2024, 1, 2, 1, 4, 5, 500000)  # UTC
    assert h["ts_inf"] is None
    assert bytes(h["blob"]) == b"\x00\xff\x10"
    assert h["txt"] == "één ☃ \"q\"" and h["mood"] == "happy" and h["j"] == '{"a": [1, 2]}'
    assert h["ints"] == [1, None, 3]
    assert h["texts"] == ["a,b", 'c"d', None, "NULL", "plain"]
    assert h["bools"] == [True, False]
    assert h["grid"] is None
    assert h["odd name"] == "spaces ok" and h["nothing"] is None
    assert h["pg_raw_values"] == {
        "huge": "123456789012345678901234567890123456789",
        "nan_num": "NaN",
        "d_bc": "0044-03-15 BC",
        "ts_inf": "infinity",
        "grid": "{{1,2},{3,4}}",
    }
    (c,) = current(spark, tmp_path, unique_name, t)
    assert c["pg_raw_values"] == h["pg_raw_values"] and c["texts"] == h["texts"]


def test_unchanged_toast_values_are_carried_and_truncate(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    t, pk = "public.docs", ["id"]
    big = "x" * 5000

    def doc(i: int, title: str, body: str | None = None) -> dict[str, tuple[str, Any]]:
        r = {"id": ("int4", i), "title": ("text", title)}
        if body is not None:
            r["body"] = ("text", body)
        return r

    first = (
        Txn(0x1000).insert(t, pk, doc(1, "a", big + "1")).insert(t, pk, doc(2, "b", big + "2"))
        .insert(t, pk, doc(3, "c", big + "3")).events
        # same load: unchanged carried from the insert above, twice in a row
        + Txn(0x2000).update(t, pk, doc(1, "a2"), unchanged=["body"]).update(t, pk, doc(1, "a3"), unchanged=["body"]).events
        # key change with the body unchanged: carried from the old key
        + Txn(0x2100).update(t, pk, doc(20, "b2"), identity={"id": ("int4", 2)}, unchanged=["body"]).events
    )
    produce_events(kafka_bootstrap, unique_name, first)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    # next load: the previous version is in the current table
    produce_events(kafka_bootstrap, unique_name, Txn(0x3000).update(t, pk, doc(3, "c2"), unchanged=["body"]).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    cur = {r["id"]: (r["title"], r["body"]) for r in current(spark, tmp_path, unique_name, t)}
    assert cur == {1: ("a3", big + "1"), 20: ("b2", big + "2"), 3: ("c2", big + "3")}
    hist = history(spark, tmp_path, unique_name, t)
    assert [r["body"] for r in hist if r["pg_operation"] == "update"] == [big + "1", big + "1", big + "2", big + "3"]
    assert hist[-1]["pg_unchanged"] == ["body"]
    # TRUNCATE, then an insert after it in the same load; then a late event older than it
    produce_events(
        kafka_bootstrap, unique_name,
        Txn(0x4000).truncate(t, pk).insert(t, pk, doc(5, "e", "new")).events,
    )
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, Txn(0x3500).insert(t, pk, doc(9, "late", "x")).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert {r["id"]: r["title"] for r in current(spark, tmp_path, unique_name, t)} == {5: "e"}


def test_an_unchanged_toast_value_of_a_wide_table_loads(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # Two events of a 24-column table, an update leaving its TOASTed column out: planning the
    # fill ran out of the driver's memory (16 columns and more; a types fuzz) and the table
    # never loaded.
    t, pk = "public.wide", ["k"]
    others = [f"c{i}" for i in range(22)]
    row = {"k": ("text", "a"), "big": ("text", "B" * 3000), **{c: ("text", "x") for c in others}}
    changed = {"k": ("text", "a"), **{c: ("text", "y") for c in others}}
    produce_events(kafka_bootstrap, unique_name,
                   Txn(0x1000).insert(t, pk, row).events + Txn(0x2000).update(t, pk, changed, unchanged=["big"]).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    [only] = current(spark, tmp_path, unique_name, t)
    assert only["big"] == "B" * 3000 and only["c21"] == "y"


def test_an_unchanged_table_gets_no_commit_from_ensure_table(spark: Any, tmp_path: Path) -> None:
    """ensure_table on a table that already has the planned columns and properties commits
    nothing. A current table's deletion vectors raise its protocol to reader 3 / writer 7, more
    than the 2 / 5 walbus asks for, and that difference made every load commit a
    SET TBLPROPERTIES to each current table."""
    from warehouse.current import CURRENT_EXTRA_FIELDS, CURRENT_PROPERTIES
    from warehouse.frame import META_FIELDS
    from warehouse.job import HISTORY_PROPERTIES
    from warehouse.schema import create_table, ensure_table, plan
    from warehouse.txn import Txn as LoadTxn
    from warehouse.txn import _jvm_snapshot

    path = str(tmp_path / "current")
    schema_plan = plan(TX, None, [("transaction_id", "int4")], reserved=set(), numeric_scale=10)
    props = {**HISTORY_PROPERTIES, **CURRENT_PROPERTIES, "walbus.primaryKey": "transaction_id"}
    new = ensure_table(spark, path, [*META_FIELDS, *CURRENT_EXTRA_FIELDS], schema_plan, props)
    assert new is not None  # no table yet: its first write creates it
    create_table(spark, path, spark.createDataFrame([], new.schema), new, LoadTxn("walbus:test", 0))
    versions = []
    for _ in range(3):
        assert ensure_table(spark, path, [*META_FIELDS, *CURRENT_EXTRA_FIELDS], schema_plan, props) is None
        versions.append(int(_jvm_snapshot(spark, path).version()))
    assert versions == [0, 0, 0]


def test_the_history_high_water_mark_follows_appends_and_foreign_commits(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """Each walbus append notes the history's highest commit LSN in its commit; a load that
    starts past it skips the de-duplication read. Commits that add no rows keep the mark; a
    foreign commit that adds rows makes it unknown, and the data decides (duplicates still go)."""
    from pyspark.sql import functions as F

    from warehouse.txn import HighWater, history_high_water

    path = table_paths(tmp_path, unique_name, TX).history
    first = Txn(0x1000, xid=700).insert(TX, TX_PK, tx_row(1, 7, 100)).events
    produce_events(kafka_bootstrap, unique_name, first)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert history_high_water(spark, path) == HighWater(True, 0x1000)
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('walbus.test' = 'x')")  # no rows added
    assert history_high_water(spark, path) == HighWater(True, 0x1000)
    second = Txn(0x2000, xid=701).insert(TX, TX_PK, tx_row(2, 7, 200)).events
    produce_events(kafka_bootstrap, unique_name, second)
    load(spark, kafka_bootstrap, unique_name, tmp_path)  # past the mark: no de-duplication read
    assert history_high_water(spark, path) == HighWater(True, 0x2000)
    # A foreign append of a later row (not walbus's): the log no longer knows the highest LSN.
    later = spark.read.format("delta").load(path).where("transaction_id = 2")
    later.withColumn("pg_commit_lsn", F.lit(0x3000).cast("decimal(20,0)")).write.format("delta").mode("append").save(path)
    assert history_high_water(spark, path) == HighWater(False)
    # The second transaction and a new one again: the data says 0x3000 is there already, so
    # the re-sent one is found; the new one is written and the mark is known again.
    third = Txn(0x3800, xid=702).insert(TX, TX_PK, tx_row(3, 7, 300)).events
    produce_events(kafka_bootstrap, unique_name, second + third)
    result = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert result.tables[TX].history_rows == 1
    assert history_high_water(spark, path) == HighWater(True, 0x3800)
    assert [int(r["pg_commit_lsn"]) for r in history(spark, tmp_path, unique_name)] == [0x1000, 0x2000, 0x3000, 0x3800]


def _current_operation(spark: Any, warehouse: Path, topic: str) -> str:
    """The operation of the current table's latest data commit (a TRUNCATE's property commit
    looked through)."""
    from warehouse.txn import _recent_commits

    for _, actions in _recent_commits(spark, table_paths(warehouse, topic, TX).current):
        (info,) = [a["commitInfo"] for a in actions if "commitInfo" in a]
        if info["operation"] != "SET TBLPROPERTIES":
            return str(info["operation"])
    raise AssertionError("no data commit")


def test_a_load_of_keys_past_the_current_tables_highest_appends_instead_of_merging(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """With an integer first key, each write notes the current table's highest key in its
    commit; a load whose keys all lie past it (an insert-only load of a serial key) cannot
    match a row and appends. Anything else MERGEs: a key at or below the mark (an update, a
    key-changing update's tombstone), and after a foreign commit the data gives the mark."""
    from pyspark.sql import functions as F

    from warehouse.current import KEY_HIGH_WATER_KEY
    from warehouse.txn import HighWater, high_water, table_version

    path = table_paths(tmp_path, unique_name, TX).current

    def load_events(*txns: Any) -> Any:
        produce_events(kafka_bootstrap, unique_name, [e for t in txns for e in t.events])
        return load(spark, kafka_bootstrap, unique_name, tmp_path).tables[TX]

    def state() -> list[tuple[int, int, bool]]:
        return sorted((r["transaction_id"], r["amount"], r["_walbus_deleted"])
                      for r in current(spark, tmp_path, unique_name, live=False))

    def mark() -> HighWater:
        return high_water(spark, path, KEY_HIGH_WATER_KEY)

    # the first load creates the table with its rows: one commit
    load_events(Txn(0x1000).insert(TX, TX_PK, tx_row(1, 1, 10)).insert(TX, TX_PK, tx_row(3, 1, 30)))
    assert (_current_operation(spark, tmp_path, unique_name), mark()) == ("CREATE TABLE AS SELECT", HighWater(True, 3))
    assert table_version(spark, path) == 0
    # inserts past the mark, and a delete of a key never seen (a tombstone): appended
    done = load_events(Txn(0x2000).insert(TX, TX_PK, tx_row(5, 1, 50)).delete(TX, TX_PK, {"transaction_id": ("int4", 4)}))
    assert (done.inserted, done.updated, done.deleted) == (2, 0, 1)
    assert (_current_operation(spark, tmp_path, unique_name), mark()) == ("WRITE", HighWater(True, 5))
    # an insert past the mark beside an update below it: merged
    done = load_events(Txn(0x3000).insert(TX, TX_PK, tx_row(7, 1, 70)).update(TX, TX_PK, tx_row(1, 1, 11)))
    assert (done.inserted, done.updated) == (1, 1)
    assert (_current_operation(spark, tmp_path, unique_name), mark()) == ("MERGE", HighWater(True, 7))
    # a key moved past the mark tombstones its old key, below it: merged
    load_events(Txn(0x4000).update(TX, TX_PK, tx_row(9, 1, 90), identity={"transaction_id": ("int4", 3)}))
    assert (_current_operation(spark, tmp_path, unique_name), mark()) == ("MERGE", HighWater(True, 9))
    assert state() == [(1, 11, False), (3, 30, True), (4, None, True), (5, 50, False), (7, 70, False), (9, 90, False)]
    # Another writer's row past the mark: the log no longer knows the highest key, the data
    # does, so a load of key 20 (below that row's key 100) is merged, and an older event for
    # key 100 does not replace it.
    row = spark.read.format("delta").load(path).where("transaction_id = 9")
    row.withColumn("transaction_id", F.lit(100)).write.format("delta").mode("append").save(path)
    assert mark() == HighWater(False)
    load_events(Txn(0x5000).insert(TX, TX_PK, tx_row(20, 1, 200)), Txn(0x3500).insert(TX, TX_PK, tx_row(100, 1, -1)))
    assert (_current_operation(spark, tmp_path, unique_name), mark()) == ("MERGE", HighWater(True, 100))
    # a TRUNCATE and an insert past the mark: appended; the TRUNCATE's commits keep the mark
    done = load_events(Txn(0x6000).truncate(TX, TX_PK), Txn(0x6100).insert(TX, TX_PK, tx_row(101, 1, 1010)))
    assert (done.inserted, done.updated) == (1, 0)
    assert mark() == HighWater(True, 101)
    assert [(k, a) for k, a, deleted in state() if not deleted] == [(101, 1010)]
    assert len(state()) == 9


def test_a_commit_file_is_read_in_one_call_whole_or_cut_at_a_line(spark: Any, tmp_path: Path) -> None:
    """The log reads take a commit file in one py4j call: all its actions; a prefix of whole
    lines under a byte limit; or, asked for the whole file, a ValueError past the limit (the
    caller then lets Delta decide). The properties come from the snapshot's own JSON."""
    import orjson

    from warehouse.txn import _commit_lines, jvm_class, table_configuration

    path = str(tmp_path / "t")
    spark.range(3).write.format("delta").option("delta.appendOnly", "true").save(path)
    lines = (tmp_path / "t" / "_delta_log" / f"{0:020d}.json").read_bytes().splitlines()
    assert len(lines) >= 3
    assert list(_commit_lines(spark, path, 0)) == [orjson.loads(line) for line in lines]
    two = len(lines[0]) + 1 + len(lines[1]) + 1
    assert list(_commit_lines(spark, path, 0, two + 3)) == [orjson.loads(line) for line in lines[:2]]
    assert list(_commit_lines(spark, path, 0, two - 1)) == [orjson.loads(lines[0])]
    with pytest.raises(ValueError, match="larger than"):
        list(_commit_lines(spark, path, 0, two, whole=True))
    props = table_configuration(spark, path)
    shown = {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES delta.`{path}`").collect()}
    assert props["delta.appendOnly"] == "true"
    assert {k: props[k] for k in ("delta.appendOnly", "delta.minReaderVersion", "delta.minWriterVersion")} == {
        k: shown[k] for k in ("delta.appendOnly", "delta.minReaderVersion", "delta.minWriterVersion")
    }
    assert jvm_class(spark, "org.apache.hadoop.fs.Path") is jvm_class(spark, "org.apache.hadoop.fs.Path")


def _commit_actions(spark: Any, path: str) -> list[dict[str, Any]]:
    """The actions of a Delta table's latest commit."""
    from warehouse.txn import _recent_commits

    return next(_recent_commits(spark, path))[1]


def test_each_commit_names_its_load_without_delta_transaction_markers(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """A Delta transaction marker (txnAppId) made Delta compute the table's state at every
    write, three Spark jobs (~1.4 s of a small table's load): the history append, the current
    table's first append and its MERGE now carry the load in their userMetadata instead, and
    that is what a replay reads back (applied_load); a table an older walbus tagged with
    Delta's marker is still read right."""
    import orjson

    from warehouse.txn import LOAD_KEY, applied_load

    app = f"walbus:{unique_name}"
    paths = table_paths(tmp_path, unique_name, TX)
    for load_id, commit in enumerate((0x1000, 0x2000)):  # an append, then a MERGE into current
        produce_events(kafka_bootstrap, unique_name, Txn(commit).insert(TX, TX_PK, tx_row(load_id, 1, 1)).events)
        load(spark, kafka_bootstrap, unique_name, tmp_path)
        for path in (paths.history, paths.current):
            actions = _commit_actions(spark, path)
            assert not [a for a in actions if "txn" in a], path
            (info,) = [a["commitInfo"] for a in actions if "commitInfo" in a]
            assert orjson.loads(info["userMetadata"])[LOAD_KEY] == [app, load_id], info
            assert applied_load(spark, path, app) == load_id
            assert applied_load(spark, path, "walbus:another-topic") == -1
    old = str(tmp_path / "older")
    spark.range(3).write.format("delta").option("txnAppId", app).option("txnVersion", 7).save(old)
    spark.range(3).write.format("delta").mode("append").save(old)  # a commit of no load after it
    assert applied_load(spark, old, app) == 7


def test_a_load_written_twice_leaves_the_tables_as_once(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """What makes a replayed load exactly-once whether or not a table's marker is found: its
    history append leaves out the events the table holds, its MERGE replaces rows only with
    strictly later events. The slice is written twice as a replay that finds no marker would."""
    from warehouse.job import LoadResult, LoadSpec, write_slice
    from warehouse.read import read_slice, topic_bounds
    from warehouse.txn import Txn as LoadTxn

    events = []
    for i in range(4):
        events += Txn(0x1000 + i * 0x100).insert(TX, TX_PK, tx_row(i, 1, 10 + i)).events
    events += Txn(0x2000).update(TX, TX_PK, tx_row(1, 1, 99)).delete(TX, TX_PK, {"transaction_id": ("int4", 2)}).events
    events += Txn(0x2100).update(TX, TX_PK, tx_row(5, 1, 50), identity={"transaction_id": ("int4", 3)}).events
    events += Txn(0x2200).truncate(TX, TX_PK).events + Txn(0x2300).insert(TX, TX_PK, tx_row(7, 1, 70)).events
    produce_events(kafka_bootstrap, unique_name, events)
    spec = LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path))
    bounds = topic_bounds(spec.kafka, unique_name)
    states = []
    for _ in range(2):
        raw = read_slice(spark, spec.kafka, unique_name, dict(bounds.earliest), dict(bounds.latest))
        write_slice(spark, spec, raw, LoadTxn(f"walbus:{unique_name}", 0), LoadResult())
        states.append((
            [(int(r["pg_commit_lsn"]), r["pg_seq"], r["pg_operation"]) for r in history(spark, tmp_path, unique_name)],
            sorted((r["transaction_id"], r["amount"], r["_walbus_deleted"], int(r["pg_commit_lsn"]))
                   for r in current(spark, tmp_path, unique_name, live=False)),
        ))
    assert states[1] == states[0]
    assert len(states[0][0]) == len(events)
    assert [(k, a) for k, a, deleted, _ in states[0][1] if not deleted] == [(7, 70)]


def test_a_new_tables_first_write_creates_it_and_files_of_one_that_died_are_left_out(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """A table's first write creates it (CREATE TABLE AS SELECT: one commit, with walbus'
    properties and the load's name). A first write that died before its commit leaves data
    files in a directory that is no Delta table, where a CTAS refuses to go: the load appends
    there instead (the files are in no commit, so not in the table) and sets the properties."""
    import orjson

    from warehouse.schema import PG_TYPES_PROPERTY, PRIMARY_KEY_PROPERTY, table_properties
    from warehouse.txn import LOAD_KEY, applied_load, table_version

    other = "public.other"
    paths = table_paths(tmp_path, unique_name, TX)
    died = table_paths(tmp_path, unique_name, other)
    for path in (died.history, died.current):  # a write that died: data files, no _delta_log
        spark.range(5).selectExpr("id AS transaction_id").write.parquet(path)
        (Path(path) / "_SUCCESS").unlink()
    events = Txn(0x1000).insert(TX, TX_PK, tx_row(1, 1, 10)).insert(other, TX_PK, tx_row(2, 1, 20)).events
    produce_events(kafka_bootstrap, unique_name, events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    app = f"walbus:{unique_name}"
    for table, tables in ((TX, paths), (other, died)):
        for path in (tables.history, tables.current):
            props = table_properties(spark, path)
            assert props.get(PRIMARY_KEY_PROPERTY) == ("transaction_id" if path == tables.current else None), path
            assert orjson.loads(props[PG_TYPES_PROPERTY]) == {c: "int4" for c in ("transaction_id", "user_id", "amount")}
            assert props["delta.columnMapping.mode"] == "name"
            assert applied_load(spark, path, app) == 0
            rows = spark.read.format("delta").load(path).collect()
            assert [(r["transaction_id"], r["amount"]) for r in rows] == [(1, 10) if table == TX else (2, 20)], path
        assert [table_version(spark, p) for p in (tables.history, tables.current)] == ([0, 0] if table == TX else [1, 1])
        info = _commit_actions(spark, tables.history)
        assert any(orjson.loads(a["commitInfo"]["userMetadata"])[LOAD_KEY] == [app, 0] for a in info if "commitInfo" in a)
    # the next load finds ordinary tables: an update MERGEs
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).update(other, TX_PK, tx_row(2, 1, 21)).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert [(r["transaction_id"], r["amount"]) for r in current(spark, tmp_path, unique_name, other)] == [(2, 21)]


@pytest.mark.parametrize("copy_on_write_below", [64 << 20, 0], ids=["rewrite", "deletion-vectors"])
def test_a_small_current_table_is_merged_by_rewriting_its_files(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    copy_on_write_below: int,
) -> None:
    """Below COPY_ON_WRITE_BELOW_BYTES a MERGE rewrites the files it touches (no deletion
    vector: their extra jobs cost more than rewriting a small file); above it, deletion vectors.
    Either way the same rows, tombstones and LSN guard."""
    from warehouse import current as current_module

    monkeypatch.setattr(current_module, "COPY_ON_WRITE_BELOW_BYTES", copy_on_write_below)
    first = []
    for i in range(6):
        first += Txn(0x1000 + i * 0x100).insert(TX, TX_PK, tx_row(i, 1, 10 * i)).events
    produce_events(kafka_bootstrap, unique_name, first)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    later = (
        Txn(0x2000).update(TX, TX_PK, tx_row(1, 1, 111)).delete(TX, TX_PK, {"transaction_id": ("int4", 2)}).events
        + Txn(0x2100).insert(TX, TX_PK, tx_row(9, 1, 90)).events
        + Txn(0x0800).update(TX, TX_PK, tx_row(3, 1, -1)).events  # older than the row: ignored
    )
    produce_events(kafka_bootstrap, unique_name, later)
    result = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert (result.tables[TX].inserted, result.tables[TX].updated) == (1, 2)
    merge = _commit_actions(spark, table_paths(tmp_path, unique_name, TX).current)
    assert any(a.get("commitInfo", {}).get("operation") == "MERGE" for a in merge)
    vectors = [a["add"] for a in merge if "add" in a and a["add"].get("deletionVector")]
    assert bool(vectors) == (copy_on_write_below == 0)
    assert sorted((r["transaction_id"], r["amount"]) for r in current(spark, tmp_path, unique_name)) == [
        (0, 0), (1, 111), (3, 30), (4, 40), (5, 50), (9, 90)
    ]
    tombs = [r["transaction_id"] for r in current(spark, tmp_path, unique_name, live=False) if r["_walbus_deleted"]]
    assert tombs == [2]


@pytest.mark.parametrize("one_file_rows", [200_000, 0], ids=["one-file", "range-partitioned"])
def test_a_small_history_append_is_one_file_in_lsn_order(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    one_file_rows: int,
) -> None:
    """A table's load of at most ONE_TASK_ROWS rows is one sorted file (no range sampling);
    larger ones are range-partitioned. Either way each file's rows are in (commit LSN, seq) order."""
    from warehouse import frame

    monkeypatch.setattr(frame, "ONE_TASK_ROWS", one_file_rows)
    events = []
    for i in range(40):  # produced out of LSN order, across 4 partitions
        events += Txn(0x9000 - i * 0x100).insert(TX, TX_PK, tx_row(i, 1, i)).insert(TX, TX_PK, tx_row(100 + i, 1, i)).events
    produce_events(kafka_bootstrap, unique_name, events, partitions=4)
    assert load(spark, kafka_bootstrap, unique_name, tmp_path).tables[TX].history_rows == 80
    path = table_paths(tmp_path, unique_name, TX).history
    files = [a["add"]["path"] for a in _commit_actions(spark, path) if "add" in a]
    if one_file_rows:
        assert len(files) == 1
    import orjson

    from warehouse.txn import _commit_lines

    schema = next(a["metaData"]["schemaString"] for a in _commit_lines(spark, path, 0) if "metaData" in a)
    fields = {f["name"]: f["metadata"].get("delta.columnMapping.physicalName", f["name"])
              for f in orjson.loads(schema)["fields"]}
    found = []
    for f in files:  # each file read alone, in the order it holds its rows (history uses column mapping)
        rows = spark.read.parquet(f"{path}/{f}").select(fields["pg_commit_lsn"], fields["pg_seq"]).collect()
        in_file = [(int(r[0]), int(r[1])) for r in rows]
        assert in_file == sorted(in_file)
        found += in_file
    assert sorted(found) == sorted((0x9000 - i * 0x100, s) for i in range(40) for s in (0, 1))


def _history_files_positions(spark: Any, path: str) -> list[list[tuple[int, int]]]:
    """Each data file of a history table's latest commit: its rows' positions, in file order."""
    import orjson

    from warehouse.txn import _commit_lines

    schema = next(a["metaData"]["schemaString"] for a in _commit_lines(spark, path, 0) if "metaData" in a)
    fields = {f["name"]: f["metadata"].get("delta.columnMapping.physicalName", f["name"])
              for f in orjson.loads(schema)["fields"]}
    out = []
    for f in (a["add"]["path"] for a in _commit_actions(spark, path) if "add" in a):
        rows = spark.read.parquet(f"{path}/{f}").select(fields["pg_commit_lsn"], fields["pg_seq"]).collect()
        out.append([(int(r[0]), int(r[1])) for r in rows])
    return out


def test_a_load_in_commit_order_writes_its_history_files_side_by_side_and_a_resent_one_is_deduplicated(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slice whose positions rise through the topic holds each once: its history append
    skips the de-duplication and writes a sorted file per core's share, side by side. A slice
    that holds a transaction twice (re-sent, later in the topic) is de-duplicated as before."""
    from warehouse import frame

    monkeypatch.setattr(frame, "FILE_ROWS", 10)
    # several Arrow batches a task: the decoder's order marks carry from batch to batch
    assert spark.conf.get("spark.sql.execution.arrow.maxBytesPerBatch") == str(16 << 20)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "7")
    try:
        _side_by_side(spark, kafka_bootstrap, unique_name, tmp_path)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")


def _side_by_side(spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    events = []
    for i in range(30):
        events += Txn(0x1000 + i * 0x100).insert(TX, TX_PK, tx_row(i, 1, i)).insert(TX, TX_PK, tx_row(100 + i, 1, i)).events
    produce_events(kafka_bootstrap, unique_name, events)
    assert load(spark, kafka_bootstrap, unique_name, tmp_path).tables[TX].history_rows == 60
    path = table_paths(tmp_path, unique_name, TX).history
    files = sorted(_history_files_positions(spark, path))
    assert len(files) == spark.sparkContext.defaultParallelism == 2
    assert all(f == sorted(f) for f in files)
    assert files[0][-1] < files[1][0]  # the files' ranges do not overlap
    assert sorted(p for f in files for p in f) == sorted((0x1000 + i * 0x100, s) for i in range(30) for s in (0, 1))

    # the next 20 transactions twice: the slice's two tasks each rise, but the second one's
    # first position is not past the first one's last
    more = []
    for i in range(30, 50):
        more += Txn(0x1000 + i * 0x100).insert(TX, TX_PK, tx_row(i, 1, i)).insert(TX, TX_PK, tx_row(100 + i, 1, i)).events
    produce_events(kafka_bootstrap, unique_name, more + more)
    again = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert again.events == 80 and again.tables[TX].history_rows == 40
    found = [p for f in _history_files_positions(spark, path) for p in f]
    assert sorted(found) == sorted((0x1000 + i * 0x100, s) for i in range(30, 50) for s in (0, 1))
    assert len(history(spark, tmp_path, unique_name)) == 100


def test_a_small_load_runs_without_generated_code_and_puts_the_settings_back(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most INTERPRETED_BELOW_RECORDS records: the load's queries run interpreted (compiling
    generated code costs more than it saves on a few rows), the child session of a MERGE or a
    table's creation too; the
    session's own settings are back afterwards. A larger load keeps generated code."""
    from warehouse import job
    from warehouse.txn import Txn as LoadTxn

    seen: list[tuple[str, str]] = []
    merged: list[str] = []
    write_slice, tagged_session = job.write_slice, LoadTxn.tagged_session

    def watching(spark_: Any, *args: Any) -> None:
        seen.append((spark_.conf.get("spark.sql.codegen.factoryMode"), spark_.conf.get("spark.sql.codegen.wholeStage")))
        write_slice(spark_, *args)

    def watching_merge(self: Any, spark_: Any, extra: Any = None) -> Any:
        session = tagged_session(self, spark_, extra)
        merged.append(session.conf.get("spark.sql.codegen.factoryMode"))
        return session

    monkeypatch.setattr(job, "write_slice", watching)
    monkeypatch.setattr(LoadTxn, "tagged_session", watching_merge)
    spark.conf.set("spark.sql.codegen.wholeStage", "true")
    loads = [
        (job.INTERPRETED_BELOW_RECORDS, [e for i in range(3) for e in Txn(0x1000 + i).insert(TX, TX_PK, tx_row(i, 1, i)).events]),
        (job.INTERPRETED_BELOW_RECORDS, Txn(0x2000).update(TX, TX_PK, tx_row(1, 1, 10)).events),  # a MERGE
        (2, Txn(0x3000).update(TX, TX_PK, tx_row(2, 1, 20)).events * 3),  # 3 records: above 2
    ]
    for threshold, events in loads:
        monkeypatch.setattr(job, "INTERPRETED_BELOW_RECORDS", threshold)
        produce_events(kafka_bootstrap, unique_name, events)
        load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert seen == [("NO_CODEGEN", "false"), ("NO_CODEGEN", "false"), ("FALLBACK", "true")]
    # the first load's two tables are created in a tagged session too; then one MERGE a load
    assert merged == ["NO_CODEGEN", "NO_CODEGEN", "NO_CODEGEN", "FALLBACK"]
    assert spark.conf.get("spark.sql.codegen.factoryMode") == "FALLBACK"
    assert spark.conf.get("spark.sql.codegen.wholeStage") == "true"
    assert sorted((r["transaction_id"], r["amount"]) for r in current(spark, tmp_path, unique_name)) == [
        (0, 0), (1, 10), (2, 20)
    ]


def test_typed_rows_builds_each_events_maps_once(spark: Any) -> None:
    """Each value's text is read by its conversion, its exactness check and pg_raw_values;
    written as one projection, the optimizer copied the row's maps into every one of those
    reads (3 columns: 32 map builds a row; a 16-column table's history phase spent most of
    its CPU there)."""
    from decimal import Decimal

    from warehouse.frame import typed_rows
    from warehouse.schema import SourceColumn
    from warehouse.types import spark_type

    schema = (
        "lsn decimal(20,0), commit_lsn decimal(20,0), seq bigint, xid bigint, operation string, timestamp string, "
        "columns array<string>, `values` array<string>, "
        "identity struct<columns: array<string>, types: array<string>, `values`: array<string>>, unchanged array<string>"
    )
    events = spark.createDataFrame([
        (Decimal(1), Decimal(2), 0, 7, "insert", "2024-01-02 03:04:05+00", ["id", "n", "t"], ["1", "NaN", "x"], None, None),
        (Decimal(3), Decimal(4), 0, 8, "update", "2024-01-02 03:04:05+00", ["id", "n", "t"], ["2", "2.5", "y"],
         (["id"], ["int4"], ["1"]), None),
        (Decimal(5), Decimal(6), 0, 9, "delete", "2024-01-02 03:04:05+00", None, None, (["id"], ["int4"], ["2"]), None),
    ], schema)
    columns = [SourceColumn(n, t, spark_type(t)) for n, t in (("id", "int4"), ("n", "numeric"), ("t", "text"))]
    rows = typed_rows(events, columns, ["id"])
    plan = rows._jdf.queryExecution().optimizedPlan().toString()
    assert plan.count("map_from_arrays(") == 2  # the row image's and the identity's, once each
    got = [(r["pg_operation"], r["id"], r["n"], r["t"], r["_walbus_prev_id"], r["pg_raw_values"]) for r in rows.collect()]
    assert got == [
        ("insert", 1, None, "x", 1, {"n": "NaN"}),
        ("update", 2, Decimal("2.5"), "y", 1, {}),
        ("delete", 2, None, None, 2, {}),
    ]


def test_typed_rows_reads_values_in_the_tables_order_by_position_and_any_other_by_name(spark: Any) -> None:
    """An event whose columns are the table's in its order is read by position, any other
    (reordered, a column missing, one the table lacks) by name: the same typed values and
    the same pg_raw_values either way, inexact values included."""
    from decimal import Decimal

    from warehouse.frame import typed_rows
    from warehouse.schema import SourceColumn
    from warehouse.types import spark_type

    schema = (
        "lsn decimal(20,0), commit_lsn decimal(20,0), seq bigint, xid bigint, operation string, timestamp string, "
        "columns array<string>, `values` array<string>, "
        "identity struct<columns: array<string>, types: array<string>, `values`: array<string>>, unchanged array<string>"
    )
    ts = "2024-01-02 03:04:05+00"
    events = spark.createDataFrame([
        (Decimal(1), Decimal(1), 0, 7, "insert", ts, ["id", "n", "t"], ["1", "1.5", "a"], None, None),
        (Decimal(2), Decimal(2), 0, 7, "insert", ts, ["t", "id", "n"], ["b", "2", "2.5"], None, None),
        (Decimal(3), Decimal(3), 0, 7, "insert", ts, ["id", "t"], ["3", "c"], None, None),
        (Decimal(4), Decimal(4), 0, 7, "insert", ts, ["id", "n", "t", "extra"], ["4", "NaN", "d", "z"], None, None),
        (Decimal(5), Decimal(5), 0, 7, "insert", ts, ["n", "t", "id"], ["NaN", "e", "5"], None, None),
        (Decimal(6), Decimal(6), 0, 7, "update", ts, ["id", "n", "t"], ["6", "NaN", "f"], (["id"], ["int4"], ["60"]), None),
        (Decimal(7), Decimal(7), 0, 7, "delete", ts, None, None, (["id"], ["int4"], ["6"]), None),
    ], schema)
    columns = [SourceColumn(n, t, spark_type(t)) for n, t in (("id", "int4"), ("n", "numeric"), ("t", "text"))]
    rows = typed_rows(events, columns, ["id"]).orderBy("pg_lsn").collect()
    got = [(r["id"], r["n"], r["t"], r["_walbus_prev_id"], r["pg_raw_values"]) for r in rows]
    assert got == [
        (1, Decimal("1.5"), "a", 1, {}),
        (2, Decimal("2.5"), "b", 2, {}),
        (3, None, "c", 3, {}),
        (4, None, "d", 4, {"n": "NaN"}),
        (5, None, "e", 5, {"n": "NaN"}),
        (6, None, "f", 60, {"n": "NaN"}),
        (6, None, None, 6, {}),
    ]


def test_typed_rows_of_a_table_with_postgresqls_most_columns(spark: Any) -> None:
    """1,600 columns (PostgreSQL's limit), one row with every value exact and one with none:
    the check that a row needs no pg_raw_values entry is one condition over every column,
    and written as a chain of ANDs it overflowed the JVM's stack in Spark's analysis."""
    from decimal import Decimal

    from warehouse.frame import typed_rows
    from warehouse.schema import SourceColumn
    from warehouse.types import spark_type

    schema = (
        "lsn decimal(20,0), commit_lsn decimal(20,0), seq bigint, xid bigint, operation string, timestamp string, "
        "columns array<string>, `values` array<string>, "
        "identity struct<columns: array<string>, types: array<string>, `values`: array<string>>, unchanged array<string>"
    )
    names = ["id", *(f"c{i}" for i in range(1, 1600))]
    ts = "2024-01-02 03:04:05+00"
    events = spark.createDataFrame([
        (Decimal(1), Decimal(1), 0, 7, "insert", ts, names, ["1", *(str(i) for i in range(1, 1600))], None, None),
        (Decimal(2), Decimal(2), 0, 7, "insert", ts, names, ["2", *(["NaN"] * 1599)], None, None),
    ], schema)
    columns = [SourceColumn("id", "int4", spark_type("int4"))]
    columns += [SourceColumn(n, "numeric", spark_type("numeric")) for n in names[1:]]
    exact, inexact = typed_rows(events, columns, ["id"]).orderBy("pg_lsn").collect()
    assert (exact["c1"], exact["c1599"], exact["pg_raw_values"]) == (Decimal(1), Decimal(1599), {})
    assert (inexact["c1"], inexact["c1599"]) == (None, None)
    assert inexact["pg_raw_values"] == {n: "NaN" for n in names[1:]}


def test_building_a_loads_dataframes_sends_no_call_site_notes(spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyspark 4 notes the Python call site of every DataFrame and Column call in the JVM
    (PySparkCurrentOrigin, for error messages): ~4 extra py4j round trips a call, 3/4 of
    what building a table's DataFrames cost. walbus' sessions turn the notes off."""
    from py4j.clientserver import ClientServerConnection  # type: ignore[import-untyped]
    from pyspark.errors.utils import is_debugging_enabled
    from pyspark.sql import functions as F

    from warehouse.current import latest_actions
    from warehouse.frame import typed_rows
    from warehouse.schema import SourceColumn
    from warehouse.types import spark_type

    sent: list[str] = []
    send = ClientServerConnection.send_command

    def counting(self: Any, command: str) -> Any:
        sent.append(command)
        return send(self, command)

    events = spark.createDataFrame([], (
        "lsn decimal(20,0), commit_lsn decimal(20,0), seq bigint, xid bigint, operation string, timestamp string, "
        "columns array<string>, `values` array<string>, "
        "identity struct<columns: array<string>, types: array<string>, `values`: array<string>>, unchanged array<string>"
    ))
    columns = [SourceColumn(n, t, spark_type(t)) for n, t in (("id", "int4"), ("n", "numeric"), ("t", "text"))]
    monkeypatch.setattr(ClientServerConnection, "send_command", counting)
    latest_actions(typed_rows(events, columns, ["id"]), ["id"], columns).where(F.col("n") > 1)
    monkeypatch.undo()
    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    assert not is_debugging_enabled()
    assert len(sent) > 100  # the DataFrames were built through py4j, and watched
    assert not [c for c in sent if "PySparkCurrentOrigin" in c or "stackTracesInDataFrameContext" in c]


def test_a_relative_warehouse_path_is_the_working_directorys(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delta reads a relative path in ``delta.`…``` as a table of a schema named ``delta``: a
    load into ``--warehouse wh/x`` failed with SCHEMA_NOT_FOUND."""
    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(TX, TX_PK, tx_row(1, 2, 3)).events)
    monkeypatch.chdir(tmp_path)
    result = run_load(spark, LoadSpec(kafka_options(kafka_bootstrap), unique_name, "wh/x"))
    assert result.events == 1
    assert [r["amount"] for r in current(spark, tmp_path / "wh" / "x", unique_name)] == [3]


def test_a_load_with_tables_says_what_it_left_out_for_good(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """A load's offsets cover the whole topic: the events of a table --tables leaves out are
    not loaded by a later load either. That was silent; the load's summary now says it."""
    other = "public.other"
    events = (
        Txn(0x1000).insert(TX, TX_PK, tx_row(1, 2, 3)).insert(other, ["id"], {"id": ("int4", 1)}).events
        + Txn(0x2000).insert(other, ["id"], {"id": ("int4", 2)}).events
    )
    produce_events(kafka_bootstrap, unique_name, events)
    result = load(spark, kafka_bootstrap, unique_name, tmp_path, tables=("public.transactions",))
    assert result.events == 1 and result.left_out == {other: 2}
    assert "left out by --tables, and not loaded by a later load either: 2 events of public.other (2)" in result.lines()
    assert load(spark, kafka_bootstrap, unique_name, tmp_path).lines() == ["no new events"]


def test_a_box_array_is_split_at_its_semicolons(spark: Any) -> None:
    # box[] elements are separated by ';': split at the commas, {(1,1),(0,0);(3,3),(2,2)} was
    # stored as seven pieces with nothing in pg_raw_values (a types fuzz).
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, StringType

    from warehouse.types import convert

    value, exact = convert(F.col("t"), "_box", ArrayType(StringType()))
    rows = spark.createDataFrame([("{(1,1),(0,0);(3,3),(2,2)}",), ("{{(1,1),(0,0)}}",)], "t string")
    got = [(r["v"], r["e"]) for r in rows.select(value.alias("v"), exact.alias("e")).collect()]
    assert got == [(["(1,1),(0,0)", "(3,3),(2,2)"], True), (None, False)]
    value, exact = convert(F.col("t"), "_int4", ArrayType(StringType()))
    assert [r["v"] for r in spark.createDataFrame([("{1,2}",)], "t string").select(value.alias("v")).collect()] == [["1", "2"]]


def test_a_load_leaves_a_transaction_still_being_written_for_the_next_one(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # A transfer of one transaction (two rows) that the producer had written half of when the
    # load started: the current table showed the debit without the credit until the next load.
    # The load now ends after the last commit the producer's heartbeats confirmed.
    import asyncio
    import time

    from tests.support.kafka import create_topic, produce
    from walbus.contract import Heartbeat, heartbeat_topic

    first = Txn(0x1000, xid=1).insert(TX, TX_PK, tx_row(1, 7, 100)).insert(TX, TX_PK, tx_row(2, 8, 100)).events
    transfer = Txn(0x2000, xid=2).update(TX, TX_PK, tx_row(1, 7, 50)).update(TX, TX_PK, tx_row(2, 8, 150)).events
    produce_events(kafka_bootstrap, unique_name, first + transfer[:1])
    beats = heartbeat_topic(unique_name)

    def beat(confirmed: int) -> None:
        async def send() -> None:
            await create_topic(kafka_bootstrap, beats, compact=True)
            await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", confirmed, confirmed, int(time.time() * 1000)).to_json())])
        asyncio.run(send())

    beat(0x1008)  # the first transaction is confirmed, the transfer is not
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    amounts = lambda: sorted((r["transaction_id"], r["amount"]) for r in current(spark, tmp_path, unique_name))  # noqa: E731
    assert amounts() == [(1, 100), (2, 100)], "a part of the transfer was loaded"
    assert len(history(spark, tmp_path, unique_name)) == 2
    produce_events(kafka_bootstrap, unique_name, transfer[1:])
    beat(0x2008)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert amounts() == [(1, 50), (2, 150)]
    assert [int(r["pg_commit_lsn"]) for r in history(spark, tmp_path, unique_name)] == [0x1000, 0x1000, 0x2000, 0x2000]
