"""The last-row store: per source partition, the latest output value of every key.

Why it exists: an update that leaves a TOAST column unchanged does not carry the
column's value, and a truncate does not list the keys it removes. The demux needs
the previous row for the first and the set of live keys for the second.

Consistency with Kafka: the store is one SQLite file per source partition. Changes
of the open Kafka transaction live in memory (``pending``) and are written to
SQLite, together with the source offset they bring the store to, only *after* the
Kafka transaction committed. So the store is never ahead of the committed output;
after a crash between the two commits it is behind, its checkpoint no longer
equals the group's committed offset, and the service rebuilds it from its own
compacted per-table topics (read_committed), which hold exactly the committed rows.

Only *tracked* tables are stored: a table becomes tracked the first time one of
its events has a TOAST-able column (a type outside FIXED_WIDTH_TYPES) or an
unchanged value; the service then loads the table's current rows from its
compacted topic, at a transaction boundary, and keeps them up to date from then
on. Tables of fixed-width columns only (pgkafka's ``transactions``) never need
it and cost no store writes. A missing or stale store is reset to empty (nothing
tracked): tables are rebuilt from their topics lazily, when first needed.

Values are the demux's output values (row + ``__`` metadata); :meth:`get` strips
the metadata. Storing the bytes already built for Kafka costs no extra encoding
on the hot path, and loading a table is a plain copy of its topic.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import orjson

from demux.rekey import UNKNOWN_ROW, strip_meta
from walbus.config import ConfigError

log = logging.getLogger("walbus.demux")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (tbl TEXT NOT NULL, k BLOB NOT NULL, v BLOB NOT NULL, PRIMARY KEY (tbl, k)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tracked (tbl TEXT PRIMARY KEY);
"""


STORE_NAME_BYTES: Final = 200  # of a store's file name (a file system's limit is 255 bytes)
# A store's file and SQLite's beside it (which take the store's mode when SQLite makes them).
_STORE_SUFFIXES: Final = ("", "-wal", "-shm", "-journal")
_open_dirs_checked: set[Path] = set()


def make_private_dir(path: Path) -> None:
    """The state directory, closed to other users when the demux makes it: its stores hold the
    current rows of the tables. One that exists keeps its mode (it may be the operator's), with
    a warning, once, when other users may enter it."""
    try:
        path.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        if not path.is_dir():
            raise
        if path in _open_dirs_checked:
            return
        _open_dirs_checked.add(path)
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning(
                f"the state directory {path} is open to other users (mode {mode:o}): its stores are 0600, but "
                "their names show groups and topics; chmod 700 it",
                extra={"state_dir": str(path), "mode": f"{mode:o}"},
            )


def check_state_dir(path: Path) -> None:
    """The --state-dir made (or found) at start: one that is a file, under a file or cannot be
    made is a ConfigError (exit 2). It failed in each partition worker, which retried forever
    with backoff ('partition worker failed …: FileExistsError')."""
    try:
        make_private_dir(path)
    except OSError as e:
        reason = "it is not a directory" if isinstance(e, FileExistsError) else (e.strerror or str(e))
        raise ConfigError(f"--state-dir {path}: {reason}") from None


def create_private_file(path: Path) -> None:
    """A store file (and SQLite's journal files of an earlier run) readable by this user only,
    whatever the umask: an older demux made them with it (0644)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    for suffix in _STORE_SUFFIXES:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{suffix}", 0o600)


def store_file_name(group: str, topic: str, partition: int) -> str:
    """The last-row store's file name for a group's source partition. A long one (a topic of a
    database named in non-ASCII, 3 bytes a character, twice in it with the default group) is
    cut and given a hash of the exact names: past 255 bytes the store could not be opened, and
    the partition worker failed and retried forever (a fuzz)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{group}__{topic}")
    name = f"{safe}-{partition}.sqlite"
    if len(name.encode()) <= STORE_NAME_BYTES:
        return name
    digest = hashlib.sha256(f"{group}\x00{topic}".encode("utf-8", "surrogatepass")).hexdigest()[:16]
    head = safe.encode()[:120].decode(errors="ignore")
    return f"{head}--{digest}-{partition}.sqlite"


class StateStore:
    """SQLite-backed ``(table, key) -> value`` map with an in-memory pending layer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        make_private_dir(path.parent)
        create_private_file(path)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        # WAL + NORMAL: a power loss may drop the last commit (then the checkpoint is
        # behind and the store is rebuilt) but never corrupts the file.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.pending: dict[tuple[str, bytes], bytes | None] = {}
        self.tracked: set[str] = {str(r[0]) for r in self._db.execute("SELECT tbl FROM tracked")}
        # (table, identity columns) -> _Finder: keys by the values of an identity that lacks the
        # key (see find). Built on first need, kept up to date by apply, dropped on rollback.
        self._finders: dict[tuple[str, tuple[str, ...]], _Finder] = {}
        # The tables that have one: their changes must come through apply (not the worker's
        # fast path, which writes ``pending`` directly).
        self.indexed: set[str] = set()

    def close(self) -> None:
        self._db.close()

    # -- checkpoint ------------------------------------------------------------

    def checkpoint(self) -> str | None:
        """What the committed content corresponds to (set by :meth:`commit`)."""
        row = self._db.execute("SELECT value FROM meta WHERE name = 'checkpoint'").fetchone()
        return None if row is None else str(row[0])

    # -- reads -----------------------------------------------------------------

    def get(self, table: str, key: bytes) -> dict[str, Any] | None:
        k = (table, key)
        if k in self.pending:
            raw = self.pending[k]
        else:
            row = self._db.execute("SELECT v FROM rows WHERE tbl = ? AND k = ?", k).fetchone()
            raw = None if row is None else bytes(row[0])
        if raw is None:
            return None
        value = orjson.loads(raw)
        return strip_meta(value) if isinstance(value, dict) else None

    def keys(self, table: str) -> Iterable[bytes]:
        live = {bytes(r[0]) for r in self._db.execute("SELECT k FROM rows WHERE tbl = ?", (table,))}
        for (tbl, key), value in self.pending.items():
            if tbl != table:
                continue
            if value is None:
                live.discard(key)
            else:
                live.add(key)
        return live

    def find(self, table: str, identity: dict[str, Any]) -> bytes | None:
        """The key of the row holding every value of ``identity`` (None: no such row).

        An update's or delete's identity lacks the key columns under REPLICA IDENTITY USING
        INDEX on a unique index that is not the primary key: such a row is found by the
        index's values, through an in-memory index of the table built once (one read of its
        rows) and kept up to date by :meth:`apply`."""
        cols = tuple(identity)
        finder = self._finders.get((table, cols))
        if finder is None:
            finder = self._finders[(table, cols)] = _Finder(cols)
            self.indexed.add(table)
            rows = {bytes(k): bytes(v) for k, v in self._db.execute("SELECT k, v FROM rows WHERE tbl = ?", (table,))}
            for (tbl, key), value in self.pending.items():
                if tbl == table:
                    if value is None:
                        rows.pop(key, None)
                    else:
                        rows[key] = value
            for key, value in rows.items():
                finder.put(key, value)
        return finder.by_values.get(_Finder.values_key(identity, cols))

    def has_finder(self, table: str, columns: tuple[str, ...]) -> bool:
        """Whether :meth:`find` by these identity columns is ready (else its first call reads the table)."""
        return (table, columns) in self._finders

    def items(self) -> Iterator[tuple[str, bytes, bytes]]:
        for tbl, k, v in self._db.execute("SELECT tbl, k, v FROM rows ORDER BY tbl, k"):
            yield str(tbl), bytes(k), bytes(v)

    def __len__(self) -> int:
        row = self._db.execute("SELECT count(*) FROM rows").fetchone()
        return int(row[0])

    # -- writes ----------------------------------------------------------------

    def apply(self, changes: Iterable[tuple[str, bytes, bytes | None]]) -> None:
        """Record changes of the open transaction; those of untracked tables are not kept."""
        pending, tracked, finders = self.pending, self.tracked, self._finders
        for table, key, value in changes:
            if table in tracked:
                pending[(table, key)] = value
                if finders:
                    for (tbl, _), finder in finders.items():
                        if tbl == table:
                            finder.put(key, value)

    def rollback(self) -> None:
        """Forget the changes of an aborted transaction."""
        self.pending.clear()
        self._drop_finders()  # they hold the aborted changes: built again when needed

    def commit(self, checkpoint: str) -> None:
        """Write the pending changes and the new checkpoint atomically."""
        upserts = [(t, k, v) for (t, k), v in self.pending.items() if v is not None]
        deletes = [(t, k) for (t, k), v in self.pending.items() if v is None]
        db = self._db
        db.execute("BEGIN")
        try:
            if upserts:
                db.executemany("INSERT OR REPLACE INTO rows (tbl, k, v) VALUES (?, ?, ?)", upserts)
            if deletes:
                db.executemany("DELETE FROM rows WHERE tbl = ? AND k = ?", deletes)
            db.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('checkpoint', ?)", (checkpoint,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.pending.clear()

    def track(self, table: str, rows: Iterable[tuple[bytes, bytes]]) -> int:
        """Start keeping ``table``: load its current rows (at a transaction boundary)."""
        if self.pending:
            raise RuntimeError("track() inside an open transaction")
        db = self._db
        db.execute("BEGIN")
        try:
            db.execute("DELETE FROM rows WHERE tbl = ?", (table,))
            cur = db.executemany("INSERT OR REPLACE INTO rows (tbl, k, v) VALUES (?, ?, ?)",
                                 ((table, k, v) for k, v in rows))
            count = cur.rowcount
            db.execute("INSERT OR IGNORE INTO tracked (tbl) VALUES (?)", (table,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.tracked.add(table)
        self._drop_finders(table)
        return max(count, 0)

    def _drop_finders(self, table: str | None = None) -> None:
        for entry in [e for e in self._finders if table is None or e[0] == table]:
            del self._finders[entry]
        self.indexed.clear()  # in place: the worker holds the set
        self.indexed.update(e[0] for e in self._finders)

    def reset(self, checkpoint: str) -> None:
        """Forget everything (a stale or missing store): tables are loaded again when needed."""
        db = self._db
        self.pending.clear()
        self._drop_finders()
        db.execute("BEGIN")
        try:
            db.execute("DELETE FROM rows")
            db.execute("DELETE FROM tracked")
            db.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('checkpoint', ?)", (checkpoint,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.tracked.clear()


_ABSENT: Final = object()


class _Finder:
    """One table's keys by the values of some of its columns (an identity without the key)."""

    __slots__ = ("by_values", "columns", "of_key", "unknown")

    def __init__(self, columns: tuple[str, ...]) -> None:
        self.columns = columns
        self.by_values: dict[bytes, bytes] = {}
        self.of_key: dict[bytes, bytes] = {}  # key -> its entry in by_values
        # Keys whose rows are marked unknown (rekey.unknown_row): their columns may be stale (a
        # later change of the row dead-lettered too) while a live row took their values, so a
        # known row is found before them, whatever order the rows come in.
        self.unknown: set[bytes] = set()

    @staticmethod
    def values_key(row: dict[str, Any], columns: tuple[str, ...]) -> bytes:
        return orjson.dumps([row[c] for c in columns])

    def put(self, key: bytes, value: bytes | None) -> None:
        """The key now holds ``value`` (None: no row)."""
        old = self.of_key.pop(key, None)
        if old is not None and self.by_values.get(old) == key:
            del self.by_values[old]
        self.unknown.discard(key)
        if value is None:
            return
        row = orjson.loads(value)
        # A row without one of the columns (a value left out) is not findable by them.
        if isinstance(row, dict) and all(row.get(c, _ABSENT) is not _ABSENT for c in self.columns):
            entry = self.values_key(row, self.columns)
            self.of_key[key] = entry
            if UNKNOWN_ROW in row:
                self.unknown.add(key)
                held = self.by_values.get(entry)
                if held is not None and held not in self.unknown:
                    return
            self.by_values[entry] = key
