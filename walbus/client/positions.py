"""Event positions and how a consumer group remembers them in Kafka.

A position is ``(commit_lsn, seq)``: unique per change and ordered as the commits. The
highest position a group has finished with travels as the metadata string of its committed
offset, so that a restarted consumer recognises records that were written to the topic twice
(the producer is at-least-once) even when they sit *after* the committed offset.

Positions move only on valid events whose key is their own ``(commit_lsn, seq)``
(:func:`valid_event`): one record with a high key and a broken value must not make every
later event look like a replay. Metadata of version 1 was written by feeds that did not
check this, so it is only a claim to verify (see ``Feed``); version 2 is trusted.
"""

from __future__ import annotations

from typing import TypeVar

from walbus.contract import (
    ChangeEvent,
    ContractError,
    decode_keyed_event_as,
    event_key,
    key_metadata,
    metadata_key,
    parse_event_key,
)

Position = tuple[int, int]
"""``(commit_lsn, seq)`` of an event."""

_METADATA_PREFIX = "walbus-feed/2:"
_LEGACY_METADATA_PREFIX = "walbus-feed/1:"


_E = TypeVar("_E", bound=ChangeEvent)


def valid_event(key: bytes | None, value: bytes | None) -> ChangeEvent:
    """The event of a database-topic record whose key is its own position; else :class:`ContractError`."""
    return valid_event_as(key, value, ChangeEvent)


def valid_event_as(key: bytes | None, value: bytes | None, cls: type[_E]) -> _E:
    """:func:`valid_event` as an instance of ``cls`` (``contract.decode_event_as``)."""
    return decode_keyed_event_as(key, value, cls)


def position_of_key(key: bytes | None) -> Position | None:
    """The position carried by a database-topic key, or None when the key is not one."""
    if key is None:
        return None
    try:
        return parse_event_key(key)
    except ContractError:
        return None


def encode_metadata(position: Position | None) -> str:
    """Offset-commit metadata for a position (empty when nothing was read yet)."""
    return key_metadata(_METADATA_PREFIX, None if position is None else event_key(*position))


def _decode(text: str | None, prefix: str) -> Position | None:
    return position_of_key(metadata_key(text, prefix))


def decode_metadata(text: str | None) -> Position | None:
    """Inverse of :func:`encode_metadata`; None for metadata some other client wrote."""
    return _decode(text, _METADATA_PREFIX)


def decode_legacy_metadata(text: str | None) -> Position | None:
    """The position in version-1 metadata: unchecked, it may come from an invalid record."""
    return _decode(text, _LEGACY_METADATA_PREFIX)


def newest(*positions: Position | None) -> Position | None:
    """The highest of the given positions, ignoring None."""
    known = [p for p in positions if p is not None]
    return max(known) if known else None
