"""Event positions and how a consumer group remembers them in Kafka.

A position is ``(commit_lsn, seq)``: unique per change and ordered as the commits. The
highest position a group has finished with travels as the metadata string of its committed
offset, so that a restarted consumer recognises records that were written to the topic twice
(the producer is at-least-once) even when they sit *after* the committed offset.
"""

from __future__ import annotations

from walbus.contract import ContractError, event_key, parse_event_key

Position = tuple[int, int]
"""``(commit_lsn, seq)`` of an event."""

_METADATA_PREFIX = "walbus-feed/1:"


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
    if position is None:
        return ""
    return _METADATA_PREFIX + event_key(*position).decode("ascii")


def decode_metadata(text: str | None) -> Position | None:
    """Inverse of :func:`encode_metadata`; None for metadata some other client wrote."""
    if not text or not text.startswith(_METADATA_PREFIX):
        return None
    return position_of_key(text[len(_METADATA_PREFIX) :].encode("ascii", "replace"))


def newest(*positions: Position | None) -> Position | None:
    """The highest of the given positions, ignoring None."""
    known = [p for p in positions if p is not None]
    return max(known) if known else None
