"""Where one source partition stands: its committed offset, the next record to process, the last event.

The committed offset is read only after the partition's producer fenced the previous
owner (demux.transaction), so it is final. The highest event key processed (replay
detection: the producer is at-least-once) is committed with it, as the offset's
metadata, in the same transaction. A group committed by a demux that did not write it
is started LOOK_BACK records before its offset instead: those records are not processed
again, but the highest event key among them tells where processing stood (unless a
re-send longer than that was in progress).
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition

from walbus.aiokafka_shortcuts import SourceRecord
from walbus.contract import (
    ContractError,
    check_key,
    decode_event,
    key_metadata,
    metadata_key,
    parse_event_key,
)

# Source records read again before a committed offset without metadata, to learn the last position.
LOOK_BACK = 1000
# Offset-commit metadata: the highest event key processed (walbus.contract.key_metadata).
METADATA_PREFIX = "walbus-demux/1:"


def checkpoint_text(group: str, tp: TopicPartition, offset: int | None) -> str:
    """The last-row store's checkpoint for a committed offset (None: nothing committed yet)."""
    return f"{group}|{tp.topic}|{tp.partition}|{-1 if offset is None else offset}"


class Positions:
    """The partition's offsets and the highest event key processed (byte order is event order)."""

    def __init__(self, group: str, tp: TopicPartition) -> None:
        self.group = group
        self.tp = tp
        self.committed: int | None = None
        # Below it: already processed (the look-back after a seek, or fetched before a seek).
        self.next_offset: int | None = None
        self.last_key: bytes | None = None
        # Looking back for the last record before the committed offset (resumed_in): an old group.
        self.probing = False
        self._before: bytes | None = None

    async def start(self, consumer: AIOKafkaConsumer, committed: tuple[int, str] | None) -> int | None:
        """Seek the consumer to the group's committed (offset, metadata); a little before it
        when the metadata does not say the last position (committed by an older demux)."""
        offset, metadata = committed or (None, None)
        self.committed = self.next_offset = offset
        self.last_key = None if offset is None else metadata_key(metadata, METADATA_PREFIX)
        self._before = None
        self.probing = bool(offset) and self.last_key is None
        if offset is None:
            await consumer.seek_to_beginning(self.tp)
        elif self.probing:
            consumer.seek(self.tp, max(0, offset - LOOK_BACK))
        else:
            consumer.seek(self.tp, offset)
        return offset

    def resumed_at(self) -> int | None:
        """The commit LSN of the last event processed, when the metadata told it: the partition
        resumes inside that transaction when its next event has the same commit LSN."""
        return None if self.probing or self.last_key is None else parse_event_key(self.last_key)[0]

    def metadata(self) -> str:
        """The committed offset's metadata: the last position, once known (not while the
        look-back that learns it is incomplete: then the next start looks back again)."""
        return "" if self.probing else key_metadata(METADATA_PREFIX, self.last_key)

    def resumed_in(self, messages: list[SourceRecord]) -> int | None:
        """While :attr:`probing`: the commit LSN of the last record before the committed offset,
        once the first record at or after it comes (then probing ends); None until then, and
        when that record is no event. The partition resumes inside that transaction when its
        next event has the same commit LSN."""
        committed = self.committed
        assert committed is not None
        for m in messages:
            if m.offset < committed:
                self._before = m.key
                continue
            self.probing = False
            if self._before is None:
                return None
            try:
                return parse_event_key(self._before)[0]
            except ContractError:
                return None
        return None

    def checkpoint(self) -> str:
        """The store's checkpoint text once the offsets up to next_offset are committed."""
        return checkpoint_text(self.group, self.tp, self.next_offset)

    def is_replay(self, key: bytes) -> bool:
        """An event at or before the last one processed (the producer sends again after its restart)."""
        return self.last_key is not None and key <= self.last_key

    def advance(self, offset: int) -> None:
        self.next_offset = offset + 1


def at_position(key: bytes | None, value: bytes | None) -> bool:
    """Whether a record is a valid event whose key is its own position (looked-back records only)."""
    if key is None or value is None:
        return False
    try:
        check_key(key, decode_event(value))
    except ContractError:
        return False
    return True
