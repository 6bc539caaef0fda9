"""Output-plugin decoders: replication payloads in, typed items out (encoded contract-v1
events, transaction bounds, logical messages). No I/O but catalog look-ups on a relation's
first sight."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from producer.codec import ChangeRun, EncodedEvent


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


# The prefix of the logical messages walbus writes (incremental snapshots' watermarks): the only
# ones a decoder needs (wal2json is asked for these only). Any login role may emit a message
# with a prefix it knows, and wal2json renders every message its filter lets through (each byte
# escaped, up to six): ~180 MB under a fixed prefix passed PostgreSQL's 1 GB string limit and
# failed the slot at that record on every reconnect. So the prefix ends with a token of this
# process's own, which no plain role can read (the walsender's command and the watermark's
# bound parameter are hidden to it). A watermark is only ever awaited by the process that
# wrote it (its chunk id is new each time), so earlier processes' ones are rightly left out.
WATERMARK_PREFIX = f"walbus-watermark-{secrets.token_hex(16)}"


@dataclass(slots=True)
class LogicalMessage:
    """A ``pg_logical_emit_message`` record (snapshot watermarks use these)."""

    lsn: int
    prefix: str
    content: bytes
    transactional: bool
    # Its transaction, as the decoder stood when it met the message:
    commit_lsn: int = 0
    xid: int = 0
    seq: int = 0  # events of the transaction before the message
    timestamp: str = ""


Item = EncodedEvent | ChangeRun | TxnBegin | TxnEnd | LogicalMessage


def flat(items: Iterable[Item]) -> Iterator[EncodedEvent | TxnBegin | TxnEnd | LogicalMessage]:
    """``items`` with each :class:`ChangeRun` as its events (tools and tests; the pump takes runs whole)."""
    for item in items:
        if isinstance(item, ChangeRun):
            yield from item.events()
        else:
            yield item


class WalMessages(Protocol):
    """A read's XLogData messages as ``(position, payload)``: a list (the pure-Python reader),
    or walbus_native.Messages (one buffer; a tuple made only for the message that is read,
    and the native run encoders read the buffer itself)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> tuple[int, bytes]: ...


class Decoder(Protocol):
    plugin: str

    def start_options(self, publication: str) -> dict[str, str]: ...

    def decode(self, messages: WalMessages) -> Iterator[Item]:
        """The items of ``messages``, in order (lazily: the caller may await between them)."""
        ...
