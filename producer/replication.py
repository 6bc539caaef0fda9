"""The streaming replication protocol (CopyBoth) over psycopg 3's libpq layer.

Reads XLogData and keepalives, sends standby status updates. No decoding here:
payloads go out as bytes, with the WAL position each one starts at.

Why libpq directly: ``cursor.copy()`` refuses COPY_BOTH, and no SQL can run on a
replication connection while it streams. We drain everything libpq has buffered
on each wake-up before yielding to the event loop, because a client that wakes
once per message doubles the walsender's CPU. A read does not wait for more messages
when it finds only a few: measured, waiting a millisecond to coalesce them cost the
wal2json producer a third of its throughput on a busy machine (docs/producer.md).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass

import psycopg
from psycopg import pq

from producer.decoders import WalMessages
from producer.native import copy_reader, new_messages
from producer.session import session_options
from walbus.contract import Lsn

log = logging.getLogger("walbus.producer.replication")

# Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
PG_EPOCH_OFFSET_US = 946_684_800_000_000

_XLOGDATA = struct.Struct(">QQq")  # data_start, wal_end, send_time
_KEEPALIVE = struct.Struct(">QqB")  # wal_end, send_time, reply_requested
_FEEDBACK = struct.Struct(">cQQQqB")  # 'r', written, flushed, applied, client_time, reply
_LIMIT = 1  # a read took as many messages as it was asked for
_MALFORMED = 2  # the native reader met an XLogData or keepalive shorter than its header
# pull()s between two reads: what libpq may hold beyond a read's limit is at most this many
# socket buffers. Measured (bench.producer, Unix socket): one pull per run of 512 changes
# took W1 from 0.55-0.60 to 0.64-0.68 of pg_recvlogical (docs/producer.md, stop 29).
PULLS_PER_READ = 16



def quote_ident(name: str) -> str:
    """A name as a double-quoted SQL identifier (replication commands cannot use psycopg's
    ``sql.Identifier``, which needs a normal connection to render)."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class ReplicationError(Exception):
    """The replication stream failed (connection lost, server error)."""


def pg_now_us() -> int:
    return int(time.time() * 1_000_000) - PG_EPOCH_OFFSET_US


@dataclass
class StreamPosition:
    """What the server told us: the end of WAL it has sent (``wal_end``)."""

    wal_end: int = 0
    reply_requested: bool = False


class ReplicationStream:
    """One ``START_REPLICATION SLOT … LOGICAL`` stream on its own connection."""

    def __init__(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self.position = StreamPosition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._reading: asyncio.Future[None] | None = None  # a read waiting for data: wake() ends it
        self._copy_reader = copy_reader()  # libpq's messages taken in one native call, or None
        # What a native read fills: one buffer, no object a message (None: lists of tuples).
        self._new_messages = new_messages() if self._copy_reader is not None else None
        self._pulls_left = 0  # pull()s allowed before the next read

    @classmethod
    def connect(cls, dsn: str, *, application_name: str = "walbus") -> ReplicationStream:
        conn = psycopg.connect(dsn, replication="database", autocommit=True, application_name=application_name,
                               options=session_options(dsn))
        return cls(conn)

    def execute(self, command: str) -> list[tuple[object, ...]]:
        """Run a replication command (CREATE_REPLICATION_SLOT, …) before streaming starts."""
        cur = self._conn.execute(command.encode())
        return cur.fetchall() if cur.description else []

    def start(self, slot: str, start_lsn: int, options: dict[str, str]) -> None:
        opts = ", ".join(f"{quote_ident(k)} {quote_literal(v)}" for k, v in options.items())
        command = f'START_REPLICATION SLOT {quote_ident(slot)} LOGICAL {Lsn(start_lsn)}' + (f" ({opts})" if opts else "")
        self._pgconn.send_query(command.encode())
        res = self._pgconn.get_result()
        if res is None or res.status != pq.ExecStatus.COPY_BOTH:
            msg = res.error_message.decode(errors="replace") if res is not None else "no result"
            raise ReplicationError(f"START_REPLICATION failed: {msg.strip()}")
        self._pgconn.nonblocking = 1
        self._loop = asyncio.get_running_loop()
        log.info("replication started", extra={"slot": slot, "from_lsn": str(Lsn(start_lsn))})

    def _consume(self) -> None:
        try:
            self._pgconn.consume_input()
        except psycopg.OperationalError as e:
            raise ReplicationError(f"replication connection lost: {e}") from e

    async def _wait(self, timeout: float = 1.0, *, write: bool = False) -> None:
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self._pgconn.socket

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        if write:
            self._loop.add_writer(fd, ready)
        else:
            self._loop.add_reader(fd, ready)
            self._reading = fut
        try:
            await asyncio.wait_for(fut, timeout=timeout)
        except TimeoutError:
            pass
        finally:
            if write:
                self._loop.remove_writer(fd)
            else:
                self._loop.remove_reader(fd)
                self._reading = None

    def pull(self) -> None:
        """Move what the kernel holds for the connection into libpq's buffer, without waiting.

        The walsender flushes each message as its own write, so the socket's buffer holds only
        a few hundred of them (a Unix socket counts each write's kernel overhead against the
        server's send buffer); once it is full the walsender waits. A caller that works through
        a read pulls now and then, so the walsender goes on meanwhile. Bounded: at most
        PULLS_PER_READ pulls (each at most the socket's buffer) after a read that emptied
        libpq's buffer, none after one that stopped at its limit (a backlog is there already)."""
        if self._pulls_left > 0:
            self._pulls_left -= 1
            self._consume()

    def wake(self) -> None:
        """End a read's wait for data now: something else wants the caller's attention (Kafka
        acknowledged a batch, so the slot may be confirmed further)."""
        fut = self._reading
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def read(self, max_messages: int = 20000, timeout: float = 1.0) -> WalMessages:
        """Every XLogData message available now (waiting up to ``timeout`` for the first).

        Returns ``(data_start, payload)`` pairs (walbus_native.Messages when the native reader
        is there, else a list); empty when idle (keepalives are absorbed into :attr:`position`).
        """
        out: WalMessages = self._new_messages() if self._new_messages is not None else []
        waited = False
        refilled = False
        while True:
            status = self._take(out, max_messages - len(out))
            if status == _LIMIT:
                self._pulls_left = 0  # libpq holds more already: no pulls until it is drained
                return out
            self._pulls_left = PULLS_PER_READ  # libpq's buffer is empty: pulls may refill it
            if status != 0:
                self._stream_ended(status)
            if out and not refilled:
                # Whatever the kernel already holds costs no wait: take it too.
                refilled = True
                self._consume()
                continue
            if out or waited:
                return out
            await self._wait(timeout)
            waited = True
            self._consume()

    def _take(self, out: WalMessages, limit: int) -> int:
        """Move up to ``limit`` XLogData messages libpq holds into ``out`` (keepalives into
        :attr:`position`); 1 at the limit, else get_copy_data's 0 (no more now), -1 or -2."""
        reader = self._copy_reader
        if reader is not None:
            ptr: int | None = getattr(self._pgconn, "pgconn_ptr", None)  # None once closed
            if not ptr:
                raise ReplicationError("replication connection closed")
            status, wal_end, reply = reader.read(ptr, out, limit)
            if wal_end > self.position.wal_end:
                self.position.wal_end = wal_end
            if reply:
                self.position.reply_requested = True
            if status == _MALFORMED:
                raise ReplicationError("the server sent a replication message shorter than its header")
            return status
        assert isinstance(out, list)  # the pure-Python reader's reads are lists
        pgconn = self._pgconn
        taken = 0
        while taken < limit:
            nbytes, data = pgconn.get_copy_data(1)
            if nbytes <= 0:
                return nbytes
            kind = data[0]
            if kind == 0x77:  # 'w' XLogData
                # XLogData's own wal_end is only the write position; the server's
                # progress (sentPtr) comes with keepalives.
                out.append((_XLOGDATA.unpack_from(data, 1)[0], bytes(data[25:])))
                taken += 1
            elif kind == 0x6B:  # 'k' keepalive
                wal_end, _, reply = _KEEPALIVE.unpack_from(data, 1)
                if wal_end > self.position.wal_end:
                    self.position.wal_end = wal_end
                if reply:
                    self.position.reply_requested = True
        return _LIMIT

    def _stream_ended(self, status: int) -> None:
        """-1: the COPY ended (server shut down the stream); -2: error."""
        pgconn = self._pgconn
        res = pgconn.get_result()
        detail = res.error_message.decode(errors="replace").strip() if res is not None else ""
        raise ReplicationError(
            f"replication stream ended: {detail or pgconn.error_message.decode(errors='replace').strip() or 'server closed the stream'}"
        )

    async def send_feedback(self, flushed: int, *, reply: bool = False) -> None:
        """Standby status update: everything up to ``flushed`` may be forgotten by the slot."""
        msg = _FEEDBACK.pack(b"r", flushed, flushed, flushed, pg_now_us(), 1 if reply else 0)
        pgconn = self._pgconn
        try:
            while pgconn.put_copy_data(msg) == 0:
                await self._wait(write=True)
            while pgconn.flush() == 1:
                await self._wait(write=True)
        except psycopg.OperationalError as e:
            raise ReplicationError(f"replication connection lost while sending feedback: {e}") from e
        self.position.reply_requested = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.close()
        except Exception:  # closing a broken connection must not mask the original error
            log.debug("error closing replication connection", exc_info=True)
