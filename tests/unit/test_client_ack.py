"""Pure logic of acknowledgement and parallel delivery: retry delays, order keys, lanes."""

from __future__ import annotations

import random
import shutil
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from walbus.client import RetryPolicy, parallel
from walbus.client.event import feed_event
from walbus.client.parallel import event_lane, lane_of, order_key
from walbus.contract import ChangeEvent, RowImage
from walbus.native import switched_off


def test_retry_delays_grow_are_capped_and_jittered() -> None:
    policy = RetryPolicy(attempts=6, initial=1.0, maximum=8.0, jitter=0.5)
    rng = random.Random(1)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0)]:
        delays = {policy.delay(attempt, rng) for _ in range(50)}
        assert all(base * 0.5 <= d <= base * 1.5 for d in delays)
        assert len(delays) > 1  # jitter: not all the same
    assert RetryPolicy(jitter=0.0).delay(3) == 4.0
    assert not policy.exhausted(5) and policy.exhausted(6)
    for bad in [{"attempts": 0}, {"initial": 5.0, "maximum": 1.0}, {"jitter": 2.0}]:
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


def _event(op: str, table: str = "public.t", pk: tuple[str, ...] = ("id",), new: dict[str, int] | None = None, old: dict[str, int] | None = None) -> ChangeEvent:
    def image(d: dict[str, int] | None) -> RowImage | None:
        return None if d is None else RowImage(tuple(d), ("int4",) * len(d), tuple(d.values()))

    return ChangeEvent(1, 2, 0, 3, op, table, "t", pk, image(new), image(old))  # type: ignore[arg-type]


def test_order_keys() -> None:
    key = order_key(feed_event(_event("insert", new={"id": 1, "a": 5}), 1, None))
    assert key == ("public.t", 1)
    assert order_key(feed_event(_event("update", new={"id": 1, "a": 6}, old={"id": 1}), 1, None)) == key
    assert order_key(feed_event(_event("delete", old={"id": 1}), 1, None)) == key
    assert order_key(feed_event(_event("insert", table="public.u", new={"id": 1}), 1, None)) != key
    # A key change and a truncate are barriers; a table without a primary key is one key.
    assert order_key(feed_event(_event("update", new={"id": 2}, old={"id": 1}), 1, None)) is None
    assert order_key(feed_event(_event("truncate"), 1, None)) is None
    assert order_key(feed_event(_event("insert", pk=(), new={"a": 1}), 1, None)) == ("public.t",)
    composite = order_key(feed_event(_event("insert", pk=("a", "b"), new={"b": 2, "a": 1}), 1, None))
    assert composite == ("public.t", 1, 2)


def test_lanes_are_stable_and_spread() -> None:
    keys = [("public.t", i) for i in range(1000)]
    lanes = [lane_of(k, 8) for k in keys]
    assert lanes == [lane_of(k, 8) for k in keys]
    assert set(lanes) == set(range(8))
    assert 0 <= lane_of(("t", [1, 2]), 8) < 8  # an unhashable value falls back to its text


def _reference_order_key(event: ChangeEvent) -> object:
    """The order key spelled out plainly (what parallel.order_key computes with its caches)."""
    if event.operation == "truncate":
        return None

    def key_in(image: RowImage | None) -> tuple[object, ...] | None:
        if image is None or not event.pk:
            return None
        row = dict(zip(image.columns, image.values, strict=True))  # the last of a repeated name
        return tuple(row[c] for c in event.pk) if all(c in row for c in event.pk) else None

    key = key_in(event.new)
    if key is None and event.pk and event.new is not None and event.operation == "update":
        return None  # its new row lacks a key column (an unchanged TOAST value): a barrier
    if key is None:
        key = key_in(event.identity)
        return (event.table,) if key is None else (event.table, *key)
    old = key_in(event.identity) if event.operation == "update" else None
    return None if old is not None and old != key else (event.table, *key)


_NAMES = st.sampled_from(["id", "a", "b", "é", "a.b"])


@st.composite
def _images(draw: st.DrawFn) -> RowImage | None:
    if draw(st.booleans()):
        return None
    columns = tuple(draw(st.lists(_NAMES, max_size=4)))
    return RowImage(columns, ("int4",) * len(columns), tuple(draw(st.integers(0, 2)) for _ in columns))


@given(st.sampled_from(["insert", "update", "delete", "truncate", "read"]), st.sampled_from(["s.t", "s.u"]),
       st.lists(_NAMES, max_size=3, unique=True), _images(), _images(), st.integers(1, 3))
def test_order_keys_match_the_plain_definition(op: str, table: str, pk: list[str], new: RowImage | None,
                                               ident: RowImage | None, repeat: int) -> None:
    event = feed_event(ChangeEvent(1, 2, 0, 3, op, table, "t", tuple(pk), new, ident), 1, None)  # type: ignore[arg-type]
    reference = _reference_order_key(event)
    native = parallel._native_lanes()
    for _ in range(repeat):  # again: from the caches this time
        assert order_key(event) == reference
        # The compiled lane (walbus_native.OrderLanes): the same key, so the same lane.
        if native is not None:
            assert native.__self__.key(event) == reference  # type: ignore[attr-defined]
        for n in (1, 3, 8):
            assert event_lane(event, n) == (None if reference is None else lane_of(reference, n))  # type: ignore[arg-type]


def test_native_lanes_are_there_where_the_extension_is_built() -> None:
    assert parallel._native_lane is not None or shutil.which("cargo") is None or switched_off()


@given(st.lists(st.one_of(st.integers(), st.text(max_size=3), st.floats(allow_nan=False), st.booleans(), st.none(),
                          st.lists(st.integers(), max_size=2)), min_size=1, max_size=3))
def test_event_lanes_of_any_key_values(values: list[object]) -> None:
    """Any key values, unhashable ones too (the native path raises TypeError and the Python
    one hashes their text): the Python path's lane."""
    columns = tuple(f"k{i}" for i in range(len(values)))
    image = RowImage(columns, ("int4",) * len(columns), tuple(values))
    event = feed_event(ChangeEvent(1, 2, 0, 3, "insert", "s.t", "t", columns, image), 1, None)
    expected = lane_of(("s.t", *values), 7)
    assert event_lane(event, 7) == expected
    assert parallel._python_lane(event, 7) == expected


async def test_a_coroutine_started_by_hand_is_awaited_to_its_end() -> None:
    """parallel._Resume: the rest of a handler the dispatcher started, awaited by a lane's task:
    its result, its exception, values sent back from futures, and cancellation reaching it."""
    import asyncio

    from walbus.client.parallel import _Resume

    log: list[str] = []

    async def work(n: int) -> int:
        got = 0
        for _ in range(n):
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(fut.set_result, 1)
            got += await fut
            await asyncio.sleep(0)  # a bare yield too
        if n == 3:
            raise ValueError("three")
        return got

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            log.append("cleaned up")

    coro = work(2)
    step = coro.send(None)
    assert await _Resume(coro, step) == 2
    coro = work(3)
    with pytest.raises(ValueError, match="three"):
        await _Resume(coro, coro.send(None))
    hanging = slow()
    task = asyncio.ensure_future(_awaits(hanging))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["cleaned up"]


async def _awaits(coro: Coroutine[Any, Any, Any]) -> None:
    from walbus.client.parallel import _Resume

    await _Resume(coro, coro.send(None))
