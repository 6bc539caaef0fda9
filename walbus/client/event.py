"""The events a Feed hands out: a ChangeEvent that can be acknowledged or rejected."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Final, Protocol

from aiokafka import TopicPartition

from walbus.client.typed import typed_image
from walbus.contract import ChangeEvent


class _Settler(Protocol):
    @property
    def tp(self) -> TopicPartition: ...

    def ack(self) -> None: ...

    def nack(self, retry_in: float | None, error: BaseException | str | None) -> None: ...

    @property
    def settled(self) -> bool: ...

    @property
    def offset(self) -> int: ...

    @property
    def replayed(self) -> bool: ...

    @property
    def timestamp_ms(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class FeedEvent(ChangeEvent):
    """A :class:`~walbus.contract.ChangeEvent` delivered by a :class:`~walbus.client.Feed`.

    ``attempt`` counts deliveries (1 the first time). ``ack()`` marks it handled; ``nack()``
    asks for it again after ``retry_in`` seconds (default: the feed's retry policy, with
    jitter), and after the policy's last attempt sends it to the group's dead-letter topic.
    Settling twice is a no-op. Without ``auto_ack=False`` the feed acks an event you did not
    settle when you ask for the next one.
    """

    attempt: int = 1
    _settler: _Settler | None = field(default=None, repr=False, compare=False)

    def ack(self) -> None:
        if self._settler is not None:
            self._settler.ack()

    def nack(self, retry_in: float | None = None, *, error: BaseException | str | None = None) -> None:
        if self._settler is not None:
            self._settler.nack(retry_in, error)

    @property
    def settled(self) -> bool:
        return self._settler is None or self._settler.settled

    @property
    def topic(self) -> str | None:
        """The topic the event was read from (None for an event built by hand)."""
        return self._settler.tp.topic if self._settler is not None else None

    @property
    def partition(self) -> int | None:
        """The partition it was read from: positions are kept per partition."""
        return self._settler.tp.partition if self._settler is not None else None

    @property
    def offset(self) -> int | None:
        """Its offset in that partition (None for an event built by hand)."""
        return self._settler.offset if self._settler is not None else None

    @property
    def replayed(self) -> bool:
        """Read from the group's replay topic (a dead letter sent back): not in position order."""
        return self._settler is not None and self._settler.replayed

    @property
    def record_timestamp_ms(self) -> int | None:
        """The Kafka record's timestamp, in ms since the epoch (None for an event built by hand
        or a record without one)."""
        return self._settler.timestamp_ms if self._settler is not None else None

    def typed_row(self) -> dict[str, Any] | None:
        """The new row with Python values (Decimal, datetime, UUID, lists…; see walbus.client.typed)."""
        return typed_image(self.new, self.typmods) if self.new is not None else None

    def typed_identity(self) -> dict[str, Any] | None:
        """The old key (or old row, under ``REPLICA IDENTITY FULL``) with Python values."""
        return typed_image(self.identity, self.typmods) if self.identity is not None else None


_CHANGE_FIELDS = tuple(f.name for f in fields(ChangeEvent))
_set = object.__setattr__
# The FeedEvent's own fields, set on one built by ``contract.decode_event_as`` (which leaves
# them unset): its slots' setters, called directly (the class is frozen).
set_attempt: Final[Callable[[FeedEvent, int], None]] = FeedEvent.__dict__["attempt"].__set__
set_settler: Final[Callable[[FeedEvent, _Settler | None], None]] = FeedEvent.__dict__["_settler"].__set__


def feed_event(event: ChangeEvent, attempt: int, settler: _Settler | None) -> FeedEvent:
    """``event`` as a FeedEvent (fields copied: a frozen dataclass cannot change its class)."""
    out: Any = object.__new__(FeedEvent)
    for name in _CHANGE_FIELDS:
        _set(out, name, getattr(event, name))
    _set(out, "attempt", attempt)
    _set(out, "_settler", settler)
    result: FeedEvent = out
    return result
