"""The load's per-table summary of a slice (warehouse.job._table_meta): what it finds, in how many Spark jobs."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from walbus.contract import encode_event, event_key, qualify_table

pytestmark = [pytest.mark.spark, pytest.mark.integration]

TS = "2024-05-01T12:00:00+00:00"


def _event(seq: int, table: str, operation: str, **kw: Any) -> tuple[bytes, bytes]:
    commit = 0x100 + seq // 3
    fields: dict[str, Any] = {"pk": ["id"], "new": None, "identity": None, **kw}
    value = encode_event(lsn=commit - 1, commit_lsn=commit, seq=seq % 3, xid=7, operation=operation, table=table,
                         timestamp=TS, **fields)
    return event_key(commit, seq % 3), value


def _row(cols: list[str], types: list[str], values: list[Any]) -> dict[str, list[Any]]:
    return {"columns": cols, "types": types, "values": values}


def _meta(spark: Any, records: list[tuple[bytes, bytes]]) -> tuple[dict[str, dict[str, Any]], int]:
    """The summary per table, and the Spark jobs it ran."""
    from warehouse.decode import parse_events
    from warehouse.job import _table_meta

    raw = spark.createDataFrame([(k, v, 0, i) for i, (k, v) in enumerate(records)],
                                "key binary, value binary, partition int, offset bigint")
    events = parse_events(raw).cache()
    events.count()
    group = f"meta-{uuid.uuid4().hex}"  # unique: the tracker keeps the groups of earlier tests' jobs
    spark.sparkContext.setJobGroup(group, "table meta")
    try:
        metas, others = _table_meta(events)
        assert others == 0
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
        events.unpersist()
    jobs = len(spark.sparkContext.statusTracker().getJobIdsForGroup(group))
    return {m["table"]: m for m in metas}, jobs


def test_the_summary_of_a_slice_without_unchanged_columns_is_one_job(spark: Any) -> None:
    cols, types = ["id", "price", "name"], ["int4", "numeric", "text"]
    records = [
        _event(0, "public.orders", "insert", new=_row(cols, types, [1, "1.50", "a"]), typmods={"price": [12, 2]}),
        _event(1, "public.orders", "insert", new=_row(cols, types, [2, "2.50", "b"]), typmods={"price": [12, 2]}),
        _event(2, "public.orders", "delete", identity=_row(["id"], ["int4"], [2])),
        # a column added later in the slice: the latest column order wins, both pairs are there
        _event(3, "public.orders", "update", new=_row([*cols, "note"], [*types, "text"], [1, "1.75", "a", "n"]),
               typmods={"price": [12, 2]}),
        _event(4, '"Odd.Schema"."Order Items"', "insert", pk=[], new=_row(["x"], ["int8"], [5])),
        _event(5, "public.orders", "truncate", pk=[]),
    ]
    metas, jobs = _meta(spark, records)
    assert jobs == 1
    orders = metas["public.orders"]
    assert orders["events"] == 5
    assert orders["latest_columns"] == ["id", "price", "name", "note"]
    assert sorted(orders["pairs"]) == [
        ("id", "int4"), ("name", "text"), ("note", "text"), ("price", "numeric(12,2)")]
    assert orders["unchanged"] == []
    assert orders["truncate"] is not None and orders["lsn_lo"] == 0x100 and orders["lsn_hi"] == 0x101
    odd = metas[qualify_table("Odd.Schema", "Order Items")]  # respelled as qualify_table spells it
    assert odd["events"] == 1 and odd["pk"] == [] and odd["pairs"] == [("x", "int8")]


def test_unchanged_names_come_from_a_job_of_their_own(spark: Any) -> None:
    cols, types = ["id", "doc", "blob"], ["int4", "text", "bytea"]
    records = [
        _event(0, "public.docs", "insert", new=_row(cols, types, [1, "d", "\\x00"])),
        _event(1, "public.docs", "update", new=_row(cols, types, [1, None, "\\x01"]), unchanged=["doc"]),
        _event(2, "public.docs", "update", new=_row(cols, types, [1, None, None]), unchanged=["doc", "blob"]),
        _event(3, "public.plain", "insert", new=_row(["id"], ["int4"], [9])),
    ]
    metas, jobs = _meta(spark, records)
    assert jobs == 2
    assert sorted(metas["public.docs"]["unchanged"]) == ["blob", "doc"]
    assert metas["public.plain"]["unchanged"] == []
    assert metas["public.docs"]["events"] == 3


def test_a_loads_first_pass_summarises_the_tables_and_counts_the_invalid_records_in_one_job(spark: Any) -> None:
    """write_slice's first pass over the slice (it fills the cache) is the summary itself: the
    invalid records are counted under a null table, their fields left out of every table's
    summary. (A count job before the summary read the cache again.)"""
    from warehouse.decode import decoded_records
    from warehouse.job import _table_meta

    cols, types = ["id", "name"], ["int4", "text"]
    records = [
        _event(0, "public.orders", "insert", new=_row(cols, types, [1, "a"])),
        (b"k", b'{"v": 1, "table": "public.orders", "columns": ["evil"], "types": ["int4"], "values": [1]}'),
        (b"k", b"not json"),
        _event(1, "public.orders", "update", new=_row(cols, types, [1, "b"])),
    ]
    raw = spark.createDataFrame([(k, v, 0, i) for i, (k, v) in enumerate(records)],
                                "key binary, value binary, partition int, offset bigint")
    fast = decoded_records(raw).cache()
    group = f"meta-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "first pass")
    try:
        metas, others = _table_meta(fast)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
        fast.unpersist()
    assert len(spark.sparkContext.statusTracker().getJobIdsForGroup(group)) == 1
    assert others == 2
    (orders,) = metas
    assert orders["table"] == "public.orders" and orders["events"] == 2
    assert sorted(orders["pairs"]) == [("id", "int4"), ("name", "text")]  # no "evil" column


@pytest.mark.parametrize("tail", [0, 1, 3], ids=["no-invalid-tail", "invalid-tail", "invalid-batches"])
def test_the_decoder_marks_each_tasks_first_and_last_valid_event(spark: Any, tail: int) -> None:
    """A task's last valid event is marked even when the batches after it hold invalid records
    only: without the mark, positions_unique would not see where the task ends, and a
    re-sent event in the next task could skip the history's de-duplication."""
    from warehouse.decode import EDGE, EDGE_FIRST, EDGE_LAST, ORDERED, decoded_records

    cols, types = ["id"], ["int4"]
    records = [_event(i, "public.t", "insert", new=_row(cols, types, [i])) for i in range(4)]
    records += [(b"k", b"not json")] * tail
    raw = spark.createDataFrame([(k, v, 0, i) for i, (k, v) in enumerate(records)],
                                "key binary, value binary, partition int, offset bigint").coalesce(1)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "2")
    try:
        rows = decoded_records(raw).orderBy("kafka_offset").collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert [r[EDGE] for r in rows] == [EDGE_FIRST, None, None, EDGE_LAST] + [None] * tail
    assert [r[ORDERED] for r in rows] == [True] * 4 + [None] * tail


def test_huge_rows_are_decoded_whole(spark: Any) -> None:
    """Rows of several MB (a 3 MB text value, a 2 MB jsonb) go through the decoding Python
    workers whole, in batches capped at 16 MB, with their neighbours intact."""
    from warehouse.decode import INVALID, parse_events

    cols, types = ["id", "body", "doc"], ["int4", "text", "jsonb"]
    big_text = "é\"\\\n" * 750_000  # 3 MB of characters the JSON escapes
    big_doc = '{"k": "' + "x" * 2_000_000 + '"}'
    records = [_event(i, "public.t", "insert", new=_row(cols, types, [i, big_text if i % 2 else "s", big_doc]))
               for i in range(12)]
    raw = spark.createDataFrame([(k, v, 0, i) for i, (k, v) in enumerate(records)],
                                "key binary, value binary, partition int, offset bigint")
    rows = parse_events(raw).orderBy("kafka_offset").collect()
    assert [r[INVALID] for r in rows] == [None] * 12
    assert [r["values"][0] for r in rows] == [str(i) for i in range(12)]
    assert all(r["values"][1] == (big_text if i % 2 else "s") for i, r in enumerate(rows))
    assert all(r["values"][2] == big_doc for r in rows)
