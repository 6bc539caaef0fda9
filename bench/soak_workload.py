"""The soak's writer: a mixed workload that keeps a record of every transaction it committed.

Each transaction takes its xid (``txid_current()``) and counts the row changes it makes per
(table, operation), as the producer will publish them: a multi-row INSERT or a COPY is one
event per row, an UPDATE that changes the key is one update, a TRUNCATE is one truncate
event. A commit whose answer is lost (PostgreSQL restarted under it) is in doubt: the
writer asks ``txid_status`` after reconnecting and records it only if it committed.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import psycopg

TABLES = ("public.accounts", "public.docs", "public.items", "public.scratch")

SCHEMA = """
CREATE TABLE accounts (id int PRIMARY KEY, owner text NOT NULL, balance bigint NOT NULL, note text);
CREATE TABLE docs (id int PRIMARY KEY, title text NOT NULL, body text NOT NULL);
ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE TABLE items (id bigint PRIMARY KEY, kind text NOT NULL, payload text);
CREATE TABLE scratch (id int PRIMARY KEY, v text);
"""

Counts = Counter[tuple[str, str]]


@dataclass
class Committed:
    xid: int  # 32-bit, as in the events
    counts: Counts


@dataclass
class WorkloadRecord:
    committed: list[Committed] = field(default_factory=list)
    in_doubt_committed: int = 0
    in_doubt_aborted: int = 0
    failed: int = 0
    milestones: list[str] = field(default_factory=list)

    def expected_events(self) -> int:
        return sum(sum(c.counts.values()) for c in self.committed)


class _Txn:
    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.counts: Counts = Counter()

    def run(self, query: str, params: tuple[object, ...] = (), *, table: str = "", op: str = "") -> int:
        cur = self.conn.execute(query.encode(), params)
        n = max(cur.rowcount, 0)
        if table and n:
            self.counts[(table, op)] += n
        return n


class Writer:
    """Runs the workload in a thread until ``stop()``; ``large_rows`` sizes the one large transaction."""

    def __init__(self, dsn: str, seed: int, *, duration_s: float, large_rows: int, pace_s: float = 0.05) -> None:
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.duration_s = duration_s
        self.large_rows = large_rows
        self.pace_s = pace_s
        self.record = WorkloadRecord()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-writer", daemon=True)
        self._next_id = {"accounts": 1, "docs": 1, "items": 1, "scratch": 1}
        self._added_column = False
        self.error: BaseException | None = None

    def create_schema(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(SCHEMA.encode())

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _new_ids(self, table: str, n: int) -> list[int]:
        first = self._next_id[table]
        self._next_id[table] = first + n
        return list(range(first, first + n))

    # One writer step per kind; each runs inside one transaction.

    def _insert_accounts(self, t: _Txn) -> None:
        ids = self._new_ids("accounts", self.rng.randint(1, 5))
        rows = [(i, f"owner-{i}", self.rng.randint(0, 10_000), None if i % 3 else f"note {i}") for i in ids]
        cols = "id, owner, balance, note" + (", tier" if self._added_column else "")
        for r in rows:
            values = (*r, self.rng.randint(1, 3)) if self._added_column else r
            marks = ", ".join(["%s"] * len(values))
            t.run(f"INSERT INTO accounts ({cols}) VALUES ({marks})", values, table="public.accounts", op="insert")

    def _update_accounts(self, t: _Txn) -> None:
        t.run("UPDATE accounts SET balance = balance + %s WHERE id IN (SELECT id FROM accounts ORDER BY random() LIMIT %s)",
              (self.rng.randint(-50, 50), self.rng.randint(1, 4)), table="public.accounts", op="update")

    def _delete_accounts(self, t: _Txn) -> None:
        t.run("DELETE FROM accounts WHERE id IN (SELECT id FROM accounts ORDER BY random() LIMIT %s)",
              (self.rng.randint(1, 2),), table="public.accounts", op="delete")

    def _change_key(self, t: _Txn) -> None:
        (new,) = self._new_ids("accounts", 1)
        t.run("UPDATE accounts SET id = %s WHERE id = (SELECT id FROM accounts ORDER BY random() LIMIT 1)",
              (new,), table="public.accounts", op="update")

    def _insert_doc(self, t: _Txn) -> None:
        (i,) = self._new_ids("docs", 1)
        body = self.rng.randbytes(6000).hex()  # 12 kB, stored out of line (TOAST)
        t.run("INSERT INTO docs VALUES (%s, %s, %s)", (i, f"doc {i}", body), table="public.docs", op="insert")

    def _retitle_doc(self, t: _Txn) -> None:
        # The body is not sent: an unchanged TOAST value the demux and the warehouse fill in.
        t.run("UPDATE docs SET title = title || '+' WHERE id = (SELECT id FROM docs ORDER BY random() LIMIT 1)",
              table="public.docs", op="update")

    def _copy_items(self, t: _Txn) -> None:
        ids = self._new_ids("items", self.rng.randint(20, 150))
        with t.conn.cursor() as cur, cur.copy("COPY items (id, kind, payload) FROM STDIN") as copy:
            for i in ids:
                copy.write_row((i, self.rng.choice("abc"), f"payload {i}"))
        t.counts[("public.items", "insert")] += len(ids)

    def _multi(self, t: _Txn) -> None:
        self._insert_accounts(t)
        self._update_accounts(t)
        self._retitle_doc(t)
        self._insert_scratch(t)
        t.run("DELETE FROM items WHERE id IN (SELECT id FROM items ORDER BY random() LIMIT 3)", table="public.items", op="delete")

    def _insert_scratch(self, t: _Txn) -> None:
        ids = self._new_ids("scratch", self.rng.randint(1, 10))
        for i in ids:
            t.run("INSERT INTO scratch VALUES (%s, %s)", (i, f"v{i}"), table="public.scratch", op="insert")

    def _large(self, t: _Txn) -> None:
        ids = self._new_ids("items", self.large_rows)
        t.run("INSERT INTO items (id, kind, payload) SELECT g, 'large', repeat('x', 200) || g FROM generate_series(%s::bigint, %s::bigint) g",
              (ids[0], ids[-1]), table="public.items", op="insert")
        self.record.milestones.append(f"large transaction: {self.large_rows} rows")

    def _add_column(self, t: _Txn) -> None:
        t.run("ALTER TABLE accounts ADD COLUMN tier int")
        self.record.milestones.append("ADD COLUMN accounts.tier")

    def _truncate(self, t: _Txn) -> None:
        t.run("TRUNCATE scratch")
        t.counts[("public.scratch", "truncate")] += 1
        self.record.milestones.append("TRUNCATE scratch")

    def _steps(self) -> list[tuple[float, object]]:
        return [
            (30, self._insert_accounts), (20, self._update_accounts), (6, self._delete_accounts), (4, self._change_key),
            (4, self._insert_doc), (8, self._retitle_doc), (6, self._copy_items), (8, self._multi), (6, self._insert_scratch),
        ]

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            self.error = e

    def _loop(self) -> None:
        steps = self._steps()
        weights = [w for w, _ in steps]
        # Once each, at a fixed share of the run: the ADD COLUMN, the large transaction, the TRUNCATE.
        once = [(0.25, self._add_column), (0.45, self._large), (0.65, self._truncate)]
        conn: psycopg.Connection | None = None
        while not self._stop.is_set():
            if conn is None or conn.closed:
                conn = self._connect()
                if conn is None:
                    continue
            share = (time.monotonic() - self._started) / self.duration_s
            if once and share >= once[0][0]:
                step = once[0][1]
            else:
                step = self.rng.choices([s for _, s in steps], weights)[0]
            if self._transaction(conn, step):  # type: ignore[arg-type]
                if once and step is once[0][1]:
                    once.pop(0)
                    if step == self._add_column:  # later inserts fill the new column
                        self._added_column = True
            elif conn.closed or conn.broken:
                conn = None
            time.sleep(self.rng.uniform(0, 2 * self.pace_s))
        if conn is not None:
            conn.close()

    def _connect(self) -> psycopg.Connection | None:
        try:
            return psycopg.connect(self.dsn, connect_timeout=3)
        except psycopg.OperationalError:
            time.sleep(0.5)
            return None

    def _transaction(self, conn: psycopg.Connection, step: object) -> bool:
        """Run one step in a transaction; True when it committed (and is recorded)."""
        t = _Txn(conn)
        try:
            row = conn.execute("SELECT txid_current()").fetchone()
            assert row is not None
            txid = int(row[0])
            step(t)  # type: ignore[operator]
        except psycopg.Error:
            self.record.failed += 1
            if not conn.closed and not conn.broken:
                conn.rollback()
            return False
        try:
            conn.commit()
        except psycopg.OperationalError:
            committed = self._resolve(txid)
            if committed:
                self.record.in_doubt_committed += 1
            else:
                self.record.in_doubt_aborted += 1
                return False
        self.record.committed.append(Committed(txid & 0xFFFFFFFF, t.counts))
        return True

    def _resolve(self, txid: int) -> bool:
        """Whether an in-doubt transaction committed, asked once PostgreSQL answers again."""
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=3, autocommit=True) as conn:
                    row = conn.execute("SELECT txid_status(%s)", (txid,)).fetchone()
                    return row is not None and row[0] == "committed"
            except psycopg.OperationalError:
                time.sleep(0.5)
