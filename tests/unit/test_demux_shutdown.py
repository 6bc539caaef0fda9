"""A SIGTERM while the demux is still retrying its start is a clean stop, not a crash (no services)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiokafka.errors import KafkaConnectionError

from demux.config import parse_config
from demux.service import Demux


@dataclass
class FlakyStart:
    """A client's start that fails its first ``failures`` attempts; with ``stop_on``, the
    demux gets SIGTERM during that attempt (which fails too)."""

    demux: Demux
    failures: int
    stop_on: int | None = None
    attempts: int = 0

    async def __call__(self) -> None:
        self.attempts += 1
        if self.attempts == self.stop_on:
            self.demux.stop()
            raise KafkaConnectionError("broker unreachable")
        if self.attempts <= self.failures:
            raise KafkaConnectionError("broker unreachable")


def _demux() -> Demux:
    return Demux(parse_config(["--kafka-bootstrap", "127.0.0.1:1", "--source-topic", "walbus.db"]))


def test_stop_during_start_retries_ends_cleanly() -> None:
    demux = _demux()
    start = FlakyStart(demux, failures=10, stop_on=2)  # the signal arrives during the second attempt
    assert asyncio.run(demux._start_with_retry(start, "consumer")) is False
    assert start.attempts == 2


def test_start_retries_until_it_succeeds() -> None:
    demux = _demux()
    start = FlakyStart(demux, failures=1)
    assert asyncio.run(demux._start_with_retry(start, "consumer")) is True
    assert start.attempts == 2
