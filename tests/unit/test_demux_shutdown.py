"""A SIGTERM while the demux is still retrying its start is a clean stop, not a crash (no services)."""

from __future__ import annotations

import asyncio

from aiokafka.errors import KafkaConnectionError

from demux.config import parse_config
from demux.service import Demux


def _demux() -> Demux:
    return Demux(parse_config(["--kafka-bootstrap", "127.0.0.1:1", "--source-topic", "walbus.db"]))


def test_stop_during_start_retries_ends_cleanly() -> None:
    demux = _demux()
    attempts = 0

    async def start() -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 2:
            demux.stop()  # the signal arrives while the second attempt is under way
        raise KafkaConnectionError("broker unreachable")

    started = asyncio.run(demux._start_with_retry(start, "consumer"))
    assert started is False
    assert attempts == 2


def test_start_retries_until_it_succeeds() -> None:
    demux = _demux()
    attempts = 0

    async def start() -> None:
        nonlocal attempts
        attempts += 1
        if attempts < 2:
            raise KafkaConnectionError("broker unreachable")

    assert asyncio.run(demux._start_with_retry(start, "consumer")) is True
    assert attempts == 2
