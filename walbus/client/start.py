"""Where a consumer group without committed offsets (or a group-less feed) starts reading.

``"latest"`` (the default, like binding a new queue: only what happens from now on),
``"earliest"`` (the whole retained history), a commit LSN (an :class:`~walbus.contract.Lsn`,
an ``int`` or its ``"16/B374D848"`` text: events with ``commit_lsn >= lsn``) or an aware
``datetime`` / ISO 8601 text (records the producer wrote at or after it: Kafka's record
timestamp, set when the producer sent the record, shortly after the commit).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from walbus.client.positions import Position
from walbus.contract import Lsn

StartAt = Literal["latest", "earliest"] | int | datetime | str
Start = Literal["latest", "earliest"] | Lsn | datetime

_MAX_SEQ = 0xFFFFFFFF


def parse_start(value: StartAt) -> Start:
    """The start position a :class:`~walbus.client.Feed` argument names; ``ValueError`` if none."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(f"start={value!r}: give an aware datetime (with a time zone)")
        return value
    if isinstance(value, bool):
        raise ValueError(f"start={value!r}: give 'latest', 'earliest', a commit LSN or a datetime")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"start={value!r}: an LSN is not negative")
        return Lsn(value)
    if value in ("latest", "earliest"):
        return value  # type: ignore[return-value]  # narrowed by the test above
    if "/" in value:
        return Lsn.parse(value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"start={value!r}: give 'latest', 'earliest', a commit LSN (16/B374D848) or an ISO 8601 time") from None
    return parse_start(moment)


def start_floor(start: Start) -> Position | None:
    """For an LSN start: the mark below which events are skipped (every ``commit_lsn < lsn``)."""
    if isinstance(start, Lsn) and start > 0:
        return (start - 1, _MAX_SEQ)
    return None
