"""Helpers of the demux integration tests: source events, demux subprocesses, reading topics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from demux.rekey import Rekeyer, strip_meta
from tests.support.kafka import read_records
from walbus.app.dev.processes import free_port
from walbus.contract import decode_event, encode_event, event_key

ROOT = Path(__file__).resolve().parents[2]
TS = "2024-05-01T12:00:00.000001+00:00"
OPEN_TXN_RECORDS = "walbus_demux_open_transaction_records{"


_LIVE: list[DemuxProc] = []


@pytest.fixture(autouse=True)
def _reap_demux_processes() -> Iterator[None]:
    """No demux subprocess outlives its test, whatever the test's outcome."""
    yield
    while _LIVE:
        p = _LIVE.pop().proc
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)


@dataclass
class DemuxProc:
    """A `walbus demux` subprocess (the worktree's code), logging to a file."""

    args: list[str]
    log_path: Path
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DemuxProc:
        _LIVE.append(self)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "walbus.app.cli", "demux", *self.args, "--metrics-port", str(self.metrics_port)],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        return self

    def check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"demux exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def log_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(orjson.JSONDecodeError):
                    out.append(orjson.loads(line))
        return out

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"demux did not stop on SIGTERM:\n{self.log_tail()}") from None
        self._log.close()
        return rc

    def settled_metrics(self, consumed: int, within: float = 30.0) -> dict[str, float]:
        """/metrics once they count ``consumed`` source records: the group's committed offsets
        are visible to others a moment before the demux has the commit's answer and counts
        the transaction's records, dead letters and outputs."""
        deadline = time.monotonic() + within
        while True:
            metrics = self.metrics()
            done = sum(v for k, v in metrics.items() if k.startswith("walbus_demux_records_consumed_total{"))
            if done >= consumed or time.monotonic() > deadline:
                return metrics
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        """Sample name{labels} -> value, from /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def demux_args(bootstrap: str, source: str, state_dir: Path, *extra: str, group: str | None = None) -> list[str]:
    args = ["--kafka-bootstrap", bootstrap, "--source-topic", source, "--state-dir", str(state_dir),
            "--session-timeout-ms", "6000", "--txn-max-ms", "100"]
    if group:
        args += ["--group-id", group]
    return [*args, *extra]


# -- events -----------------------------------------------------------------------


def ev(commit_lsn: int, seq: int, op: str, table: str, pk: list[str], new: dict[str, Any] | None = None,
       identity: dict[str, Any] | None = None, unchanged: list[str] | None = None,
       types: dict[str, str] | None = None) -> tuple[bytes, bytes]:
    """(key, value) of one contract-v1 event; rows as plain dicts."""
    def img(row: dict[str, Any] | None) -> dict[str, list[Any]] | None:
        if row is None:
            return None
        t = types or {}
        return {"columns": list(row), "types": [t.get(c, "text") for c in row], "values": list(row.values())}

    value = encode_event(lsn=commit_lsn - 100 + seq, commit_lsn=commit_lsn, seq=seq, xid=commit_lsn % 100000,
                         operation=op, table=table, timestamp=TS, pk=pk, new=img(new), identity=img(identity),
                         unchanged=unchanged)
    return event_key(commit_lsn, seq), value


class DictState:
    """The store's read interface over a dict, plus the changes applied."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, bytes], bytes] = {}

    def get(self, table: str, key: bytes) -> dict[str, Any] | None:
        raw = self.rows.get((table, key))
        return None if raw is None else strip_meta(orjson.loads(raw))

    def keys(self, table: str) -> Iterable[bytes]:
        return [k for (t, k) in self.rows if t == table]

    def find(self, table: str, identity: dict[str, Any]) -> bytes | None:
        for (t, k), raw in self.rows.items():
            row = orjson.loads(raw)
            if t == table and all(c in row and row[c] == v for c, v in identity.items()):
                return k
        return None

    def apply(self, changes: list[tuple[str, bytes, bytes | None]]) -> None:
        for t, k, v in changes:
            if v is None:
                self.rows.pop((t, k), None)
            else:
                self.rows[(t, k)] = v


def expected_output(values: Iterable[bytes], prefix: str, database: str,
                    emit_delete_records: bool = False) -> dict[tuple[str, bytes | None], list[bytes | None]]:
    """Reference: per (topic, key), the exact sequence of values the demux must produce."""
    rk = Rekeyer(prefix=prefix, database=database, emit_delete_records=emit_delete_records)
    state = DictState()
    out: dict[tuple[str, bytes | None], list[bytes | None]] = {}
    for v in values:
        res = rk.rekey(decode_event(v), state)
        for t, k, val in res.changes:
            if val is None:
                state.rows.pop((t, k), None)
            else:
                state.rows[(t, k)] = val
        for r in res.records:
            out.setdefault((r.topic, r.key), []).append(r.value)
    return out


class Workload:
    """Random contract-v1 transactions on three tables, with the expected final table contents.

    accounts (id int4 PK, name, balance numeric, doc TOAST-like text, at timestamptz),
    lines (order_id text, line int4: composite PK; qty, meta jsonb),
    audit (no primary key). Updates sometimes leave ``doc`` unchanged (not sent),
    sometimes change the key; deletes; rare truncates of ``lines``.
    """

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.lsn = 0x1_0000_0000
        self.accounts: dict[int, dict[str, Any]] = {}
        self.lines: dict[tuple[str, int], dict[str, Any]] = {}
        self.audit_count = 0
        self.next_id = 1

    def _account_row(self, i: int) -> dict[str, Any]:
        r = self.rnd
        return {
            "id": i,
            "name": r.choice(["ann", "bob", "zoë", None, "李"]),
            "balance": f"{r.randint(-10**12, 10**12)}.{r.randint(0, 99):02d}",
            "doc": "d" * r.randint(0, 3000) + str(r.random()),
            "at": f"2024-0{r.randint(1, 9)}-1{r.randint(0, 9)}T10:00:00.{r.randint(0, 999999):06d}+00:00",
        }

    def transaction(self, size: int) -> list[tuple[bytes, bytes]]:
        r = self.rnd
        self.lsn += 0x1000
        out: list[tuple[bytes, bytes]] = []
        types = {"id": "int4", "line": "int4", "qty": "int4", "balance": "numeric", "meta": "jsonb", "at": "timestamptz"}
        for seq in range(size):
            kind = r.random()
            if kind < 0.55 or not self.accounts:
                if r.random() < 0.7:
                    i = self.next_id
                    self.next_id += 1
                    row = self._account_row(i)
                    self.accounts[i] = row
                    out.append(ev(self.lsn, seq, "insert", "public.accounts", ["id"], new=row, types=types))
                else:
                    k = (r.choice(["A", "B", "C"]) + str(r.randint(1, 40)), r.randint(1, 5))
                    row = {"order_id": k[0], "line": k[1], "qty": r.randint(1, 9),
                           "meta": None if r.random() < 0.2 else orjson.dumps({"n": r.random()}).decode()}
                    op = "update" if k in self.lines else "insert"
                    self.lines[k] = row
                    out.append(ev(self.lsn, seq, op, "public.lines", ["order_id", "line"], new=row, types=types))
            elif kind < 0.8:
                i = r.choice(list(self.accounts))
                row = dict(self.accounts[i])
                row["balance"] = f"{r.randint(0, 999)}.5"
                if r.random() < 0.15:  # key change
                    new_id = self.next_id
                    self.next_id += 1
                    del self.accounts[i]
                    row["id"] = new_id
                    self.accounts[new_id] = row
                    sent = {k: v for k, v in row.items() if k != "doc"}
                    out.append(ev(self.lsn, seq, "update", "public.accounts", ["id"], new=sent,
                                  identity={"id": i}, unchanged=["doc"], types=types))
                elif r.random() < 0.6:  # TOAST value left unchanged: not sent
                    self.accounts[i] = row
                    sent = {k: v for k, v in row.items() if k != "doc"}
                    out.append(ev(self.lsn, seq, "update", "public.accounts", ["id"], new=sent,
                                  unchanged=["doc"], types=types))
                else:
                    row["doc"] = "new" + str(r.random())
                    self.accounts[i] = row
                    out.append(ev(self.lsn, seq, "update", "public.accounts", ["id"], new=row, types=types))
            elif kind < 0.93:
                i = r.choice(list(self.accounts))
                del self.accounts[i]
                out.append(ev(self.lsn, seq, "delete", "public.accounts", ["id"], identity={"id": i}, types=types))
            elif kind < 0.995:
                self.audit_count += 1
                out.append(ev(self.lsn, seq, "insert", "public.audit", [], new={"msg": f"m{self.audit_count}"}))
            else:
                self.lines.clear()
                out.append(ev(self.lsn, seq, "truncate", "public.lines", ["order_id", "line"]))
        return out

    def expected_tables(self) -> dict[str, dict[bytes, dict[str, Any]]]:
        acc = {orjson.dumps({"id": i}): row for i, row in self.accounts.items()}
        lines = {orjson.dumps({"order_id": k[0], "line": k[1]}): row for k, row in self.lines.items()}
        return {"public.accounts": acc, "public.lines": lines}


class Feeder:
    """Writes workload transactions to the source topic from a background task."""

    def __init__(self, bootstrap: str, topic: str, workload: Workload,
                 partition_of: dict[str, int] | None = None) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.workload = workload
        self.partition_of = partition_of or {}
        self.values: list[bytes] = []
        self.task: asyncio.Task[None] | None = None

    async def run(self, transactions: int, *, max_size: int = 200, pause: float = 0.02,
                  big: int = 0) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True,
                                    linger_ms=5)
        await producer.start()
        try:
            rnd = self.workload.rnd
            for n in range(transactions):
                size = big if big and n == transactions // 2 else rnd.randint(1, max_size)
                futs = []
                for k, v in self.workload.transaction(size):
                    table = orjson.loads(v)["table"]
                    part = self.partition_of.get(table, 0)
                    futs.append(await producer.send(self.topic, value=v, key=k, partition=part))
                    self.values.append(v)
                await asyncio.gather(*futs)
                await asyncio.sleep(pause)
        finally:
            await producer.stop()

    def start(self, transactions: int, **kw: Any) -> None:
        self.task = asyncio.create_task(self.run(transactions, **kw))

    async def wait(self) -> None:
        assert self.task is not None
        await self.task


async def wait_for_log(proc: DemuxProc, msg: str, count: int = 1, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        proc.check_alive()
        if sum(1 for line in proc.log_lines() if line.get("msg") == msg) >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {msg!r} x{count} in the demux log:\n{proc.log_tail()}")


async def wait_open_transaction(proc: DemuxProc, within: float = 60) -> None:
    """Until the broker has acknowledged records of a transaction the demux has not begun to commit.

    A fault injected right after this finds a transaction open (unless the process is
    descheduled past the transaction's due time first): its records are on the broker
    and, killed, it can only be aborted.
    """
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        proc.check_alive()
        with contextlib.suppress(OSError):  # the metrics endpoint is not up yet
            if sum(v for k, v in proc.metrics().items() if k.startswith(OPEN_TXN_RECORDS)) > 0:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no open transaction with records in {within} s:\n{proc.log_tail()}")


async def assert_exactly_once(bootstrap: str, source: str, values: list[bytes], *,
                              prefix: str = "walbus") -> dict[str, int]:
    """Every per-table topic holds exactly the reference output, per key, in order (read_committed).

    Returns how many records each topic holds beyond that under read_uncommitted
    (the output of aborted transactions, proof that kills hit open transactions).
    """
    database = source[len(prefix) + 1:]
    expected = expected_output(values, prefix, database)
    topics = {t for t, _ in expected}
    aborted: dict[str, int] = {}
    for topic in sorted(topics):
        got: dict[bytes | None, list[bytes | None]] = {}
        recs = await read_records(bootstrap, topic)
        for r in recs:
            got.setdefault(r.key, []).append(r.value)
        want = {k: v for (t, k), v in expected.items() if t == topic}
        if got != want:
            bad = [k for k in set(got) | set(want) if got.get(k) != want.get(k)][:3]
            detail = {repr(k): (len(got.get(k, [])), len(want.get(k, []))) for k in bad}
            raise AssertionError(f"{topic}: output differs from the reference for keys (got, want) {detail}")
        uncommitted = await read_records(bootstrap, topic, isolation_level="read_uncommitted")
        aborted[topic] = len(uncommitted) - len(recs)
    return aborted
