"""warehouse.decode's tallies: what a decoding task notes of the records it decodes, and how a
slice's summary is merged from its tasks' tallies (no services: Arrow batches made here, as
Spark hands them to mapInArrow)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from walbus.contract import encode_event, event_key, qualify_table
from warehouse.decode import TaskTally, _decode_batch, merge_tallies

TS = "2024-05-01T12:00:00+00:00"


def _record(commit: int, seq: int, table: str, operation: str, **kw: Any) -> tuple[bytes, bytes]:
    fields: dict[str, Any] = {"pk": ["id"], "new": None, "identity": None, **kw}
    value = encode_event(lsn=commit, commit_lsn=commit, seq=seq, xid=7, operation=operation, table=table,
                         timestamp=TS, **fields)
    return event_key(commit, seq), value


def _new(cols: list[str], types: list[str], values: list[Any]) -> dict[str, list[Any]]:
    return {"columns": cols, "types": types, "values": values}


def _task(partition: int, first_offset: int, batches: list[list[tuple[bytes, bytes]]]) -> TaskTally:
    """One task's tally of its batches, as decode_batches keeps it."""
    task = TaskTally()
    previous = None
    offset = first_offset
    for records in batches:
        batch = pa.RecordBatch.from_arrays(
            [pa.array([k for k, _ in records], pa.binary()), pa.array([v for _, v in records], pa.binary()),
             pa.array([partition] * len(records), pa.int32()), pa.array(range(offset, offset + len(records)), pa.int64())],
            names=["key", "value", "partition", "offset"],
        )
        _, previous = _decode_batch(batch, previous, task)
        offset += len(records)
    return task


COLS, TYPES = ["id", "price"], ["int4", "numeric"]


def test_a_task_tallies_each_table_and_its_edges() -> None:
    a = _task(0, 10, [
        [_record(0x100, 0, "public.orders", "insert", new=_new(COLS, TYPES, [1, "1.5"]), typmods={"price": [12, 2]}),
         (b"k", b"not json"),
         _record(0x100, 1, "public.orders", "update", new=_new(COLS, TYPES, [1, None]), unchanged=["price"],
                 typmods={"price": [12, 2]})],
        [(b"k", b"{}")],
        [_record(0x200, 0, "public.orders", "delete", identity=_new(["id"], ["int4"], [1])),
         _record(0x200, 1, "public.orders", "truncate", pk=[]),
         _record(0x200, 2, '"odd.schema"."a b"', "insert", pk=[], new=_new(["x"], ["int8"], [5]))],
    ])
    assert a.ordered and a.invalid == 2 and a.first_invalid is not None and a.first_invalid[:2] == (0, 11)
    assert a.edges == [(0, 10, (0x100, 0)), (0, 16, (0x200, 2))]
    orders = a.tables["public.orders"]
    assert orders.events == 4 and (orders.lsn_lo, orders.lsn_hi) == (0x100, 0x200)
    # the truncate is the latest; its (empty) key is not the table's: the delete's is the latest key
    assert orders.keyed == (0x200, 0) and orders.pk == ("id",) and orders.key_last == {("id",): (0x200, 0)}
    assert orders.columns_at == (0x200, 0) and orders.columns == ("id",)  # the delete's identity
    assert orders.truncate == (0x200, 1) and orders.unchanged == {"price"}
    assert orders.schemas == {
        (("id", "price"), ("int4", "numeric"), (("price", (12, 2)),)), (("id",), ("int4",), ()),
    }
    # under the name the records' table column carries (qualify_table's spelling)
    assert set(a.tables) == {"public.orders", qualify_table("odd.schema", "a b")}


def test_a_slice_merges_its_tasks_in_any_order() -> None:
    first = _task(0, 0, [[_record(0x100, i, "public.t", "insert", new=_new(["id"], ["int4"], [i])) for i in range(3)]])
    second = _task(0, 3, [[(b"k", b"[]"),
                           _record(0x300, 0, "public.t", "update", new=_new(["id", "n"], ["int4", "text"], [1, "x"]))]])
    for tasks in ([first, second], [second, first]):
        summary = merge_tallies(_copy(t) for t in tasks)
        t = summary.tables["public.t"]
        assert t.events == 4 and (t.lsn_lo, t.lsn_hi) == (0x100, 0x300) and t.columns == ("id", "n")
        assert len(t.schemas) == 2
        assert summary.invalid == 1 and summary.first_invalid is not None and summary.first_invalid[:2] == (0, 3)
        assert summary.unique_positions


def test_a_transaction_sent_again_is_not_unique() -> None:
    sent = [_record(0x100, i, "public.t", "insert", new=_new(["id"], ["int4"], [i])) for i in range(2)]
    within = _task(0, 0, [sent, sent])  # the same positions again in one task
    assert not within.ordered and not merge_tallies([within]).unique_positions
    across = [_task(0, 0, [sent]), _task(0, 2, [sent])]  # each task rises, the second starts again
    assert all(t.ordered for t in across) and not merge_tallies(across).unique_positions


def _copy(task: TaskTally) -> TaskTally:
    """A task's tally as the driver gets it: a copy (merging must not change the tasks' own)."""
    import pickle

    copied: TaskTally = pickle.loads(pickle.dumps(task))
    return copied


def test_the_first_invalid_record_is_the_lowest_offset_whatever_the_rows_order() -> None:
    """Spark's Kafka source hands a task its offsets in order; a frame shuffled before the
    decoder (a test's, a caller's) does not, and the first invalid record stays the same."""
    batch = pa.RecordBatch.from_arrays(
        [pa.array([b"k", b"k"], pa.binary()), pa.array([b"not json", b"[]"], pa.binary()),
         pa.array([0, 0], pa.int32()), pa.array([5, 3], pa.int64())],
        names=["key", "value", "partition", "offset"],
    )
    task = TaskTally()
    _decode_batch(batch, None, task)
    assert task.invalid == 2 and task.first_invalid is not None and task.first_invalid[:2] == (0, 3)
