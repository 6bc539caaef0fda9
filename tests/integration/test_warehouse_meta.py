"""The load's per-table summary of a slice (warehouse.decode.SliceTally, warehouse.job._table_meta):
what it finds, in how many Spark jobs."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pyspark.sql import functions as F

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


def _raw(spark: Any, records: list[tuple[bytes, bytes]]) -> Any:
    return spark.createDataFrame([(k, v, 0, i) for i, (k, v) in enumerate(records)],
                                 "key binary, value binary, partition int, offset bigint")


def _first_pass(spark: Any, records: list[tuple[bytes, bytes]]) -> tuple[Any, int]:
    """The slice's summary as a load's first pass makes it (the decoders tally the records as
    they fill the cache), and the Spark jobs it ran."""
    from warehouse.decode import SliceTally, decoded_records

    tally = SliceTally(spark.sparkContext)
    fast = decoded_records(_raw(spark, records), tally).cache()
    group = f"meta-{uuid.uuid4().hex}"  # unique: the tracker keeps the groups of earlier tests' jobs
    spark.sparkContext.setJobGroup(group, "first pass")
    try:
        fast.select(F.lit(1)).write.format("noop").mode("overwrite").save()
        summary = tally.summary()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
        fast.unpersist()
    return summary, len(spark.sparkContext.statusTracker().getJobIdsForGroup(group))


def _meta(spark: Any, records: list[tuple[bytes, bytes]]) -> tuple[dict[str, dict[str, Any]], int]:
    """The summary per table, and the Spark jobs it ran."""
    from warehouse.job import _table_meta

    summary, jobs = _first_pass(spark, records)
    assert summary.invalid == 0
    return {m["table"]: m for m in _table_meta(summary)}, jobs


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


def test_unchanged_names_come_from_the_same_pass(spark: Any) -> None:
    cols, types = ["id", "doc", "blob"], ["int4", "text", "bytea"]
    records = [
        _event(0, "public.docs", "insert", new=_row(cols, types, [1, "d", "\\x00"])),
        _event(1, "public.docs", "update", new=_row(cols, types, [1, None, "\\x01"]), unchanged=["doc"]),
        _event(2, "public.docs", "update", new=_row(cols, types, [1, None, None]), unchanged=["doc", "blob"]),
        _event(3, "public.plain", "insert", new=_row(["id"], ["int4"], [9])),
    ]
    metas, jobs = _meta(spark, records)
    assert jobs == 1
    assert metas["public.docs"]["unchanged"] == ["blob", "doc"]
    assert metas["public.plain"]["unchanged"] == []
    assert metas["public.docs"]["events"] == 3


def test_a_loads_first_pass_summarises_the_tables_and_counts_the_invalid_records_in_one_job(spark: Any) -> None:
    """write_slice's first pass over the slice (it fills the cache) is the summary itself: the
    invalid records are counted and the first of them kept, their fields left out of every
    table's summary. (An aggregate over the cache after the pass cost a job and ~0.35 s.)"""
    from warehouse.job import _table_meta

    cols, types = ["id", "name"], ["int4", "text"]
    records = [
        _event(0, "public.orders", "insert", new=_row(cols, types, [1, "a"])),
        (b"k", b'{"v": 1, "table": "public.orders", "columns": ["evil"], "types": ["int4"], "values": [1]}'),
        (b"k", b"not json"),
        _event(1, "public.orders", "update", new=_row(cols, types, [1, "b"])),
    ]
    summary, jobs = _first_pass(spark, records)
    assert jobs == 1
    assert summary.invalid == 2
    assert summary.first_invalid is not None and summary.first_invalid[:2] == (0, 1)
    assert summary.first_invalid[2]  # the contract's reason
    (orders,) = _table_meta(summary)
    assert orders["table"] == "public.orders" and orders["events"] == 2
    assert sorted(orders["pairs"]) == [("id", "int4"), ("name", "text")]  # no "evil" column


def test_a_task_that_runs_again_replaces_its_tally(spark: Any) -> None:
    """A decoder that runs again over the same records (a cache block computed again, a retried
    or speculative task) does not count them twice; a finished load's late tallies are dropped."""
    from warehouse.decode import SliceTally, decoded_records

    records = [_event(i, "public.t", "insert", new=_row(["id"], ["int4"], [i])) for i in range(6)]
    tally = SliceTally(spark.sparkContext)
    decoded = decoded_records(_raw(spark, records).repartition(2), tally)  # not cached: each action decodes
    decoded.select(F.lit(1)).write.format("noop").mode("overwrite").save()
    decoded.select(F.lit(1)).write.format("noop").mode("overwrite").save()
    summary = tally.summary()
    assert summary.tables["public.t"].events == 6
    decoded.select(F.lit(1)).write.format("noop").mode("overwrite").save()  # after the summary
    assert tally.token in tally.accumulator.value
    later = SliceTally(spark.sparkContext)
    assert tally.token not in tally.accumulator.value
    later.close()


@pytest.mark.parametrize("tail", [0, 1, 3], ids=["no-invalid-tail", "invalid-tail", "invalid-batches"])
def test_the_decoder_keeps_each_tasks_first_and_last_valid_event(spark: Any, tail: int) -> None:
    """A task's last valid event is its edge even when the batches after it hold invalid
    records only: without it, positions_unique would not see where the task ends, and a
    re-sent event in the next task could skip the history's de-duplication."""
    from warehouse.decode import SliceTally, decoded_records

    cols, types = ["id"], ["int4"]
    records = [_event(i, "public.t", "insert", new=_row(cols, types, [i])) for i in range(4)]
    records += [(b"k", b"not json")] * tail
    tally = SliceTally(spark.sparkContext)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "2")
    try:
        rows = decoded_records(_raw(spark, records).coalesce(1), tally).collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert len(rows) == 4 + tail
    (task,) = tally.accumulator.value[tally.token].values()
    tally.close()
    assert task.ordered and task.invalid == tail
    assert task.edges == [(0, 0, (0x100, 0)), (0, 3, (0x101, 0))]


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


def test_the_decoder_runs_without_cyclic_garbage_collection_and_puts_it_back(spark: Any) -> None:
    """The collector walked each batch's live rows again and again (55-60% of the decoding's
    CPU): a task decodes with it off, and leaves it as it found it, also when it fails."""
    import gc

    import pyarrow as pa

    from warehouse.decode import decode_batches, event_schemas

    _, arrow_schema = event_schemas()
    seen: list[bool] = []

    def batches(fail: bool) -> Any:
        for i in range(2):
            seen.append(gc.isenabled())
            records = [_event(i, "public.t", "insert", new=_row(["id"], ["int4"], [i]))]
            yield pa.RecordBatch.from_arrays(
                [pa.array([k for k, _ in records], pa.binary()), pa.array([v for _, v in records], pa.binary()),
                 pa.array([0], pa.int32()), pa.array([i], pa.int64())],
                names=["key", "value", "partition", "offset"],
            )
        if fail:
            raise RuntimeError("a broken source")

    assert gc.isenabled()
    assert sum(b.num_rows for b in decode_batches(arrow_schema, None, batches(False))) == 2
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(RuntimeError, match="a broken source"):
        list(decode_batches(arrow_schema, None, batches(True)))
    assert gc.isenabled()
    gc.disable()  # a process that runs without it keeps it off
    try:
        list(decode_batches(arrow_schema, None, batches(False)))
        assert not gc.isenabled()
    finally:
        gc.enable()
