"""Helpers for the warehouse tests: contract-v1 events into a real topic, and loads."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.support.kafka import create_topic, produce
from walbus.contract import encode_event, event_key, split_table
from walbus.kafka import KafkaOptions
from warehouse import layout


async def _produce(bootstrap: str, topic: str, records: Sequence[tuple[bytes, bytes]], partitions: int) -> None:
    await create_topic(bootstrap, topic, partitions=partitions)
    await produce(bootstrap, topic, records, partition=0)


def produce_events(bootstrap: str, topic: str, events: Iterable[bytes], partitions: int = 1) -> None:
    """Send contract-v1 event values (keyed as the producer keys them) to ``topic``."""
    import orjson

    records = []
    for value in events:
        obj = orjson.loads(value)
        records.append((event_key(obj["commit_lsn"], obj["seq"]), value))
    asyncio.run(_produce(bootstrap, topic, records, partitions))


def produce_records(bootstrap: str, topic: str, records: Sequence[tuple[bytes, bytes]]) -> None:
    """Send (key, value) records as they are, valid or not, to partition 0 of ``topic``."""
    asyncio.run(_produce(bootstrap, topic, records, 1))


@dataclass
class Txn:
    """Builds the events of one transaction with consecutive seq numbers."""

    commit_lsn: int
    xid: int = 1000
    timestamp: str = "2024-01-02T03:04:05.123456+00:00"
    events: list[bytes] = field(default_factory=list)

    def _emit(self, operation: str, table: str, pk: Sequence[str], new: dict[str, Any] | None,
              identity: dict[str, Any] | None, unchanged: Sequence[str] = (), lsn: int | None = None) -> Txn:
        seq = len(self.events)
        self.events.append(
            encode_event(
                lsn=lsn if lsn is not None else self.commit_lsn - 100 + seq,
                commit_lsn=self.commit_lsn,
                seq=seq,
                xid=self.xid,
                operation=operation,
                table=table,
                timestamp=self.timestamp,
                pk=list(pk),
                new=new,
                identity=identity,
                unchanged=list(unchanged),
            )
        )
        return self

    def insert(self, table: str, pk: Sequence[str], row: dict[str, tuple[str, Any]]) -> Txn:
        return self._emit("insert", table, pk, image(row), None)

    def update(self, table: str, pk: Sequence[str], row: dict[str, tuple[str, Any]],
               identity: dict[str, tuple[str, Any]] | None = None, unchanged: Sequence[str] = ()) -> Txn:
        ident = identity if identity is not None else {k: row[k] for k in pk}
        return self._emit("update", table, pk, image(row), image(ident), unchanged)

    def delete(self, table: str, pk: Sequence[str], identity: dict[str, tuple[str, Any]]) -> Txn:
        return self._emit("delete", table, pk, None, image(identity))

    def truncate(self, table: str, pk: Sequence[str]) -> Txn:
        return self._emit("truncate", table, pk, None, None)


def image(row: dict[str, tuple[str, Any]]) -> dict[str, list[Any]]:
    """{"col": (pg type, value)} -> {columns, types, values}."""
    return {
        "columns": list(row),
        "types": [t for t, _ in row.values()],
        "values": [v for _, v in row.values()],
    }


def kafka_options(bootstrap: str) -> KafkaOptions:
    return KafkaOptions(kafka_bootstrap=bootstrap)


def table_paths(warehouse: object, topic: str, table: str) -> layout.TablePaths:
    """The paths of the table named ``table`` in the events (``schema.table``, qualify_table's form)."""
    return layout.table_paths(str(warehouse), topic, *split_table(table))
