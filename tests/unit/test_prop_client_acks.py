"""The feed's contiguous acks (walbus.client.acks) over any ack order, against the simple model."""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

import tests.support.prop  # noqa: F401 -- the suite's hypothesis profile
from walbus.client.acks import acked_prefix


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


def test_a_retried_event_holds_the_mark_until_it_is_acked() -> None:
    sent = [_Sent(o, (1, o)) for o in (0, 1, 2)]
    waiting: deque[_Sent] = deque(sent)
    sent[0].outcome, sent[1].outcome, sent[2].outcome = "acked", "retry", "acked"
    assert acked_prefix(waiting) == (1, (1, 0))
    assert acked_prefix(waiting) is None
    sent[1].outcome = "acked"
    assert acked_prefix(waiting) == (3, (1, 2)) and not waiting
