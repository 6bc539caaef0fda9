"""Output-plugin decoders: replication payloads in, encoded contract-v1 events out. No I/O
but catalog look-ups on a relation's first sight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from producer.codec import EncodedEvent


@dataclass(slots=True)
class TxnBegin:
    commit_lsn: int
    xid: int
    timestamp: str


@dataclass(slots=True)
class TxnEnd:
    """A commit: every event before it belongs to the transaction that ``end_lsn`` confirms."""

    commit_lsn: int
    end_lsn: int
    xid: int
    timestamp: str
    commit_unix_us: int
    counts: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(slots=True)
class LogicalMessage:
    """A ``pg_logical_emit_message`` record (snapshot watermarks use these)."""

    lsn: int
    prefix: str
    content: bytes
    transactional: bool


Item = EncodedEvent | TxnBegin | TxnEnd | LogicalMessage


class Decoder(Protocol):
    plugin: str

    def start_options(self, publication: str) -> dict[str, str]: ...

    def decode(self, messages: list[tuple[int, bytes]], out: list[Item]) -> None: ...
