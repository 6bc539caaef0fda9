"""A warehouse load fixes its slice from the topic's bounds; a broker that does not answer
while it does so is a transient fault, waited out, not a failed load."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import NodeNotReadyError, TopicAuthorizationFailedError

from tests.support.kafka import create_topic, produce
from walbus.kafka import KafkaAdmin, KafkaOptions
from warehouse.read import TopicError, topic_bounds

pytestmark = pytest.mark.integration


async def test_bounds_wait_out_a_node_not_ready_while_listing_topics(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's load died with NodeNotReadyError from the topic listing (a broker was down):
    only the offsets were retried. The real broker answers; the first two listings fail."""
    topic = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, topic, partitions=2)
    await produce(kafka_bootstrap, topic, [(b"k%d" % i, b"v") for i in range(3)], partition=1)
    real = KafkaAdmin.list_topics
    failures = []

    async def flaky(self: KafkaAdmin) -> set[str]:
        if len(failures) < 2:
            failures.append(1)
            raise NodeNotReadyError("node 2 is not ready (the test's fault)")
        return await real(self)

    monkeypatch.setattr(KafkaAdmin, "list_topics", flaky)
    bounds = await asyncio.to_thread(topic_bounds, KafkaOptions(kafka_bootstrap=kafka_bootstrap), topic)
    assert len(failures) == 2
    assert bounds.earliest == {0: 0, 1: 0}
    assert bounds.latest == {0: 0, 1: 3}


async def test_bounds_do_not_retry_a_missing_topic_or_a_fatal_error(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = KafkaOptions(kafka_bootstrap=kafka_bootstrap)
    with pytest.raises(TopicError, match="does not exist"):
        await asyncio.to_thread(topic_bounds, options, f"walbus.{unique_name}.missing")
    calls: list[Any] = []

    async def fatal(self: KafkaAdmin) -> set[str]:
        calls.append(1)
        raise TopicAuthorizationFailedError("the test's fault")

    monkeypatch.setattr(KafkaAdmin, "list_topics", fatal)
    with pytest.raises(TopicAuthorizationFailedError):
        await asyncio.to_thread(topic_bounds, options, f"walbus.{unique_name}")
    assert len(calls) == 1
