"""Incremental snapshots (DBLog watermarks): tables read in chunks while streaming goes on.

The design, and why it is exact: docs/producer.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import orjson
import psycopg
from psycopg import sql

from producer import setup
from producer.codec import CaptureFilter, EncodedEvent, EventEncoder, Key, Relation
from producer.config import ProducerConfig
from producer.decoders import WATERMARK_PREFIX, LogicalMessage
from producer.metrics import SnapshotMetrics
from producer.offsets import OffsetStore
from producer.session import session_options
from producer.signal_topic import TopicSignal
from producer.tablescan import (
    ScanTable,
    convert_fields,
    describe_table,
    duplicate_key_query,
    fetch_fields,
    key_text,
    key_unique_indexed,
    max_key_query,
    null_key_query,
    nullable_key_columns,
    select_chunk,
    table_identity,
)
from walbus.contract import ContractError, qualify_table, split_table
from walbus.retry import Backoff

log = logging.getLogger("walbus.producer.incremental")

WATERMARK_LOG_EVERY_S = 60.0  # malformed watermark messages: one log line a minute at most
MAX_SIGNAL_TABLES = 1000  # tables one execute-snapshot signal may list (docs/contract.md)
MAX_FILTER_CHARS = 64 * 1024  # all additional-conditions filters of one signal: they are kept in the progress record
KIND = "incremental"
SYNC_REP_WAIT_S = 5.0  # a chunk waits this long for transactions awaiting synchronous replication, then is retried
# A change whose key the stream does not carry (see ChunkWindow.observe_unknown) makes its
# chunk be read again; this many times in a row, and the table is given up (said, counted).
CHUNK_REREADS = 20
# Stands for a key the stream did not carry, in ChunkWindow and RecentChanges.
UNKNOWN_KEY: Final[Key] = (object(),)


class LogLimit:
    """At most one log line per ``every_s`` seconds; the lines held back are counted and the
    next line says how many. Pure: the clock is injected."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self._clock = every_s, clock
        self._last: float | None = None
        self._held = 0

    def allow(self) -> int | None:
        """None: hold this line back; else the number of lines held back before it."""
        now = self._clock()
        if self._last is not None and now - self._last < self.every_s:
            self._held += 1
            return None
        held, self._held, self._last = self._held, 0, now
        return held


class ChunkDeferred(RuntimeError):
    """The chunk cannot be read exactly now; it is retried with backoff."""


class ChunkWindow:
    """The watermark rule for one chunk. Pure: no I/O, driven by what the stream decodes.

    ``low()`` opens the window, ``observe(key)`` records a streamed change of the chunk's
    table, ``truncate()`` a TRUNCATE of it, ``high(rows)`` closes the window and returns the
    rows to emit: those whose key no change in the window mentioned.
    """

    def __init__(self) -> None:
        self.is_open = False
        self.closed = False
        self._seen: set[Key] = set()
        self._truncated = False

    def low(self) -> None:
        if not self.closed:
            self.is_open = True

    def observe(self, key: Key) -> None:
        if self.is_open:
            self._seen.add(key)

    def truncate(self) -> None:
        if self.is_open:
            self._truncated = True

    def observe_unknown(self) -> None:
        """A change of a row whose key the stream does not carry: an update under REPLICA
        IDENTITY DEFAULT that left a TOASTed key column unchanged (sent as "unchanged", no old
        key). Any row of the chunk may be that row, read before the change: see :attr:`blind`."""
        if self.is_open:
            self._seen.add(UNKNOWN_KEY)

    @property
    def blind(self) -> bool:
        """Whether the window saw a change of an unknown row: the chunk must be read again
        (a read of the row's older value would come after its change and undo it)."""
        return UNKNOWN_KEY in self._seen

    def high(self, rows: Iterable[tuple[Key, Any]], unseen: Set[Key] = frozenset()) -> list[Any]:
        """``unseen``: keys changed by transactions the stream passed before the low watermark
        that the chunk's snapshot did not see yet (:class:`RecentChanges`); dropped too."""
        if not self.is_open:
            raise RuntimeError("high watermark before the low one")
        self.is_open = False
        self.closed = True
        if self._truncated:
            return []
        seen = self._seen
        return [row for key, row in rows if key not in seen and key not in unseen]

    @property
    def keys_seen(self) -> int:
        return len(self._seen)


class RecentChanges:
    """The keys of one table each recent transaction changed, by xid, as the stream passed them.

    Why: PostgreSQL writes a commit's WAL record before the commit becomes visible to new
    snapshots (the committing backend still has to flush, update the commit log and leave the
    process array). A transaction can so come before a chunk's low watermark in the WAL and
    still be invisible to the chunk's snapshot: its changes are in neither the chunk's rows
    nor its window, and a read of a key it deleted or updated would come after its event and
    undo it. The chunk's snapshot names the transactions it does not see (its xip list);
    the keys those of them changed before the low watermark are dropped from the chunk.

    Pure: no I/O. ``mark`` counts transactions noted so far; kept: the last ``keep_s`` seconds
    of them, at most ``max_keys`` keys (the oldest go first; the newest stays, however large).
    """

    def __init__(
        self, table: str, *, keep_s: float = 30.0, max_keys: int = 200_000, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self._keep_s, self._max_keys, self._clock = keep_s, max_keys, clock
        self._entries: dict[int, tuple[int, float, set[Key]]] = {}  # xid: (order, when, keys), oldest first
        self._keys = 0
        self.mark = 0

    def note(self, xid: int, keys: Iterable[Key]) -> None:
        entry = self._entries.get(xid)
        if entry is None:
            self.mark += 1
            entry = self._entries[xid] = (self.mark, self._clock(), set())
        changed = entry[2]
        before = len(changed)
        changed.update(keys)
        self._keys += len(changed) - before
        if self._keys > self._max_keys:
            self.prune()

    def keys_before(self, xids: Iterable[int], mark: int) -> set[Key]:
        """The keys changed by transactions among ``xids`` noted up to ``mark``."""
        out: set[Key] = set()
        for xid in xids:
            entry = self._entries.get(xid)
            if entry is not None and entry[0] <= mark:
                out |= entry[2]
        return out

    def prune(self) -> None:
        oldest = self._clock() - self._keep_s
        entries = self._entries
        while len(entries) > 1:  # the newest stays, however large: it may be the one being noted
            xid, (_, when, keys) = next(iter(entries.items()))
            if when >= oldest and self._keys <= self._max_keys:
                break
            del entries[xid]
            self._keys -= len(keys)

    def __len__(self) -> int:
        return len(self._entries)


def snapshot_xip(text: str) -> frozenset[int]:
    """The transactions ``pg_current_snapshot()``'s text (``xmin:xmax:xip,…``) lists as in
    progress, as the stream's 32-bit xids."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"not a pg_snapshot: {text!r}")
    return frozenset(int(x) & 0xFFFFFFFF for x in parts[2].split(",") if x)


@dataclass
class Position:
    """Where an incremental snapshot stands; saved in the progress store."""

    signal_id: str
    tables: list[str]  # left to read, the first one is being read
    last_key: list[str] | None = None  # of tables[0]: the last key emitted (text output)
    max_key: list[str] | None = None  # of tables[0]: the largest key when its reading began
    total_tables: int = 0
    started_at: str = ""
    rows: int = 0
    filters: dict[str, str] = field(default_factory=dict)  # table: its additional-conditions filter (SQL)
    paused: bool = False  # pause-snapshot: no chunk is read until resume-snapshot
    # Every execute-snapshot merged into this one after the first (signal_id): a replay of
    # one of them must not queue again a table this snapshot has finished.
    merged_signals: list[str] = field(default_factory=list)
    # Of tables[0], when max_key was read: its pg_class oid and its key's columns and types
    # (ScanTable.key_types). The keys above are text: they mean the same rows, in the same
    # order, only while these hold (see IncrementalSnapshot._check_identity). None in a
    # position saved before they existed: the table's are taken at its next chunk.
    table_oid: int | None = None
    key_types: list[str] | None = None

    def forget_table(self) -> None:
        """The progress of tables[0] goes: another table is first, or it is read again."""
        self.last_key = self.max_key = None
        self.table_oid = self.key_types = None

    def handled(self, sig_id: str) -> bool:
        return sig_id == self.signal_id or sig_id in self.merged_signals

    @classmethod
    def load(cls, doc: dict[str, Any] | None) -> Position | None:
        # Fields a later version added are left out: a downgraded producer still resumes.
        return None if not doc else cls(**{k: v for k, v in doc.items() if k in cls.__dataclass_fields__})


@dataclass
class Chunk:
    id: str
    table: str
    after: list[str] | None
    window: ChunkWindow = field(default_factory=ChunkWindow)
    scan: ScanTable | None = None
    rows: list[tuple[Key, list[Any]]] = field(default_factory=list)
    last_key: list[str] | None = None
    max_key: list[str] | None = None
    where: str | None = None  # the table's additional-conditions filter
    exhausted: bool = False
    skip_reason: str | None = None
    partitions: list[str] | None = None  # a partitioned table's leaf partitions: read instead of it
    failure: str | None = None  # the table's query failed (not the connection): given up, not retried
    bad_key: bool = False  # the failure: rows' keys hold NULL or repeat (not the filter's fault)
    invisible: frozenset[int] = frozenset()  # xids the chunk's snapshot saw in progress (32-bit)
    low_mark: int = 0  # RecentChanges.mark when the low watermark came
    table_oid: int | None = None  # Position.table_oid, then the table's as read
    # The table's lock was not granted within --incremental-lock-timeout: the sessions holding
    # or awaiting an ACCESS EXCLUSIVE lock on it (pid, user, application, granted).
    locked: list[dict[str, Any]] | None = None
    key_types: list[str] | None = None  # Position.key_types, then the table's as read


class IncrementalSnapshot:
    """Signals, chunks and positions; hooked into the producer's pump."""

    def __init__(
        self, config: ProducerConfig, capture: CaptureFilter, *, offsets: OffsetStore, metrics: SnapshotMetrics,
    ) -> None:
        self.config = config
        self.capture = capture
        self.offsets = offsets
        self.metrics = metrics
        self.chunk_size = max(1, config.incremental_chunk_size)
        self._saved = offsets.doc.get("incremental")
        self.position = Position.load(self._saved)
        self._done_signals: list[str] = list(offsets.doc.get("incremental_done") or [])
        self._chunk: Chunk | None = None
        self._recent: RecentChanges | None = None  # of the table being read, while it is
        self._task: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self._rereads = 0  # the chunk read again in a row (see _read_again)
        self._backoff = Backoff(initial=2.0, maximum=60.0)  # a lost connection or a failover: retried forever
        self._lock_backoff = Backoff(initial=1.0, maximum=60.0)  # a table locked by another session
        self._watermark_log = LogLimit(WATERMARK_LOG_EVERY_S)
        self._pending: list[list[Any]] = []  # [end_lsn | None, position doc | None], in order
        self._eager = False  # a signal changed the position in the transaction being decoded
        self._save_task: asyncio.Task[None] | None = None
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._relids = 1 << 30  # relids of our own relations, out of pgoutput's way
        self._started = time.monotonic()
        self._filter_role: str | None = None  # the role filtered chunks run as; "" for the producer's own
        # The signal topic's next offset to read; saved with the position, so a signal's
        # effect and its consumption are durable together (exactly once across restarts).
        # An offset of another topic (--signal-topic changed) means nothing here.
        same_topic = config.signal_topic is not None and offsets.doc.get("signal_topic") == config.signal_topic
        self._saved_signal_offset: int | None = offsets.doc.get("signal_offset") if same_topic else None
        self.signal_offset = self._saved_signal_offset
        if self.position is not None:
            self.metrics.begin(KIND, self.position.total_tables or len(self.position.tables))
            self.metrics.tables_remaining.labels(KIND).set(len(self.position.tables))
            self.metrics.paused.labels(KIND).set(int(self.position.paused))
            log.info(
                "incremental snapshot resumed",
                extra={"signal": self.position.signal_id, "table": self.position.tables[0] if self.position.tables else None,
                       "after_key": self.position.last_key, "tables_left": self.position.tables, "paused": self.position.paused},
            )

    # -- session -----------------------------------------------------------------------------

    def reset(self) -> None:
        """A new stream session replays from the slot's confirmed position: forget the chunk in
        flight and anything not confirmed, go back to the last confirmed position."""
        self._chunk = None
        self._recent = None
        self._pending = []
        self.position = Position.load(self._saved)
        self.signal_offset = self._saved_signal_offset
        self.metrics.paused.labels(KIND).set(int(self.position is not None and self.position.paused))

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()

    # -- hooks from the pump -----------------------------------------------------------------

    def watches(self, rel: Relation) -> bool:
        """Whether :meth:`observe` needs ``rel``'s events (the signal table, the table being
        read): the pump hands the others over without an EncodedEvent each."""
        table = rel.qualified
        recent = self._recent
        return table == self.capture.signal_table or (recent is not None and table == recent.table)

    def observe(self, ev: EncodedEvent, xid: int) -> None:
        """Every streamed event (of transaction ``xid``): signals, the keys of the table being
        read (its open window's, and each transaction's for :class:`RecentChanges`)."""
        table = ev.relation.qualified
        if table == self.capture.signal_table:
            row = ev.row()
            if ev.operation == "insert" and row is not None:
                self._signal_row(row, ev.key)
        recent = self._recent
        if recent is None or table != recent.table:
            return
        chunk = self._chunk
        window = chunk.window if chunk is not None and chunk.window.is_open else None
        if ev.operation == "truncate":
            if window is not None:
                window.truncate()
            return
        keys = ev.primary_keys()
        if not keys and ev.relation.pk_index and ev.operation == "update":
            keys = [UNKNOWN_KEY]  # its key column(s) unchanged and TOASTed: see ChunkWindow.observe_unknown
        recent.note(xid, keys)
        if window is not None:
            for key in keys:
                window.observe(key)

    def on_message(self, msg: LogicalMessage, partitioned: bool) -> list[EncodedEvent]:
        """A logical decoding message; at our chunk's high watermark, its reads."""
        if msg.prefix != WATERMARK_PREFIX or not msg.transactional:
            return []
        try:
            mark = orjson.loads(msg.content)
        except orjson.JSONDecodeError:
            mark = None
        if not isinstance(mark, dict):
            # Any login role may write such a message: it must never stop the stream.
            self._ignore("watermark", "not a JSON object", lsn=msg.lsn, content=msg.content[:200].decode(errors="replace"))
            return []
        chunk = self._chunk
        if chunk is None or mark.get("id") != chunk.id:
            return []  # a watermark of an earlier process or of a chunk abandoned since
        if mark.get("kind") == "low":
            chunk.window.low()
            chunk.low_mark = self._recent.mark if self._recent is not None else 0
            return []
        return self._complete(chunk, msg, partitioned)

    def on_commit(self, end_lsn: int) -> bool:
        """A transaction ended. True: a signal changed the position in it, call :meth:`save_now`
        before the commit may be confirmed."""
        for p in self._pending:
            if p[0] is None:
                p[0] = end_lsn
        return self.take_eager()

    def take_eager(self) -> bool:
        """True (once) when a signal changed the position since the last call: the caller
        waits for Kafka's acks, then :meth:`save_now`."""
        eager, self._eager = self._eager, False
        return eager

    async def save_now(self) -> None:
        """Save the latest position at once (signals: they must outlive the slot's confirmation).
        The caller first waits until Kafka acknowledged everything appended: the latest position
        may include chunks whose reads were still in flight."""
        if self._pending:
            _, doc = self._pending[-1]
            self._pending.clear()
            await self._save(doc)

    async def tick(self, confirmed_lsn: int) -> None:
        """Between batches: save what Kafka acknowledged, start the next chunk."""
        task = self._save_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            # Saved again with the next position; until then a restart resumes from the last one saved.
            log.warning("saving the incremental snapshot position failed", extra={"error": repr(task.exception())})
            self._save_task = None
        ready = [p for p in self._pending if p[0] is not None and p[0] <= confirmed_lsn]
        if ready and (self._save_task is None or self._save_task.done()):
            self._pending = self._pending[len(ready):]
            self._save_task = asyncio.create_task(self._save(ready[-1][1]))
        pos = self.position
        if pos is not None and pos.tables and (self._recent is None or self._recent.table != pos.tables[0]):
            # From before its first chunk and while paused too: see RecentChanges.
            self._recent = RecentChanges(pos.tables[0])
        if self._recent is not None:
            self._recent.prune()
        # self._eager: a signal of the transaction still being decoded changed the position;
        # its later signals (a pause, a stop) apply before a chunk starts, not after one did.
        # A chunk abandoned by stop-snapshot may still be reading, on the one connection the
        # next chunk would use ("another command is already in progress"): let it end first.
        reading = self._task is not None and not self._task.done()
        if pos is not None and not pos.paused and self._chunk is None and not reading and not self._eager \
                and time.monotonic() >= self._retry_at:
            self._start_chunk()

    async def save_confirmed(self, confirmed_lsn: int) -> None:
        """On a graceful stop: the position Kafka acknowledged is saved before exiting (else
        the next start would resume from an older one, redoing chunks or a finished snapshot)."""
        task = self._save_task
        if task is not None:
            with contextlib.suppress(Exception):
                await task
        ready = [p for p in self._pending if p[0] is not None and p[0] <= confirmed_lsn]
        if ready:
            self._pending = self._pending[len(ready):]
            try:
                await self._save(ready[-1][1])
            except Exception as e:  # the next start resumes from the last position saved
                log.warning("saving the incremental snapshot position failed", extra={"error": repr(e)})

    # -- signals -----------------------------------------------------------------------------

    def _ignore(self, kind: str, reason: str, **details: Any) -> None:
        self.metrics.ignored.labels(kind).inc()
        if kind == "watermark":
            # Any login role may emit a logical message with our prefix, as often as it likes:
            # not an error of ours, and it must not flood the log (550 error lines in a fuzz run).
            held = self._watermark_log.allow()
            if held is not None:
                log.warning(f"{kind} ignored: {reason}", extra={"reason": reason, **details, "suppressed": held,
                                                                "log_every_s": WATERMARK_LOG_EVERY_S})
            return
        log.error(f"{kind} ignored: {reason}", extra={"reason": reason, **details})

    def _signal_tables(self, sig_id: str, payload: dict[str, Any]) -> list[str] | None:
        """The signal's ``data-collections`` as event table names; None (logged) when malformed."""
        listed = payload.get("data-collections") or []
        if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
            self._ignore("signal", "data-collections is not a list of strings", signal=sig_id)
            return None
        if len(listed) > MAX_SIGNAL_TABLES:
            self._ignore("signal", f"lists more than {MAX_SIGNAL_TABLES} tables", signal=sig_id, tables=len(listed))
            return None
        try:
            return [qualify_table(*split_table(t)) for t in listed]
        except ContractError as e:
            self._ignore("signal", str(e), signal=sig_id)
            return None

    def _signal_filters(self, sig_id: str, payload: dict[str, Any], tables: list[str]) -> dict[str, str] | None:
        """``additional-conditions`` ([{"data-collection": t, "filter": sql}]) as table: filter;
        None (logged) when malformed. Only tables of the signal's ``data-collections`` count.
        Debezium 2.0's ``additional-condition`` (one filter for every listed table) is read too."""
        listed = payload.get("additional-conditions") or []
        single = payload.get("additional-condition")
        if single is not None:
            if not isinstance(single, str) or not isinstance(listed, list):
                self._ignore("signal", "additional-condition is not a string", signal=sig_id)
                return None
            named = {c.get("data-collection") for c in listed if isinstance(c, dict)}
            listed = [*({"data-collection": t, "filter": single} for t in tables if t not in named), *listed]
        ok = isinstance(listed, list) and all(
            isinstance(c, dict) and isinstance(c.get("data-collection"), str) and isinstance(c.get("filter"), str) for c in listed
        )
        if not ok:
            self._ignore("signal", 'additional-conditions is not a list of {"data-collection": …, "filter": …}', signal=sig_id)
            return None
        if sum(len(c["filter"]) for c in listed) > MAX_FILTER_CHARS:
            self._ignore("signal", f"additional-conditions filters longer than {MAX_FILTER_CHARS} characters", signal=sig_id)
            return None
        filters: dict[str, str] = {}
        try:
            for c in listed:
                filters[qualify_table(*split_table(c["data-collection"]))] = c["filter"].strip()
        except ContractError as e:
            self._ignore("signal", f"additional-conditions: {e}", signal=sig_id)
            return None
        strays = [t for t in filters if t not in tables]
        if strays:
            log.warning("additional-conditions of tables the signal does not snapshot ignored", extra={"signal": sig_id, "tables": strays})
        return {t: f for t, f in filters.items() if f and t in tables}

    def topic_signals(self, signals: Sequence[TopicSignal]) -> None:
        """Records of the signal topic, in order. Each one's offset is advanced before its
        signal is applied, so the position saved for the signal includes its consumption."""
        for sig in signals:
            self.signal_offset = sig.offset + 1
            if sig.problem is not None:
                self._ignore("signal-topic", sig.problem, signal=sig.sig_id)
            elif not sig.foreign:
                log.info("signal received from Kafka", extra={"signal": sig.sig_id, "type": sig.type})
                self.signal(sig.sig_id, sig.type, sig.payload)
        if signals:
            # The latest offset goes with the latest position (eager: saved at once; else with
            # the next confirmed commit — records that took no effect may be read again).
            self._mark(eager=False)

    def _signal_row(self, row: dict[str, Any], position: bytes) -> None:
        """A row inserted into the signal table (``data``: JSON text) at ``position`` (its
        event's key). The signal is ``<id>@<position>``: a replay of the same insert after a
        restart is recognised as done, and a new row that reuses a deleted row's id is a new
        signal (it was ignored as done before)."""
        sig_id, data = f"{row.get('id')}@{position.decode()}", row.get("data")
        try:
            payload = orjson.loads(data) if isinstance(data, str) and data else {}
        except orjson.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict):
            self._ignore("signal", "its data is not a JSON object", signal=sig_id, data=str(data)[:200])
            return
        self.signal(sig_id, row.get("type"), payload)

    def signal(self, sig_id: str, sig_type: object, payload: dict[str, Any]) -> None:
        """One signal, from the table or the signal topic. Anyone who may insert into the
        signal table can send it: nothing here may stop the stream."""
        tables = self._signal_tables(sig_id, payload)
        if tables is None:
            return
        if sig_type == "execute-snapshot":
            kind = payload.get("type", "incremental")
            if not isinstance(kind, str) or kind.lower() != "incremental":
                self._ignore("signal", "only incremental snapshots can be asked for", signal=sig_id)
                return
            filters = self._signal_filters(sig_id, payload, tables)
            if filters is None:
                return
            if sig_id in self._done_signals or (self.position is not None and self.position.handled(sig_id)):
                return  # replayed after a restart: already done, or being resumed
            self._execute(sig_id, tables, filters)
        elif sig_type in ("stop-snapshot", "pause-snapshot", "resume-snapshot"):
            # Replayed after a restart (the stream starts again before its transaction, while
            # the saved position already holds its effect and maybe a later execute's): applied
            # already. Recorded before it applies, so the save it makes holds it.
            if sig_id in self._done_signals:
                return
            self._done_signals = [*self._done_signals, sig_id][-100:]
            if sig_type == "stop-snapshot":
                self._stop(sig_id, tables)
            else:
                self._pause(sig_id, paused=sig_type == "pause-snapshot")
        else:
            log.warning("unknown signal ignored", extra={"signal": sig_id, "type": sig_type})

    def _execute(self, sig_id: str, tables: list[str], filters: dict[str, str]) -> None:
        if not tables:
            log.error("execute-snapshot without data-collections ignored", extra={"signal": sig_id})
            return
        pos = self.position
        if pos is None:
            pos = self.position = Position(sig_id, [], started_at=datetime.now(UTC).isoformat(timespec="seconds"))
            self._started = time.monotonic()
            self.metrics.begin(KIND, 0)
        elif not pos.handled(sig_id):
            pos.merged_signals = [*pos.merged_signals[-99:], sig_id]
        # A table already queued keeps the filter it was queued with.
        added = [t for t in dict.fromkeys(tables) if t not in pos.tables]
        queued = [t for t in dict.fromkeys(tables) if t not in added]
        if queued:
            changed = [t for t in queued if filters.get(t) != pos.filters.get(t)]
            log.warning(
                "tables already queued keep their place, progress and filter" if changed else "tables already queued",
                extra={"signal": sig_id, "tables": queued, "filter_not_taken": changed or None},
            )
        pos.tables += added
        pos.filters.update({t: f for t, f in filters.items() if t in added})
        pos.total_tables += len(added)
        self.metrics.tables_total.labels(KIND).set(pos.total_tables)
        self.metrics.tables_remaining.labels(KIND).set(len(pos.tables))
        log.info(
            "incremental snapshot started",
            extra={"signal": sig_id, "tables": added, "queue": pos.tables, "filtered": sorted(t for t in filters if t in added),
                   "paused": pos.paused},
        )
        self._mark(eager=True)

    def _stop(self, sig_id: str, tables: list[str]) -> None:
        pos = self.position
        if pos is None:
            return
        if tables:
            if pos.tables and pos.tables[0] in tables:
                self._chunk = None  # abandon the chunk in flight; its watermarks are ignored
                self._recent = None
                pos.forget_table()
                self._cancel_reading()
            pos.tables = [t for t in pos.tables if t not in tables]
            pos.filters = {t: f for t, f in pos.filters.items() if t in pos.tables}
        else:
            pos.tables = []
        log.info("incremental snapshot stopped", extra={"signal": sig_id, "tables": tables or "all", "left": pos.tables})
        self.metrics.tables_remaining.labels(KIND).set(len(pos.tables))
        if not pos.tables:
            self._finish(aborted=True)
        self._mark(eager=True)

    def _cancel_reading(self) -> None:
        """Cancel the query of an abandoned chunk still reading (a slow filter could hold the
        next table back until its timeout), from a thread: a cancel request is a connection
        of its own. Its task then ends with the error, and the next chunk starts."""
        conn, task = self._conn, self._task
        if conn is None or task is None or task.done():
            return

        def cancel() -> None:
            try:
                conn.cancel()
            except psycopg.Error as e:
                log.warning("could not cancel an abandoned chunk's query", extra={"error": str(e)})

        threading.Thread(target=cancel, name="walbus-chunk-cancel", daemon=True).start()

    def _pause(self, sig_id: str, *, paused: bool) -> None:
        """pause-snapshot / resume-snapshot: a chunk in flight completes, no next one starts
        while paused; the flag is part of the saved position, so it outlives a restart."""
        pos = self.position
        if pos is None:
            log.warning("no incremental snapshot to pause or resume", extra={"signal": sig_id, "pause": paused})
            return
        if pos.paused == paused:
            return
        pos.paused = paused
        self.metrics.paused.labels(KIND).set(int(paused))
        log.info(
            "incremental snapshot paused" if paused else "incremental snapshot resumed by signal",
            extra={"signal": sig_id, "table": pos.tables[0] if pos.tables else None, "after_key": pos.last_key},
        )
        self._mark(eager=True)

    # -- chunks ------------------------------------------------------------------------------

    def _start_chunk(self) -> None:
        pos = self.position
        assert pos is not None
        if not pos.tables:
            self._finish(aborted=False)
            self._mark(eager=False)
            return
        table = pos.tables[0]
        chunk = Chunk(
            uuid.uuid4().hex, table, pos.last_key, max_key=pos.max_key, where=pos.filters.get(table),
            table_oid=pos.table_oid, key_types=pos.key_types,
        )
        self._chunk = chunk
        self._task = asyncio.create_task(asyncio.to_thread(self._read_chunk, chunk))
        self._task.add_done_callback(functools.partial(self._chunk_read, chunk=chunk))

    def _chunk_read(self, task: asyncio.Task[None], *, chunk: Chunk) -> None:
        if task.cancelled() or task.exception() is None:
            self._backoff.reset()
            if self._chunk is not chunk:
                return
            if chunk.partitions is not None:
                self._read_partitions(chunk, chunk.partitions)
            elif chunk.skip_reason is not None:
                log.warning("table left out of the incremental snapshot", extra={"table": chunk.table, "reason": chunk.skip_reason})
                self.metrics.tables_skipped.labels(KIND, chunk.table).inc()  # else "completed" looks like every table read
                self._give_up_table(chunk)
            elif chunk.failure is not None:
                # Not retried: the same query fails the same way (a filter's error, a missing
                # SELECT right). The queue and streaming go on; a new signal tries it again.
                log.error(
                    "incremental snapshot of table failed: its additional-conditions filter does not work"
                    if chunk.where is not None and not chunk.bad_key else "incremental snapshot of table failed",
                    extra={"table": chunk.table, "filter": (chunk.where or "")[:500] or None, "error": chunk.failure,
                           "after_key": chunk.after},
                )
                self.metrics.tables_failed.labels(KIND, chunk.table).inc()
                self._give_up_table(chunk)
            elif chunk.locked is not None:
                self._locked_out(chunk, chunk.locked)
            return
        self.close()
        self._conn = None
        if self._chunk is chunk:
            self._chunk = None
            self._backoff.failures += 1
            delay = self._backoff.next_delay()
            self._retry_at = time.monotonic() + delay
            log.warning("incremental snapshot chunk failed, retrying",
                        extra={"table": chunk.table, "error": str(task.exception()), "attempt": self._backoff.failures,
                               "retry_in_s": round(delay, 3)})

    def _connection(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed:
            dsn = self.config.pg_dsn
            conn = psycopg.connect(dsn, autocommit=True, application_name="walbus-incremental", options=session_options(dsn))
            # A table's lock held by another session (LOCK TABLE, a long ALTER) must not hold
            # this connection, and every table queued after it, for as long as it lasts.
            lock_ms = max(1, round(self.config.incremental_lock_timeout * 1000))
            conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(lock_ms)))
            self._conn = conn
        return self._conn

    def _locked_out(self, chunk: Chunk, holders: list[dict[str, Any]]) -> None:
        """The chunk's table stayed locked longer than --incremental-lock-timeout: retried with
        backoff; a table whose reading has not begun goes behind the tables queued after it,
        so they are read meanwhile (one being read keeps its place: its progress is that of
        the queue's first table)."""
        self._chunk = None
        pos = self.position
        if pos is None or not pos.tables or pos.tables[0] != chunk.table:
            return  # stopped meanwhile
        self.metrics.lock_timeouts.labels(KIND, chunk.table).inc()
        self._lock_backoff.failures += 1
        delay = self._lock_backoff.next_delay()
        self._retry_at = time.monotonic() + delay
        requeued = pos.last_key is None and len(pos.tables) > 1
        if requeued:
            pos.tables = [*pos.tables[1:], chunk.table]
            pos.forget_table()
            self._recent = None
            self._mark(eager=False)
        log.warning(
            "incremental snapshot of table waits for its lock, held by another session: retried later",
            extra={"table": chunk.table, "lock_timeout_s": self.config.incremental_lock_timeout, "blocked_by": holders,
                   "after_key": pos.last_key if not requeued else None, "queued_last": requeued,
                   "attempt": self._lock_backoff.failures, "retry_in_s": round(delay, 3)},
        )

    @staticmethod
    def _lock_holders(conn: psycopg.Connection[tuple[object, ...]], table: str) -> list[dict[str, Any]]:
        """Who holds or awaits an ACCESS EXCLUSIVE lock on ``table`` (the only mode that
        blocks a read), for the log line; takes no lock itself."""
        schema, name = split_table(table)
        try:
            rows = conn.execute(
                "SELECT l.pid, a.usename::text, a.application_name, l.granted FROM pg_locks l "
                "LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'relation' AND l.mode = 'AccessExclusiveLock' AND l.pid <> pg_backend_pid() "
                "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND l.relation = (SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s) ORDER BY l.granted DESC, l.pid LIMIT 5",
                (schema, name),
            ).fetchall()
        except psycopg.Error:
            return []  # only for the log line
        return [{"pid": r[0], "user": r[1], "application": r[2], "granted": r[3]} for r in rows]

    def _give_up_table(self, chunk: Chunk) -> None:
        """The chunk's table is not read (further); the next one is."""
        self._chunk = None
        pos = self.position
        if pos is None or not pos.tables or pos.tables[0] != chunk.table:
            return  # stopped meanwhile
        self._next_table()
        self._mark(eager=False)  # saved with the next confirmed transaction: not tried again after a restart

    def _read_partitions(self, chunk: Chunk, leaves: list[str]) -> None:
        """A partitioned table is read as its leaf partitions, each under its own name, as
        the stream names its changes (both plugins) and the initial snapshot reads it. Read
        under its own name, its rows went to a table no change ever reaches (wal2json), or it
        was left out (pgoutput: not in the publication)."""
        pos = self.position
        if pos is None or not pos.tables or pos.tables[0] != chunk.table:
            self._chunk = None
            return  # stopped meanwhile
        if not leaves:
            log.warning("table left out of the incremental snapshot", extra={"table": chunk.table, "reason": "a partitioned table without partitions"})
            self.metrics.tables_skipped.labels(KIND, chunk.table).inc()
            self._give_up_table(chunk)
            return
        self._chunk = None
        where = pos.filters.pop(chunk.table, None)
        added = [t for t in leaves if t not in pos.tables]
        pos.tables = [*added, *pos.tables[1:]]
        if where is not None:
            pos.filters.update({t: where for t in added})
        self._recent = None
        pos.forget_table()
        self.metrics.tables_remaining.labels(KIND).set(len(pos.tables))
        log.info("partitioned table: its partitions are read instead", extra={"table": chunk.table, "partitions": added})
        self._mark(eager=False)

    def _read_chunk(self, chunk: Chunk) -> None:
        """In a thread: low watermark, the chunk's rows, high watermark."""
        conn = self._connection()
        try:
            self._read_chunk_on(conn, chunk)
        except psycopg.errors.LockNotAvailable:
            chunk.locked = self._lock_holders(conn, chunk.table)

    def _read_chunk_on(self, conn: psycopg.Connection[tuple[object, ...]], chunk: Chunk) -> None:
        schema, name = split_table(chunk.table)
        self._relids += 1
        scan = describe_table(conn, schema, name, self.capture, self._relids)
        if scan is not None and scan.kind == "p" and not self._published_as_itself(conn, schema, name):
            leaves = conn.execute(
                "SELECT n.nspname, c.relname FROM pg_partition_tree(format('%%I.%%I', %s::text, %s::text)::regclass) t "
                "JOIN pg_class c ON c.oid = t.relid JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE t.isleaf AND c.relkind = 'r' ORDER BY 1, 2",
                (schema, name),
            ).fetchall()
            chunk.partitions = [qualify_table(str(r[0]), str(r[1])) for r in leaves]
            return
        chunk.skip_reason = self._unusable(conn, chunk.table, scan)
        if chunk.skip_reason is not None:
            return
        assert scan is not None
        chunk.scan = scan
        self._check_identity(chunk, scan)
        role = self._role_for_filters(conn) if chunk.where is not None else ""
        if chunk.max_key is None:
            # Read around, the rows after a NULL key were never read and the table was "done"
            # without a word: it fails instead, said and counted.
            nulls = null_key_query(scan, chunk.where)
            if nulls is not None and self._key_refused(
                conn, chunk, role, nulls,
                f"key column(s) {', '.join(nullable_key_columns(scan))} hold NULL: "
                "--key-columns must name columns that are unique and not null",
            ):
                return
            # --key-columns no unique index vouches for: two rows with one key lose one.
            if self.capture.key_for(schema, name) is not None and not key_unique_indexed(conn, scan) and self._key_refused(
                conn, chunk, role, duplicate_key_query(scan, chunk.where),
                f"rows share a key ({', '.join(scan.relation.pk)}): --key-columns must name columns "
                "that are unique and not null",
            ):
                return
            got = self._select(conn, chunk, role, max_key_query(scan, chunk.where))
            if got is None:
                return
            found, _ = got
            chunk.max_key = [(v or b"").decode() for v in found[0]] if found else None
        self._watermark(conn, chunk, "low")
        if chunk.max_key is not None:
            rows = self._select_settled(conn, chunk, role, select_chunk(scan, chunk.after, chunk.max_key, self.chunk_size, chunk.where))
            if rows is None:
                return
            self._keep_rows(chunk, scan, rows)
        chunk.exhausted = len(chunk.rows) < self.chunk_size or chunk.last_key == chunk.max_key
        # The rows are in place before the high watermark exists: the pump cannot see it earlier.
        self._watermark(conn, chunk, "high")

    def _check_identity(self, chunk: Chunk, scan: ScanTable) -> None:
        """A table read from a saved key on must be the one its keys were read from, with the
        same key types: the keys are text, and under another type they mean other rows in
        another order (integer keys '100' and '5000' as text: '501'…'999' lie beyond the
        maximum key, and were never read: the table was done with rows missing). A table
        dropped and created again, or whose key changed, is read again from its first key."""
        now = (scan.oid, scan.key_types)
        if chunk.max_key is not None and chunk.key_types is not None and (chunk.table_oid, chunk.key_types) != now:
            log.warning(
                "incremental snapshot of table read again from its first key: it was dropped and created again, "
                "or its primary key changed, since its reading began",
                extra={"table": chunk.table, "after_key": chunk.after, "key_was": chunk.key_types, "key_now": scan.key_types,
                       "recreated": chunk.table_oid != scan.oid},
            )
            self.metrics.tables_restarted.labels(KIND, chunk.table).inc()
            chunk.after = chunk.max_key = None
        chunk.table_oid, chunk.key_types = now

    def _key_refused(
        self, conn: psycopg.Connection[tuple[object, ...]], chunk: Chunk, role: str, query: sql.Composed, failure: str,
    ) -> bool:
        """Run a query for rows the table's key cannot chunk: True when the table stops here
        (the query could not run, or it found one: the table fails with ``failure``)."""
        got = self._select(conn, chunk, role, query)
        if got is None:
            return True
        if got[0]:
            chunk.bad_key = True
            chunk.failure = failure
            return True
        return False

    def _select_settled(
        self, conn: psycopg.Connection[tuple[object, ...]], chunk: Chunk, role: str, query: sql.Composed,
    ) -> list[list[bytes | None]] | None:
        """:meth:`_select` with a snapshot no transaction waiting for synchronous replication
        is missing from. Such a transaction committed (its WAL record may precede the low
        watermark) but nobody sees it until a standby confirms it, and it can stay so for long,
        longer than :class:`RecentChanges` remembers. Its xid is in the snapshot's in-progress
        list; the chunk is read again once it is visible, and retried later when it stays not."""
        deadline = time.monotonic() + SYNC_REP_WAIT_S
        delay = 0.02
        while True:
            got = self._select(conn, chunk, role, query)
            if got is None:
                return None
            rows, invisible = got
            waiting = self._awaiting_sync_rep(conn, invisible)
            if not waiting:
                chunk.invisible = invisible
                return rows
            if time.monotonic() >= deadline:
                raise ChunkDeferred(
                    f"transactions {sorted(waiting)[:5]} committed but are not visible yet: they wait for synchronous "
                    "replication (synchronous_standby_names)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    @staticmethod
    def _awaiting_sync_rep(conn: psycopg.Connection[tuple[object, ...]], xids: frozenset[int]) -> set[int]:
        """Those of ``xids`` whose backend waits for synchronous replication (seen with
        pg_read_all_stats or as the same role; other sessions' waits read as NULL)."""
        if not xids:
            return set()
        rows = conn.execute(
            "SELECT backend_xid::text FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND backend_xid IS NOT NULL"
        ).fetchall()
        return {int(str(r[0])) for r in rows} & xids

    def _select(
        self, conn: psycopg.Connection[tuple[object, ...]], chunk: Chunk, role: str, query: sql.Composed,
    ) -> tuple[list[list[bytes | None]], frozenset[int]] | None:
        """The rows of a query of the chunk's table, read only, and the transactions its
        snapshot saw in progress; None when the chunk's filter made it fail (``chunk.failure``
        says how)."""
        timeout = self.config.incremental_filter_timeout if chunk.where is not None else 0.0
        try:
            with self._read_only(conn, role, timeout):
                self._lock(conn, chunk)
                rows = fetch_fields(conn, query)
                # Repeatable read: the query's own snapshot, taken after it locked the table.
                snap = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
                return rows, snapshot_xip(str(snap[0])) if snap is not None else frozenset()
        except psycopg.DatabaseError as e:
            # An error of the query itself fails the table: with a filter, the filter's (syntax,
            # unknown column, type, division by zero, a write in the read-only transaction, the
            # timeout); without one, the table's (no SELECT right, row-level security). Retrying
            # would block the queue behind it for good. A lost connection (OperationalError)
            # is retried, as is a cancel that no filter timeout of ours asked for.
            filtered = chunk.where is not None
            if isinstance(e, psycopg.OperationalError) and not (filtered and isinstance(e, psycopg.errors.QueryCanceled)):
                raise
            text = str(e).strip()
            chunk.failure = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
            return None

    def _lock(self, conn: psycopg.Connection[tuple[object, ...]], chunk: Chunk) -> None:
        """Lock the chunk's table before the transaction's snapshot is taken, and check that
        it is still the table described. A query's snapshot is taken before it waits for its
        table's lock: a rewrite (ALTER TABLE … TYPE, which also changes a key's type) that
        commits during that wait leaves the table empty to the snapshot, and the chunk read
        no rows, so the table was done with all its remaining rows missing."""
        scan = chunk.scan
        assert scan is not None
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(scan.ident))
        rel = scan.relation
        key_columns = self.capture.key_for(rel.schema, rel.name)  # --key-columns: the key the scan chunks by
        if table_identity(conn, rel.schema, rel.name, key_columns) != (scan.oid, scan.key_types):
            raise ChunkDeferred("the table was dropped, or its key changed, while the chunk was read")

    @staticmethod
    def _keep_rows(chunk: Chunk, scan: ScanTable, rows: Sequence[Sequence[bytes | None]]) -> None:
        convs = scan.relation.converters
        idx = scan.relation.pk_index
        for fields in rows:
            values = convert_fields(fields, convs)
            chunk.rows.append((tuple(values[i] for i in idx), values))
        if rows:
            chunk.last_key = key_text(rows[-1], scan)

    @staticmethod
    @contextlib.contextmanager
    def _read_only(conn: psycopg.Connection[tuple[object, ...]], role: str, timeout: float) -> Iterator[None]:
        """A REPEATABLE READ, READ ONLY transaction (a filter cannot write), as ``role`` when
        given, its statements cancelled after ``timeout`` seconds when given (a filter cannot
        stall the snapshot: its connection is the one every later chunk needs)."""
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            if timeout > 0:
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(max(1, round(timeout * 1000)))))
            if role:
                conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(role)))
                # RLS would hide rows from that role silently: an error (the table fails) instead.
                conn.execute("SET LOCAL row_security = off")
            yield

    def _role_for_filters(self, conn: psycopg.Connection[tuple[object, ...]]) -> str:
        """Filters are SQL from whoever may send signals: a superuser producer runs them as
        pg_read_all_data (PostgreSQL 14+: reads everything, nothing more), others as themselves."""
        if self._filter_role is None:
            row = conn.execute(
                "SELECT r.rolsuper, EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pg_read_all_data') "
                "FROM pg_roles r WHERE r.rolname = current_user"
            ).fetchone()
            superuser, can_drop = (bool(row[0]), bool(row[1])) if row is not None else (False, False)
            self._filter_role = "pg_read_all_data" if superuser and can_drop else ""
            if superuser and not can_drop:
                log.warning(
                    "additional-conditions filters run as a superuser (no pg_read_all_data before PostgreSQL 14): connect "
                    "the producer with a role that has REPLICATION and SELECT on the captured tables only",
                )
        return self._filter_role

    def _published_as_itself(self, conn: psycopg.Connection[tuple[object, ...]], schema: str, name: str) -> bool:
        """Whether pgoutput names a partitioned table's changes by the table itself (its
        publication has publish_via_partition_root): then it is read as one table."""
        if self.config.plugin != "pgoutput":
            return False
        return (schema, name) in setup.published_tables(conn, self.config.publication_name)

    def _unusable(self, conn: psycopg.Connection[tuple[object, ...]], table: str, scan: ScanTable | None) -> str | None:
        if scan is None:
            return "no such table"
        if not self.capture.captures(table) or table == self.capture.signal_table:
            return "not captured (--tables/--exclude-tables)"
        if scan.persistence != "p":
            # No change of it is ever decoded (wal2json has no publication to say so): its
            # reads would stay as they are downstream, deleted rows live for good.
            return "UNLOGGED or TEMP: PostgreSQL decodes none of its changes (ALTER TABLE … SET LOGGED to capture it)"
        if not scan.relation.pk:
            return "no primary key"
        if len(scan.relation.pk_index) != len(scan.relation.pk) or any(
            i in scan.relation.masked or i not in scan.relation.keep for i in scan.relation.pk_index
        ):
            return "a primary-key column is masked or excluded"
        if self.config.plugin == "pgoutput":
            row = conn.execute(
                "SELECT 1 FROM pg_publication_tables WHERE pubname = %s AND schemaname = %s AND tablename = %s",
                (self.config.publication_name, scan.relation.schema, scan.relation.name),
            ).fetchone()
            if row is None:
                return f"not in publication {self.config.publication_name}: its changes would not be streamed"
        return None

    @staticmethod
    def _watermark(conn: psycopg.Connection[tuple[object, ...]], chunk: Chunk, kind: str) -> None:
        content = orjson.dumps({"id": chunk.id, "kind": kind, "table": chunk.table, "ts": datetime.now(UTC).isoformat(timespec="microseconds")})
        conn.execute("SELECT pg_logical_emit_message(true, %s, %s::text)", (WATERMARK_PREFIX, content.decode()))

    def _complete(self, chunk: Chunk, msg: LogicalMessage, partitioned: bool) -> list[EncodedEvent]:
        """The high watermark: emit the chunk's rows the window did not drop, move on."""
        self._chunk = None
        pos = self.position
        scan = chunk.scan
        if pos is None or scan is None or not pos.tables or pos.tables[0] != chunk.table:
            return []  # stopped meanwhile
        recent = self._recent
        unseen = recent.keys_before(chunk.invisible, chunk.low_mark) if recent is not None else set()
        if chunk.window.blind or UNKNOWN_KEY in unseen:
            return self._read_again(chunk)
        self._rereads = 0
        self._lock_backoff.reset()
        rows = chunk.window.high(chunk.rows, unseen)
        # The watermark's transaction holds nothing but the message (we wrote it), so these
        # keys follow its events (none) and precede everything committed after it.
        reads = EventEncoder(partitioned=partitioned)
        reads.begin(msg.commit_lsn, msg.xid, msg.timestamp or datetime.now(UTC).isoformat(timespec="microseconds"))
        reads.seq = msg.seq
        out = [reads.read(scan.relation, msg.lsn, values) for values in rows]
        scanned = len(chunk.rows)
        self.metrics.rows_scanned.labels(KIND, chunk.table).inc(scanned)
        self.metrics.chunks.labels(chunk.table).inc()
        pos.rows += scanned
        log.info(
            "incremental snapshot chunk",
            extra={"table": chunk.table, "from_key": chunk.after, "last_key": chunk.last_key, "rows": scanned,
                   "emitted": len(out), "dropped_in_window": scanned - len(out), "commit_lsn": msg.commit_lsn,
                   "not_yet_visible_keys": len(unseen)},
        )
        if chunk.exhausted:
            log.info("incremental snapshot of table done", extra={"table": chunk.table})
            self._next_table()
        else:
            pos.last_key, pos.max_key = chunk.last_key, chunk.max_key
            pos.table_oid, pos.key_types = chunk.table_oid, chunk.key_types
        if pos.tables:
            self._mark(eager=False)
        else:
            self._finish(aborted=False)
            self._mark(eager=False)
        return out

    def _read_again(self, chunk: Chunk) -> list[EncodedEvent]:
        """A change of a row the stream names no key for came in the chunk's window (or
        before it, unseen by its snapshot): which of its rows is stale is unknown, so none is
        emitted and the same chunk is read again. Before, its rows went out, and a row read
        before its change undid it (a stale value for good)."""
        self._rereads += 1
        if self._rereads > CHUNK_REREADS:
            log.error(
                "incremental snapshot of table given up: changes whose key the stream does not carry (an update that "
                "left a TOASTed primary-key column unchanged, REPLICA IDENTITY DEFAULT) came in every one of its last "
                "chunks' windows; REPLICA IDENTITY FULL carries the key, or retry when the table is quieter",
                extra={"table": chunk.table, "after_key": chunk.after, "reads": self._rereads},
            )
            self._rereads = 0
            self.metrics.tables_failed.labels(KIND, chunk.table).inc()
            self._give_up_table(chunk)
            return []
        log.warning(
            "incremental snapshot chunk read again: a change in its window names no key (an update that left a "
            "TOASTed primary-key column unchanged)",
            extra={"table": chunk.table, "after_key": chunk.after, "attempt": self._rereads},
        )
        return []

    def _next_table(self) -> None:
        pos = self.position
        assert pos is not None
        pos.filters.pop(pos.tables[0], None)
        pos.tables = pos.tables[1:]
        self._recent = None
        pos.forget_table()
        self.metrics.tables_remaining.labels(KIND).set(len(pos.tables))

    def _finish(self, *, aborted: bool) -> None:
        pos = self.position
        if pos is None:
            return
        seconds = time.monotonic() - self._started
        self.metrics.end(KIND, seconds, aborted=aborted)
        self.metrics.paused.labels(KIND).set(0)
        if not aborted:
            log.info("incremental snapshot completed", extra={"signal": pos.signal_id, "rows": pos.rows, "seconds": round(seconds, 3)})
        self._done_signals = [*self._done_signals, pos.signal_id, *pos.merged_signals][-100:]  # ids of ≤ 64 characters
        self.position = None
        self._recent = None

    # -- persistence -------------------------------------------------------------------------

    def _mark(self, *, eager: bool) -> None:
        """The position changed inside the transaction being decoded: save it once that
        transaction is confirmed (chunks) or before it can be (signals)."""
        doc = None if self.position is None else asdict(self.position)
        state: dict[str, Any] = {"incremental": doc, "incremental_done": list(self._done_signals)}
        if self.signal_offset is not None:
            state["signal_offset"] = self.signal_offset
            state["signal_topic"] = self.config.signal_topic
        self._pending.append([None, state])
        self._eager = self._eager or eager

    async def _save(self, doc: dict[str, Any]) -> None:
        """Write the position; it counts as saved (what a new session resumes from) only once
        Kafka acknowledged it: a rejected save leaves the signal to be handled again on replay."""
        before = dict(self.offsets.doc)
        self.offsets.doc.update(doc)
        try:
            await self.offsets.save()
        except BaseException:
            self.offsets.doc.clear()
            self.offsets.doc.update(before)
            raise
        self._saved = doc["incremental"]
        self._saved_signal_offset = doc.get("signal_offset", self._saved_signal_offset)
