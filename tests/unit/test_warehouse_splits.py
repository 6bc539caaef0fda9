"""warehouse.fetch.slice_splits: a load's slice cut into the decoding workers' splits (no
services)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from warehouse.fetch import Split, slice_splits

_ranges = st.dictionaries(
    st.integers(0, 11), st.tuples(st.integers(0, 10**12), st.integers(0, 5000)), max_size=6
)


@given(_ranges, st.integers(0, 64))
def test_the_splits_cover_each_range_once_in_offset_order(ranges: dict[int, tuple[int, int]], parallelism: int) -> None:
    start = {p: lo for p, (lo, _) in ranges.items()}
    end = {p: lo + size for p, (lo, size) in ranges.items()}
    splits = slice_splits(start, end, parallelism)
    assert all(s.end > s.start for s in splits)  # no empty split
    for p in end:
        mine = [s for s in splits if s.partition == p]
        covered = [o for s in mine for o in (s.start, s.end)]
        if end[p] == start[p]:
            assert mine == []
        else:
            assert covered[0] == start[p] and covered[-1] == end[p]
            assert all(a.end == b.start for a, b in itertools.pairwise(mine))  # contiguous
    sized = [p for p in end if end[p] > start[p]]
    assert len(splits) >= len(sized)
    # about ``parallelism`` in all: each partition rounds its share up
    assert len(splits) <= max(parallelism, 1) + len(sized)


def test_a_partition_is_cut_in_proportion_to_its_size() -> None:
    splits = slice_splits({0: 100, 1: 0, 2: 5}, {0: 400, 1: 100, 2: 5}, 4)
    # 300 and 100 records in four: three splits and one
    assert splits == [Split(0, 100, 200), Split(0, 200, 300), Split(0, 300, 400), Split(1, 0, 100)]
    # a partition the load has no start for is read from offset 0
    assert slice_splits({}, {3: 2}, 8) == [Split(3, 0, 1), Split(3, 1, 2)]
