"""walbus on Kafka 3.9: the local stack's version before 4.x, still supported.

The session's services run the default (4.x); this module starts its own single-node
3.9.1 broker and runs the transactional flow and the whole producer -> demux path on it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.kafka import create_topic
from tests.support.stack import (
    PRODUCE_API_KEY,
    api_versions,
    offsets_in_transaction,
    producer_demux_roundtrip,
    transactional_commit_and_abort,
)
from walbus.app.dev.kafka import KAFKA_3_VERSION, KafkaInstance
from walbus.app.dev.processes import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def kafka39() -> Iterator[str]:
    state = Path(tempfile.mkdtemp(prefix="walbus-kafka39-"))
    broker = KafkaInstance(state, free_port(), free_port(), version=KAFKA_3_VERSION)
    try:
        broker.start()
        yield broker.bootstrap
    finally:
        broker.stop()
        shutil.rmtree(state, ignore_errors=True)


async def test_the_broker_is_3_9(kafka39: str) -> None:
    # Kafka 4.0 stopped serving Produce v0-v2 (KIP-896); 3.9 still serves them.
    assert (await api_versions(kafka39))[PRODUCE_API_KEY][0] == 0


async def test_transactions_commit_and_abort_on_3_9(kafka39: str, unique_name: str) -> None:
    await create_topic(kafka39, unique_name)
    seen = await transactional_commit_and_abort(kafka39, unique_name)
    assert seen == [b"commit-0-%d" % i for i in range(3)] + [b"commit-2-%d" % i for i in range(3)]


async def test_offsets_in_a_transaction_on_3_9(kafka39: str, unique_name: str) -> None:
    await create_topic(kafka39, unique_name)
    assert await offsets_in_transaction(kafka39, unique_name, f"{unique_name}.group") == {0: 7}


async def test_producer_and_demux_on_3_9(pg_dsn: str, kafka39: str, unique_name: str, tmp_path: Path) -> None:
    await producer_demux_roundtrip(pg_dsn, kafka39, f"walbus.{unique_name}", tmp_path)
