"""The feed's bookkeeping against simple models: contiguous acks over any ack order, order keys."""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, cast

from aiokafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st

import tests.support.prop  # noqa: F401 -- the suite's hypothesis profile
from walbus.client.acks import acked_prefix
from walbus.client.event import feed_event
from walbus.client.feed import Feed, _PartitionState, _Record
from walbus.client.parallel import order_key
from walbus.contract import ChangeEvent, RowImage


@dataclass
class _Sent:
    offset: int
    position: tuple[int, int]
    outcome: str = "pending"


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 5)), min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_contiguous_acks_over_any_ack_order_match_the_simple_model(gaps: list[tuple[int, int]], rng: random.Random) -> None:
    # Offsets with gaps (filtered or duplicate records between deliveries); positions in any
    # order, as on the replay topic.
    sent: list[_Sent] = []
    offset = 0
    for gap, lsn in gaps:
        offset += gap
        sent.append(_Sent(offset, (lsn, offset)))
    waiting: deque[_Sent] = deque(sent)
    order = list(range(len(sent)))
    rng.shuffle(order)
    done: tuple[int, tuple[int, int]] | None = None
    for i in order:
        sent[i].outcome = "acked"
        moved = acked_prefix(waiting)
        prefix = list(itertools.takewhile(lambda s: s.outcome == "acked", sent))
        if moved is not None:
            done = (moved[0], max(moved[1], done[1]) if done is not None else moved[1])
        # The model: the offset after the longest acked prefix, and its highest position.
        expected = (prefix[-1].offset + 1, max(s.position for s in prefix)) if prefix else None
        assert done == expected
        assert list(waiting) == sent[len(prefix) :]
    assert not waiting


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 5)), min_size=1, max_size=40), st.randoms(use_true_random=False),
       st.integers(0, 3))
def test_the_feeds_acks_in_any_order_move_its_done_mark_as_the_model(gaps: list[tuple[int, int]], rng: random.Random, retried: int) -> None:
    """Feed._acked itself (its in-order shortcuts and acked_prefix) over events delivered
    together, acked in any order, some first retried: the done mark is the model's."""
    state = _PartitionState(cast(Any, None), TopicPartition("t", 0), 0, None)
    records: list[_Record] = []
    offset = 0
    for gap, lsn in gaps:
        offset += gap
        records.append(_Record(state, offset, (lsn, offset), None, True, None))
    state.inflight.extend(records)
    order = list(range(len(records)))
    rng.shuffle(order)
    for i in order[:retried]:
        records[i].outcome = "retry"  # out for another attempt: holds the mark until acked
    for i in order[retried:] + order[:retried]:
        Feed._acked(cast(Any, None), records[i])  # uses only the record and its partition's state
        prefix = list(itertools.takewhile(lambda r: r.outcome == "acked", records))
        expected = (prefix[-1].offset + 1, max(r.position for r in prefix)) if prefix else (None, None)
        assert (state.done_offset, state.done_position) == expected
        assert list(state.inflight) == records[len(prefix) :]
    assert not state.inflight


def test_a_retried_event_holds_the_mark_until_it_is_acked() -> None:
    sent = [_Sent(o, (1, o)) for o in (0, 1, 2)]
    waiting: deque[_Sent] = deque(sent)
    sent[0].outcome, sent[1].outcome, sent[2].outcome = "acked", "retry", "acked"
    assert acked_prefix(waiting) == (1, (1, 0))
    assert acked_prefix(waiting) is None
    sent[1].outcome = "acked"
    assert acked_prefix(waiting) == (3, (1, 2)) and not waiting


def _reference_order_key(event: ChangeEvent) -> Hashable | None:
    """The order key as docs/client.md states it, from ChangeEvent.key_values()."""
    if event.operation == "truncate":
        return None
    new = event.new
    if event.operation == "update" and event.pk and new is not None and not set(event.pk) <= set(new.columns):
        return None  # its new row lacks a key column
    key = event.key_values()
    if key is None:
        return (event.table,)
    ident = event.identity
    if event.operation == "update" and ident is not None:
        old = {c: v for c, v in zip(ident.columns, ident.values, strict=True) if c in key}
        if len(old) == len(key) and old != key:
            return None
    return (event.table, *key.values())


# Few names and values, updates often: key changes (barriers) and missing key columns come up.
_cols = st.lists(st.sampled_from(["id", "a", "b", "c"]), max_size=4, unique=True)
_vals = st.sampled_from([1, 2, "x", None])


@st.composite
def _images(draw: st.DrawFn) -> RowImage | None:
    if draw(st.integers(0, 3)) == 0:
        return None
    cols = draw(st.one_of(_cols, _cols.map(lambda c: ["id", *(x for x in c if x != "id")])))
    return RowImage(tuple(cols), ("int4",) * len(cols), tuple(draw(st.lists(_vals, min_size=len(cols), max_size=len(cols)))))


@given(st.sampled_from(["update", "update", "update", "insert", "delete", "truncate", "read"]),
       st.sampled_from([(), ("id",), ("id",), ("id", "a"), ("a",)]), _images(), _images())
def test_order_keys_match_the_documented_rule(operation: str, pk: tuple[str, ...], new: RowImage | None, identity: RowImage | None) -> None:
    event = ChangeEvent(1, 2, 0, 3, operation, "public.t", "t", pk, new, identity)  # type: ignore[arg-type]
    assert order_key(feed_event(event, 1, None)) == _reference_order_key(event)
