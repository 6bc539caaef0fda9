"""Feed.start() against an address where no broker listens: the error, and nothing left open."""

from __future__ import annotations

import gc
import socket

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaConnectionError

from walbus.client import Feed


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open_consumers(bootstrap: str) -> list[AIOKafkaConsumer]:
    gc.collect()
    return [
        o
        for o in gc.get_objects()
        if isinstance(o, AIOKafkaConsumer) and not o._closed and o._client._bootstrap_servers == bootstrap
    ]


@pytest.mark.parametrize("group_id", [None, "g"])
async def test_start_does_not_leak_its_consumer_when_the_broker_is_unreachable(group_id: str | None) -> None:
    bootstrap = f"127.0.0.1:{_unused_port()}"
    feed = Feed("walbus.nowhere", group_id=group_id, bootstrap_servers=bootstrap)
    with pytest.raises(KafkaConnectionError):
        await feed.start()
    assert _open_consumers(bootstrap) == []
    await feed.stop()  # a no-op: nothing was started


def test_start_forms() -> None:
    from datetime import UTC, datetime

    from walbus.client.start import parse_start, start_floor
    from walbus.contract import Lsn

    assert parse_start("latest") == "latest" and parse_start("earliest") == "earliest"
    assert parse_start("16/B374D848") == Lsn.parse("16/B374D848")
    assert parse_start(5) == 5 and isinstance(parse_start(5), Lsn)
    moment = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_start(moment) == moment
    assert parse_start("2026-01-02T03:04:05+00:00") == moment
    for bad in ["newest", "2026-01-02T03:04:05", -1, True, datetime(2026, 1, 2)]:
        with pytest.raises(ValueError):
            parse_start(bad)  # type: ignore[arg-type]
    assert start_floor(Lsn(0x10)) == (0xF, 0xFFFFFFFF)
    assert start_floor(Lsn(0)) is None and start_floor("latest") is None
    with pytest.raises(ValueError):
        Feed("t", bootstrap_servers="x:1", start="newest")
