"""Legal but unusual input into the warehouse (issue 13): odd names, invalid records,
re-sent transactions with unchanged TOAST values, key changes replayed from history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.warehouse import Txn, kafka_options, produce_events, produce_records, table_paths
from walbus.contract import encode_event, event_key, qualify_table
from warehouse import layout
from warehouse.job import LoadError, LoadSpec, run_load

pytestmark = [pytest.mark.spark, pytest.mark.integration]

ODD = qualify_table("public", "Order Items")
ODD_COLUMNS = ("a.b", "a b", "a`b", "ö", "é" * 31 + "x")  # the last: 63 bytes, PostgreSQL's longest


def load(spark: Any, bootstrap: str, topic: str, warehouse: Path, **kw: Any) -> Any:
    return run_load(spark, LoadSpec(kafka_options(bootstrap), topic, str(warehouse), **kw))


def rows(spark: Any, path: str, *, live: bool = False) -> list[Any]:
    df = spark.read.format("delta").load(path)
    if live:
        df = df.where("NOT _walbus_deleted")
    return df.orderBy("pg_commit_lsn", "pg_seq").collect()


def odd_row(key: int, version: str, *, without: tuple[str, ...] = ()) -> dict[str, tuple[str, Any]]:
    row: dict[str, tuple[str, Any]] = {"id": ("int4", key)}
    row.update({c: ("text", f"{c}={version}") for c in ODD_COLUMNS if c not in without})
    return row


def test_any_table_and_column_name_loads(spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    from warehouse.cli import run_sql

    pk = ["id"]
    distinct_pairs = [("a.b", "c"), ("a", "b.c"), ("public", "a b"), ("public", "a_b")]
    events = (
        Txn(0x1000).insert(ODD, pk, odd_row(1, "v1")).insert(ODD, pk, odd_row(2, "v1")).events
        # an unchanged TOAST value in a column named with a dot, and a key change
        + Txn(0x2000).update(ODD, pk, odd_row(1, "v2", without=("a.b",)), unchanged=["a.b"]).events
        + Txn(0x2100).update(ODD, pk, odd_row(20, "v2"), identity={"id": ("int4", 2)}).events
    )
    tx = Txn(0x3000)
    for n, (schema, table) in enumerate(distinct_pairs):
        tx.insert(qualify_table(schema, table), pk, {"id": ("int4", n), "v": ("text", f"{schema}|{table}")})
    produce_events(kafka_bootstrap, unique_name, events + tx.events)
    first = load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert first.tables[ODD].history_rows == 4
    # a second load adds a column (ALTER TABLE … ADD COLUMNS) named with a dot too
    produce_events(kafka_bootstrap, unique_name, Txn(0x4000).insert(ODD, pk, {**odd_row(3, "v3"), "new.col": ("int4", 7)}).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)

    paths = table_paths(tmp_path, unique_name, ODD)
    current = {r["id"]: r.asDict() for r in rows(spark, paths.current, live=True)}
    assert sorted(current) == [1, 3, 20]
    assert current[1]["a.b"] == "a.b=v1"  # carried over
    assert [current[1][c] for c in ODD_COLUMNS[1:]] == [f"{c}=v2" for c in ODD_COLUMNS[1:]]
    assert [current[20][c] for c in ODD_COLUMNS] == [f"{c}=v2" for c in ODD_COLUMNS]
    assert current[3]["new.col"] == 7 and current[1]["new.col"] is None
    history = rows(spark, paths.history)
    assert [r["a`b"] for r in history] == ["a`b=v1", "a`b=v1", "a`b=v2", "a`b=v2", "a`b=v3"]

    # every (schema, table) pair its own tables and views, queried by the view names
    _, found = run_sql(spark, str(tmp_path), unique_name, "SELECT id FROM `public.Order Items` ORDER BY id", 10)
    assert [r["id"] for r in found] == [1, 3, 20]
    _, found = run_sql(spark, str(tmp_path), unique_name, "SELECT count(*) AS n FROM `public.Order Items.history`", 10)
    assert found[0]["n"] == 5
    for n, (schema, table) in enumerate(distinct_pairs):
        view = layout.table_paths(str(tmp_path), unique_name, schema, table).view("")
        _, found = run_sql(spark, str(tmp_path), unique_name, f"SELECT id, v FROM `{view}`", 10)
        assert [(r["id"], r["v"]) for r in found] == [(n, f"{schema}|{table}")], view
        (stored,) = rows(spark, table_paths(tmp_path, unique_name, qualify_table(schema, table)).history)
        assert stored["v"] == f"{schema}|{table}"


def _value(commit_lsn: int, columns: list[Any], values: list[Any]) -> bytes:
    return encode_event(
        lsn=commit_lsn - 1, commit_lsn=commit_lsn, seq=0, xid=7, operation="insert", table="public.t",
        timestamp="2024-01-02T03:04:05.123456+00:00", pk=["id"],
        new={"columns": columns, "types": ["int4", "text", "text"][: len(columns)], "values": values}, identity=None,
    )


def _bad_value() -> bytes:
    # lengths of columns, types and values differ: not a contract-v1 event
    return _value(0x2000, ["id", "a"], [2, "y", 7])


def test_invalid_record_fails_the_load_or_is_quarantined(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    from delta.tables import DeltaTable

    from warehouse.cli import run_sql

    pk, table = ["id"], "public.t"
    good = [Txn(0x1000).insert(table, pk, {"id": ("int4", 1), "a": ("text", "x")}).events[0],
            Txn(0x3000).insert(table, pk, {"id": ("int4", 3), "a": ("text", "z")}).events[0]]
    produce_records(kafka_bootstrap, unique_name, [
        (event_key(0x1000, 0), good[0]), (event_key(0x2000, 0), _bad_value()), (event_key(0x3000, 0), good[1]),
        (event_key(0x4000, 0), good[1]),  # a valid value under another event's key
        (event_key(0x5000, 0), _value(0x5000, ["id", "a", "a"], [5, "first", "last"])),  # legal: the last wins
        (event_key(0x6000, 0), _value(0x6000, ["id", None], [6, "x"])),  # a null column name
    ])
    paths = table_paths(tmp_path, unique_name, table)
    with pytest.raises(LoadError, match=rf"record at {unique_name} partition 0 offset 1: .*differ in length"):
        load(spark, kafka_bootstrap, unique_name, tmp_path)
    assert not DeltaTable.isDeltaTable(spark, paths.history)  # nothing written

    result = load(spark, kafka_bootstrap, unique_name, tmp_path, skip_invalid=True)
    assert result.quarantined == 3
    assert [(r["id"], r["a"]) for r in rows(spark, paths.history)] == [(1, "x"), (3, "z"), (5, "last")]
    _, quarantined = run_sql(
        spark, str(tmp_path), unique_name,
        "SELECT kafka_topic, kafka_partition, kafka_offset, kafka_key, kafka_value, reason, load_id "
        "FROM _walbus_quarantine ORDER BY kafka_offset", 10,
    )
    assert [(r["kafka_topic"], r["kafka_partition"], r["kafka_offset"], bytes(r["kafka_key"]), bytes(r["kafka_value"]))
            for r in quarantined] == [
        (unique_name, 0, 1, event_key(0x2000, 0), _bad_value()),
        (unique_name, 0, 3, event_key(0x4000, 0), good[1]),
        (unique_name, 0, 5, event_key(0x6000, 0), _value(0x6000, ["id", None], [6, "x"])),
    ]
    assert "differ in length" in quarantined[0]["reason"] and "position" in quarantined[1]["reason"]
    assert "must be strings" in quarantined[2]["reason"]
    assert load(spark, kafka_bootstrap, unique_name, tmp_path).lines() == ["no new events"]


def doc(title: str, body: str | None = None) -> dict[str, tuple[str, Any]]:
    """Row 1 of a table with a TOAST-able body (left out: unchanged)."""
    row = {"id": ("int4", 1), "title": ("text", title)}
    return row if body is None else {**row, "body": ("text", body)}


def test_unchanged_toast_value_comes_from_the_newest_version(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    table, pk = "public.docs", ["id"]

    insert = Txn(0x1000).insert(table, pk, doc("t1", "old body")).events
    produce_events(kafka_bootstrap, unique_name, insert + Txn(0x2000).update(table, pk, doc("t2", "new body")).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    # the producer re-sends the old insert (duplicates are whole transactions from any point),
    # then a newer update leaves the body unchanged
    produce_events(kafka_bootstrap, unique_name, insert + Txn(0x3000).update(table, pk, doc("t3"), unchanged=["body"]).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    paths = table_paths(tmp_path, unique_name, table)
    assert [(r["title"], r["body"]) for r in rows(spark, paths.current)] == [("t3", "new body")]
    assert [(r["title"], r["body"]) for r in rows(spark, paths.history)] == [
        ("t1", "old body"), ("t2", "new body"), ("t3", "new body")
    ]


def test_an_unchanged_toast_value_is_never_a_deleted_rows(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # A tombstone keeps the deleted row's values; the key's row inserted since with no event
    # under this name (the table swapped by renames), an update leaving the body unchanged
    # took the deleted row's body (a fuzz). Not known: null, and pg_unchanged says so.
    table, pk = "public.docs", ["id"]

    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(table, pk, doc("t1", "deleted body")).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).delete(table, pk, {"id": ("int4", 1)}).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, Txn(0x3000).update(table, pk, doc("t3"), unchanged=["body"]).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    (current,) = rows(spark, table_paths(tmp_path, unique_name, table).current)
    assert (current["title"], current["body"], current["pg_unchanged"]) == ("t3", None, ["body"])


def test_a_primary_key_change_inside_one_load(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # Every event of the load was merged under the latest key: the rows of the earlier key
    # became rows under one they never had (a row 'a' that PostgreSQL never held under v; a
    # fuzz). The current table takes the changes since the key change, as when rebuilt after
    # one across loads; history keeps every event.
    table = "public.t"

    def row(key: int, v: str) -> dict[str, tuple[str, Any]]:
        return {"id": ("int4", key), "v": ("text", v)}

    events = (Txn(0x1000).insert(table, ["id"], row(1, "a")).insert(table, ["id"], row(2, "b")).events
              + Txn(0x2000).update(table, ["id"], row(1, "c")).events
              + Txn(0x3000).insert(table, ["v"], row(3, "d")).insert(table, ["v"], row(4, "e")).events)
    produce_events(kafka_bootstrap, unique_name, events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    paths = table_paths(tmp_path, unique_name, table)
    assert sorted((r["id"], r["v"]) for r in rows(spark, paths.current, live=True)) == [(3, "d"), (4, "e")]
    assert len(rows(spark, paths.history)) == 5


def test_a_point_in_time_view_keys_each_event_by_the_key_it_was_written_under(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # --as-of-lsn applied the current table's key (id, k) to the whole history: the delete of
    # id 1, whose identity had no k, keyed nothing, and the deleted row was live again, at
    # every LSN after it (a fuzz). t2's key went the other way: (id, k) -> id, the history
    # holding no _walbus_prev_k for the load.
    from warehouse.cli import run_sql

    t, t2 = "public.t", "public.t2"

    def row(key: int, k: str, v: str) -> dict[str, tuple[str, Any]]:
        return {"id": ("int4", key), "k": ("text", k), "v": ("text", v)}

    one = {"id": ("int4", 1)}
    events = (Txn(0x1000).insert(t, ["id"], row(1, "a", "x")).insert(t, ["id"], row(2, "b", "y"))
              .insert(t2, ["id", "k"], row(1, "a", "x")).events
              + Txn(0x2000).delete(t, ["id"], one).update(t2, ["id", "k"], row(1, "a", "x2")).events
              + Txn(0x3000).insert(t, ["id", "k"], row(3, "c", "z")).delete(t2, ["id"], one).events)
    produce_events(kafka_bootstrap, unique_name, events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)

    def state(table: str, lsn: int) -> set[tuple[Any, ...]]:
        _, found = run_sql(spark, str(tmp_path), unique_name, f"SELECT id, k, v FROM {table}", 100, lsn)
        return {(r["id"], r["k"], r["v"]) for r in found}

    assert state("public_t", 0x1000) == {(1, "a", "x"), (2, "b", "y")}
    assert state("public_t", 0x2000) == {(2, "b", "y")}
    # after the change, as the current table: the rows the events since made
    latest = {(r["id"], r["k"], r["v"]) for r in rows(spark, table_paths(tmp_path, unique_name, t).current, live=True)}
    assert state("public_t", 0x3000) == state("public_t", 0xFFFF_FFFF_FFFF_FFFF) == latest == {(3, "c", "z")}
    assert state("public_t2", 0x2000) == {(1, "a", "x2")}
    assert state("public_t2", 0x3000) == set()


def test_columns_named_like_the_loaders_working_columns(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # The TOAST fill's working columns had short names (_walbus_probe, _walbus_needs_table…):
    # a source column so named failed every load of the topic or got a wrong value (a fuzz).
    table, pk = "public.t", ["id"]
    names = ["_walbus_probe", "_walbus_needs_table", "_walbus_rename", "_walbus_last_0", "_walbus_latest", "_walbus_new"]

    def row(key: int, version: str, *, body: bool = True) -> dict[str, tuple[str, Any]]:
        values: dict[str, tuple[str, Any]] = {"id": ("int4", key), **{n: ("text", f"{n}:{version}") for n in names}}
        return {**values, "body": ("text", f"body {key}")} if body else values

    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(table, pk, row(1, "v1")).insert(table, pk, row(2, "v1")).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).update(table, pk, row(1, "v2", body=False), unchanged=["body"]).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    current = {r["id"]: r.asDict() for r in rows(spark, table_paths(tmp_path, unique_name, table).current)}
    assert {k: (v["body"], *(v[n] for n in names)) for k, v in current.items()} == {
        1: ("body 1", *(f"{n}:v2" for n in names)), 2: ("body 2", *(f"{n}:v1" for n in names)),
    }


def test_changes_without_a_primary_key_for_a_while_reach_the_current_table(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # The table's primary key dropped for a while (ALTER TABLE … DROP CONSTRAINT; only inserts
    # publish then): a load whose latest event had no key was history only, and every change of
    # it, keyed or not, missed the current table for good (a fuzz).
    table, pk = "public.t", ["id"]

    def row(key: int, v: str) -> dict[str, tuple[str, Any]]:
        return {"id": ("int4", key), "v": ("text", v)}

    first = Txn(0x1000)
    for key in (1, 2, 3):
        first.insert(table, pk, row(key, "a"))
    produce_events(kafka_bootstrap, unique_name, first.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).update(table, pk, row(1, "b")).delete(table, pk, {"id": ("int4", 3)}).events
                   + Txn(0x3000).insert(table, [], row(4, "a")).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, Txn(0x4000).insert(table, [], row(5, "a")).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    current = rows(spark, table_paths(tmp_path, unique_name, table).current, live=True)
    assert sorted((r["id"], r["v"]) for r in current) == [(1, "b"), (2, "a"), (4, "a"), (5, "a")]


def test_an_unchanged_toast_value_the_column_cannot_hold_keeps_its_text(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # A value the column's type cannot hold is null there with its text in pg_raw_values: the
    # TOAST fill carried the null and dropped the text, so the value was lost (a fuzz; here a
    # numeric past decimal(38,10) and a date 'infinity').
    table, pk = "public.t", ["id"]
    big = "9" * 45 + ".5"

    def row(key: int, note: str, *, full: bool = True) -> dict[str, tuple[str, Any]]:
        values: dict[str, tuple[str, Any]] = {"id": ("int4", key), "note": ("text", note)}
        return {**values, "num": ("numeric", big), "day": ("date", "infinity")} if full else values

    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(table, pk, row(1, "a")).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)  # row 1 filled from the current table, row 2 within the load
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).update(table, pk, row(1, "b", full=False), unchanged=["num", "day"])
                   .insert(table, pk, row(2, "a")).update(table, pk, row(2, "b", full=False), unchanged=["num", "day"]).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    paths = table_paths(tmp_path, unique_name, table)
    for where in (paths.current, paths.history):
        for r in rows(spark, where):
            assert (r["num"], r["day"]) == (None, None)
            assert r["pg_raw_values"] == {"num": big, "day": "infinity"}, (where, r["id"], r["note"])


def test_a_table_moved_away_after_a_type_change_loads_again(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # An incompatible type change fails the table; the docs say to move its directory away.
    # When the failed load held both types (the table dropped and created again with q text),
    # its replay failed the same way ("changed type within this load"), for good (a fuzz).
    import shutil

    table, pk = "public.t", ["id"]
    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(table, pk, {"id": ("int4", 1), "q": ("int4", 5)}).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).insert(table, pk, {"id": ("int4", 2), "q": ("int4", 7)}).events
                   + Txn(0x3000).insert(table, pk, {"id": ("int4", 3), "q": ("text", "abc")}).events)
    with pytest.raises(LoadError, match="changed type"):
        load(spark, kafka_bootstrap, unique_name, tmp_path)
    paths = table_paths(tmp_path, unique_name, table)
    shutil.move(str(Path(paths.history).parent), str(tmp_path / "moved"))
    load(spark, kafka_bootstrap, unique_name, tmp_path)  # the load's events again, into a new table
    assert sorted((r["id"], r["q"]) for r in rows(spark, paths.current)) == [(2, "7"), (3, "abc")]


def _replay(history: list[Any], pk: str) -> dict[Any, dict[str, Any]]:
    """The table rebuilt from its history rows alone, in (commit_lsn, seq) order."""
    table: dict[Any, dict[str, Any]] = {}
    for row in history:
        values = row.asDict()
        op, key = values["pg_operation"], values[pk]
        if op == "truncate":
            table.clear()
            continue
        table.pop(values.get(f"_walbus_prev_{pk}", key), None)  # the row's key before the event
        if op != "delete":
            table[key] = {c: v for c, v in values.items() if not c.startswith(("pg_", "_walbus_"))}
    return table


def test_history_alone_replays_key_changes(spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    table, pk = "public.t", ["id"]

    def row(key: int, v: str) -> dict[str, tuple[str, Any]]:
        return {"id": ("int4", key), "v": ("text", v)}

    def old(key: int) -> dict[str, tuple[str, Any]]:
        return {"id": ("int4", key)}

    first = Txn(0x1000).insert(table, pk, row(1, "a")).insert(table, pk, row(2, "b")).insert(table, pk, row(3, "c"))
    # rows 1 and 2 swap keys through 10, in one transaction
    swap = (Txn(0x2000).update(table, pk, row(10, "a"), identity=old(1)).update(table, pk, row(1, "b"), identity=old(2))
            .update(table, pk, row(2, "a"), identity=old(10)))
    produce_events(kafka_bootstrap, unique_name, first.events + swap.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    later = Txn(0x3000).update(table, pk, row(30, "c2"), identity=old(3)).delete(table, pk, old(1))
    produce_events(kafka_bootstrap, unique_name, later.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)

    paths = table_paths(tmp_path, unique_name, table)
    live = {r["id"]: r["v"] for r in rows(spark, paths.current, live=True)}
    assert live == {2: "a", 30: "c2"}
    replayed = _replay(rows(spark, paths.history), "id")
    assert {k: v["v"] for k, v in replayed.items()} == live


def test_keys_whose_type_cannot_hold_them(spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    # A numeric key with more fraction digits than the column's decimal holds, a date key
    # 'infinity': null in the key column, their text in pg_raw_values. Every action of such
    # a key was dropped from the current table (rows missing without a word; found by a
    # warehouse fuzz). Now such keys are told apart, and matched, by that text.
    from warehouse.views import as_of

    n, d = "public.n", "public.d"

    def num(key: str, v: str) -> dict[str, tuple[str, Any]]:
        return {"id": ("numeric", key), "v": ("text", v)}

    def day(key: str, v: str) -> dict[str, tuple[str, Any]]:
        return {"day": ("date", key), "v": ("text", v)}

    first = (Txn(0x1000).insert(n, ["id"], num("0.12345678901", "a")).insert(n, ["id"], num("0.12345678902", "b"))
             .insert(n, ["id"], num("1", "c")).insert(d, ["day"], day("infinity", "open")).insert(d, ["day"], day("2024-01-01", "x")))
    produce_events(kafka_bootstrap, unique_name, first.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    later = (Txn(0x2000).update(n, ["id"], num("0.12345678901", "a2"))
             .update(n, ["id"], num("0.12345678903", "b"), identity={"id": ("numeric", "0.12345678902")})
             .delete(n, ["id"], {"id": ("numeric", "1")}).update(d, ["day"], day("infinity", "still open")))
    produce_events(kafka_bootstrap, unique_name, later.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)

    def live(table: str, key: str) -> dict[str, str]:
        out = {}
        for r in rows(spark, table_paths(tmp_path, unique_name, table).current, live=True):
            out[str(r[key]) if r[key] is not None else r["pg_raw_values"][key]] = r["v"]
        return out

    assert live(n, "id") == {"0.12345678901": "a2", "0.12345678903": "b"}
    assert live(d, "day") == {"infinity": "still open", "2024-01-01": "x"}
    _, then = as_of(spark, table_paths(tmp_path, unique_name, n), 0x1000)
    assert then is not None
    assert sorted((r["pg_raw_values"].get("id") or str(r["id"]), r["v"]) for r in then.collect()) == [
        ("0.12345678901", "a"), ("0.12345678902", "b"), ("1.0000000000", "c")]


def test_date_and_timestamp_keys_at_the_edges_of_the_calendar(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # A second load's MERGE prunes the current table to the load's key range. That range came
    # to the driver as Python datetimes in the session's zone: a timestamp key in year 1 failed
    # every load ("year 0 is out of range"; found by a warehouse fuzz). Now it travels as
    # microseconds (days for a date).
    ts, d = "public.ts", "public.d"

    def at(key: str, v: str) -> dict[str, tuple[str, Any]]:
        return {"at": ("timestamptz", key), "v": ("text", v)}

    def day(key: str, v: str) -> dict[str, tuple[str, Any]]:
        return {"day": ("date", key), "v": ("text", v)}

    first = (Txn(0x1000).insert(ts, ["at"], at("2024-01-01 00:00:00+00", "a")).insert(ts, ["at"], at("2024-11-03 06:30:00+00", "b"))
             .insert(d, ["day"], day("2024-01-01", "x")))
    produce_events(kafka_bootstrap, unique_name, first.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    later = (Txn(0x2000).insert(ts, ["at"], at("0001-01-01 00:00:00+00", "year one")).update(ts, ["at"], at("2024-11-03 06:30:00+00", "b2"))
             .insert(d, ["day"], day("0001-01-01", "day one")).update(d, ["day"], day("2024-01-01", "x2")))
    produce_events(kafka_bootstrap, unique_name, later.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    live = spark.read.format("delta").load(table_paths(tmp_path, unique_name, ts).current).where("NOT _walbus_deleted")
    assert sorted((r["us"], r["v"]) for r in live.selectExpr("unix_micros(at) AS us", "v").collect()) == [
        (-62135596800000000, "year one"), (1704067200000000, "a"), (1730615400000000, "b2")]
    days = spark.read.format("delta").load(table_paths(tmp_path, unique_name, d).current).where("NOT _walbus_deleted")
    assert sorted((r["n"], r["v"]) for r in days.selectExpr("unix_date(day) AS n", "v").collect()) == [(-719162, "day one"), (19723, "x2")]


def test_columns_whose_names_differ_only_in_case_or_are_walbus_names_load(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # PostgreSQL tells "A" from a, and "PG_LSN" from walbus' pg_lsn; Delta Lake keeps column
    # names case-insensitively. Such a table failed the whole load with Delta's
    # DELTA_DUPLICATE_COLUMNS_FOUND (a fuzz), then was refused ("differ only in case", "clash
    # with walbus metadata columns"): never loaded. Now such a column is stored as
    # _walbus_col_<name>, recorded in the tables' property walbus.columnNames.
    from warehouse.cli import run_sql
    from warehouse.frame import prev_name
    from warehouse.schema import column_names_of, table_properties
    from warehouse.stream import start_stream
    from warehouse.views import as_of

    t, pk = "public.cased", ["A"]  # the key is a column stored under another name

    def row(key: int, v: str, *, without: tuple[str, ...] = ()) -> dict[str, tuple[str, Any]]:
        full = {"a": ("text", f"a{v}"), "A": ("int4", key), "PG_LSN": ("text", f"lsn{v}"),
                "_walbus_deleted": ("bool", False), "t": ("text", f"t{v}"), "T": ("text", f"T{v}")}
        return {k: x for k, x in full.items() if k not in without}

    first = Txn(0x1000).insert(t, pk, row(1, "1")).insert(t, pk, row(2, "1")).insert(t, pk, row(3, "1"))
    first.insert("public.fine", ["id"], {"id": ("int4", 1), "v": ("text", "ok")})
    produce_events(kafka_bootstrap, unique_name, first.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    # a later load: "T" left unchanged (TOAST), a key change 2 -> 20, a delete, and columns
    # added that clash with an existing one ("a " does not) and with a metadata column
    later = (Txn(0x2000).update(t, pk, {**row(1, "2", without=("T",)), "pg_seq": ("int8", 7), "a ": ("text", "sp")}, unchanged=["T"])
             .update(t, pk, row(20, "2"), identity={"A": ("int4", 2)}).delete(t, pk, {"A": ("int4", 3)}))
    produce_events(kafka_bootstrap, unique_name, later.events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)

    names = {"_walbus_col_A": "A", "_walbus_col_PG_LSN": "PG_LSN", "_walbus_col__walbus_deleted": "_walbus_deleted",
             "_walbus_col_T": "T", "_walbus_col_pg_seq": "pg_seq"}
    paths = table_paths(tmp_path, unique_name, t)
    for path in (paths.history, paths.current):
        assert column_names_of(table_properties(spark, path)) == names, path
    live = {r["_walbus_col_A"]: r.asDict() for r in rows(spark, paths.current, live=True)}
    assert sorted(live) == [1, 20]
    assert {k: (r["a"], r["_walbus_col_PG_LSN"], r["_walbus_col__walbus_deleted"], r["t"], r["_walbus_col_T"],
                r["_walbus_col_pg_seq"], r["a "]) for k, r in live.items()} == {
        1: ("a2", "lsn2", False, "t2", "T1", 7, "sp"),  # T carried over
        20: ("a2", "lsn2", False, "t2", "T2", None, None),
    }
    assert live[1]["pg_unchanged"] == ["_walbus_col_T"]  # the tables' names, as pg_raw_values' keys
    history = rows(spark, paths.history)
    assert [(r["pg_operation"], r["_walbus_col_A"], r["_walbus_prev__walbus_col_A"]) for r in history] == [
        ("insert", 1, 1), ("insert", 2, 2), ("insert", 3, 3), ("update", 1, 1), ("update", 20, 2), ("delete", 3, 3)]
    assert [r["_walbus_col_PG_LSN"] for r in history] == ["lsn1", "lsn1", "lsn1", "lsn2", "lsn2", None]
    assert [int(r["pg_lsn"]) for r in history][3:] == [0x2000 - 100, 0x2000 - 99, 0x2000 - 98]  # walbus' own
    (fine,) = rows(spark, table_paths(tmp_path, unique_name, "public.fine").current)
    assert (fine["id"], fine["v"]) == (1, "ok")

    # the views, and the table as of the first load
    query = "SELECT _walbus_col_A AS k, a, _walbus_col_T AS big_t FROM public_cased ORDER BY k"
    _, found = run_sql(spark, str(tmp_path), unique_name, query, 10)
    assert [(r["k"], r["a"], r["big_t"]) for r in found] == [(1, "a2", "T1"), (20, "a2", "T2")]
    _, found = run_sql(spark, str(tmp_path), unique_name, query, 10, 0x1000)
    assert [(r["k"], r["a"], r["big_t"]) for r in found] == [(1, "a1", "T1"), (2, "a1", "T1"), (3, "a1", "T1")]
    _, then = as_of(spark, paths, 0x2000)
    assert then is not None
    assert sorted((r["_walbus_col_A"], r["_walbus_deleted"]) for r in then.collect()) == [(1, False), (2, True), (3, True), (20, False)]

    # `walbus warehouse stream` over the same events makes the same tables, read by PostgreSQL's
    # names (its one micro-batch met the columns in another order: which of a and "A" keeps
    # its own name is the one the tables met first)
    def by_pg_names(path: str) -> list[str]:
        back = column_names_of(table_properties(spark, path))
        back.update({prev_name(k): prev_name(v) for k, v in back.items()})
        def name(k: str) -> tuple[str, str]:
            own = k.startswith(("pg_", "_walbus_deleted", "_walbus_prev_")) and k not in back
            return ("walbus" if own or k.startswith("_walbus_prev_") else "source", back.get(k, k))

        table = spark.read.format("delta").load(path)
        # (a tombstone's other values differ between one load and two)
        found = (table.where("NOT _walbus_deleted") if path.endswith("current") else table).collect()
        return sorted(repr(sorted(
            (name(k), [back.get(u, u) for u in v] if k == "pg_unchanged" else v) for k, v in r.asDict().items()
        )) for r in found)

    streamed = tmp_path / "streamed"
    start_stream(spark, LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(streamed))).awaitTermination()
    other = table_paths(streamed, unique_name, t)
    assert len(column_names_of(table_properties(spark, other.current))) == len(names)
    for mine, theirs in ((paths.history, other.history), (paths.current, other.current)):
        assert by_pg_names(mine) == by_pg_names(theirs)


def test_a_current_table_rebuilt_after_a_key_change_has_no_column_of_the_old_key(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # The history's _walbus_prev_id (of the earlier key id) was read as a source column once
    # the key was k: the rebuilt current table (and its views) got a column _walbus_prev_id,
    # null, of type "?" in walbus.pgTypes, that the source table never had (a fuzz).
    t = "public.t"

    def row(key: int, k: str) -> dict[str, tuple[str, Any]]:
        return {"id": ("int4", key), "k": ("text", k)}

    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(t, ["id"], row(1, "a")).events)
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).insert(t, ["k"], row(2, "b")).events)
    with pytest.raises(LoadError, match="primary key changed"):
        load(spark, kafka_bootstrap, unique_name, tmp_path)
    paths = table_paths(tmp_path, unique_name, t)
    Path(paths.current).rename(tmp_path / "moved-away")  # as the message advises
    load(spark, kafka_bootstrap, unique_name, tmp_path)
    current = spark.read.format("delta").load(paths.current)
    assert [c for c in current.columns if c.startswith("_walbus")] == ["_walbus_deleted"]
    assert [(r["id"], r["k"]) for r in current.collect()] == [(2, "b")]
    history = rows(spark, paths.history)
    assert [(r["id"], r["k"], r["_walbus_prev_id"], r["_walbus_prev_k"]) for r in history] == [(1, "a", 1, None), (2, "b", None, "b")]
