"""Test data in walbus' wire formats, written to real Kafka topics.

Until the producer and the demux run in these tests, events are built here with the
contract's own encoder (database topic) and in the demux's per-table format (compacted topic).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer, TopicPartition

from walbus.contract import encode_event, event_key

Record = tuple[bytes | None, bytes | None]



@dataclass(frozen=True)
class Change:
    """One row change as the producer would see it."""

    commit_lsn: int
    seq: int
    xid: int
    table: str
    operation: str
    row: dict[str, Any] | None  # new row (None on delete)
    old_key: dict[str, Any] | None = None

    @property
    def position(self) -> tuple[int, int]:
        return (self.commit_lsn, self.seq)

    def record(self) -> Record:
        new = None
        if self.row is not None:
            new = {"columns": list(self.row), "types": ["int4"] * len(self.row), "values": list(self.row.values())}
        identity = None
        if self.old_key is not None:
            identity = {"columns": list(self.old_key), "types": ["int4"] * len(self.old_key), "values": list(self.old_key.values())}
        value = encode_event(
            lsn=self.commit_lsn - 40 + self.seq,
            commit_lsn=self.commit_lsn,
            seq=self.seq,
            xid=self.xid,
            operation=self.operation,
            table=self.table,
            timestamp="2024-05-01T12:00:00.000000+00:00",
            pk=["id"],
            new=new,
            identity=identity,
        )
        return event_key(self.commit_lsn, self.seq), value


def workload(rng: random.Random, transactions: int, tables: Sequence[str], *, start_lsn: int = 0x1000_0000) -> list[Change]:
    """Random inserts, updates and deletes on ``tables`` (columns id, v), in commit order."""
    live: dict[str, set[int]] = {t: set() for t in tables}
    next_id = 1
    out: list[Change] = []
    lsn = start_lsn
    for n in range(transactions):
        lsn += rng.randint(100, 5000)
        for seq in range(rng.randint(1, 5)):
            table = rng.choice(tables)
            ids = live[table]
            roll = rng.random()
            if not ids or roll < 0.5:
                rid, next_id = next_id, next_id + 1
                ids.add(rid)
                out.append(Change(lsn, seq, 700 + n, table, "insert", {"id": rid, "v": rng.randint(0, 999)}))
            elif roll < 0.8:
                rid = rng.choice(sorted(ids))
                out.append(Change(lsn, seq, 700 + n, table, "update", {"id": rid, "v": rng.randint(0, 999)}, {"id": rid}))
            else:
                rid = rng.choice(sorted(ids))
                ids.discard(rid)
                out.append(Change(lsn, seq, 700 + n, table, "delete", None, {"id": rid}))
    return out


def table_records(changes: Iterable[Change], table: str) -> list[Record]:
    """The demux's output for one table: PK-keyed rows with metadata, tombstones for deletes."""
    out: list[Record] = []
    for c in changes:
        if c.table != table:
            continue
        ident = c.row if c.row is not None else c.old_key
        assert ident is not None
        key = orjson.dumps({"id": ident["id"]})
        if c.row is None:
            out.append((key, None))
            continue
        op = {"insert": "c", "update": "u"}[c.operation]
        meta = {"__op": op, "__lsn": c.commit_lsn - 40 + c.seq, "__commit_lsn": c.commit_lsn, "__seq": c.seq, "__xid": c.xid, "__ts": "2024-05-01T12:00:00.000000+00:00"}
        out.append((key, orjson.dumps({**c.row, **meta})))
    return out


def final_state(changes: Iterable[Change], table: str) -> dict[int, dict[str, Any]]:
    state: dict[int, dict[str, Any]] = {}
    for c in changes:
        if c.table == table:
            if c.row is None:
                assert c.old_key is not None
                state.pop(c.old_key["id"], None)
            else:
                state[c.row["id"]] = dict(c.row)
    return state


class ScriptedDemux:
    """Writes per-table records the way the demux does: in a Kafka transaction that also
    commits its consumer-group offsets on the database topic."""

    def __init__(self, bootstrap: str, source_topic: str, group: str, transactional_id: str) -> None:
        self.source_topic = source_topic
        self.group = group
        self._producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=transactional_id, acks="all")

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def write(self, topic_records: Sequence[tuple[str, Record]], source_offset: int) -> None:
        """Write the records and mark the database topic consumed up to ``source_offset``."""
        async with self._producer.transaction():
            for topic, (key, value) in topic_records:
                await self._producer.send(topic, key=key, value=value)
            await self._producer.send_offsets_to_transaction({TopicPartition(self.source_topic, 0): source_offset}, self.group)
