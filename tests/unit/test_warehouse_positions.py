"""warehouse.decode.positions_unique: when a load's slice may skip its history's
de-duplication (no services: whether each task rises, and its edges, are made here as the
decoders' tallies make them)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from warehouse.decode import positions_unique

Position = tuple[int, int]


def _first_pass(partitions: list[list[list[Position]]]) -> tuple[bool, list[tuple[int, int, Position]]]:
    """(every task rises, the tasks' edges) for Kafka partitions split into tasks, as the
    decoder marks them: a task's first and last event, with its offset."""
    ordered = True
    edges: list[tuple[int, int, Position]] = []
    for partition, tasks in enumerate(partitions):
        offset = 0
        for task in tasks:
            ordered = ordered and all(b > a for a, b in itertools.pairwise(task))
            if task:
                edges.append((partition, offset, task[0]))
                if len(task) > 1:
                    edges.append((partition, offset + len(task) - 1, task[-1]))
            offset += len(task)
    return ordered, edges


def test_a_topic_written_once_in_commit_order_is_unique() -> None:
    tasks = [[(16, 0), (16, 1), (32, 0)], [(48, 0), (48, 1)]]
    assert _first_pass([tasks]) == (True, [(0, 0, (16, 0)), (0, 2, (32, 0)), (0, 3, (48, 0)), (0, 4, (48, 1))])
    assert positions_unique(_first_pass([tasks])[1])
    assert positions_unique([])


def test_a_transaction_sent_again_in_the_next_task_is_not() -> None:
    # each task rises, but the second one starts where the first one did
    ordered, edges = _first_pass([[[(16, 0), (16, 1)], [(16, 0), (16, 1)]]])
    assert ordered and not positions_unique(edges)


def test_kafka_partitions_whose_ranges_overlap_are_not() -> None:
    assert positions_unique(_first_pass([[[(16, 0), (16, 1)]], [[(32, 0), (48, 0)]]])[1])
    assert not positions_unique(_first_pass([[[(16, 0), (32, 0)]], [[(16, 1), (48, 0)]]])[1])
    assert not positions_unique(_first_pass([[[(16, 0)]], [[(16, 0)]]])[1])


positions = st.tuples(st.integers(0, 6), st.integers(0, 3))


@given(st.lists(st.lists(st.lists(positions, max_size=6), max_size=4), min_size=1, max_size=3))
def test_a_slice_said_unique_holds_each_position_once(partitions: list[list[list[Position]]]) -> None:
    ordered, edges = _first_pass(partitions)
    everything = [p for tasks in partitions for task in tasks for p in task]
    if ordered and positions_unique(edges):
        assert len(everything) == len(set(everything))


@given(st.sets(positions, max_size=30), st.integers(1, 3), st.data())
def test_a_slice_in_commit_order_is_said_unique(found: set[Position], kafka_partitions: int, data: st.DataObject) -> None:
    # the positions in order, cut into Kafka partitions of consecutive ranges, each cut into tasks
    rising = sorted(found)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(rising)), min_size=kafka_partitions - 1,
                                     max_size=kafka_partitions - 1)))
    parts = [rising[a:b] for a, b in zip([0, *cuts], [*cuts, len(rising)], strict=True)]
    partitions = []
    for part in parts:
        inner = sorted(data.draw(st.lists(st.integers(0, len(part)), max_size=3)))
        partitions.append([part[a:b] for a, b in zip([0, *inner], [*inner, len(part)], strict=True)])
    ordered, edges = _first_pass(partitions)
    assert ordered and positions_unique(edges)
