"""walbus.client.testing as a service team would use it: a few lines against the real pipeline."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.services import Services
    from walbus.client.testing import Pipeline

pytest_plugins = ["walbus.client.testing"]  # the walbus_pipeline fixture
pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _walbus_env(services: Services, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin reads the endpoints from the environment, as a team's CI would set them; here
    they are the suite's own services (which need no environment when the suite starts them)."""
    monkeypatch.setenv("WALBUS_PG_DSN", services.pg_dsn)
    monkeypatch.setenv("WALBUS_KAFKA_BOOTSTRAP", services.kafka_bootstrap)


async def test_a_subscriber_sees_typed_rows(walbus_pipeline: Pipeline) -> None:
    walbus_pipeline.execute(
        "CREATE TABLE orders (id int PRIMARY KEY, total numeric(12,2), tags text[])",
        "INSERT INTO orders VALUES (1, 12.5, '{a,\"b c\"}')",
        "UPDATE orders SET total = 13 WHERE id = 1",
    )
    async with walbus_pipeline.feed(group_id="notify", tables=["public.orders"]) as feed:
        inserted, updated = await walbus_pipeline.events(feed, 2)
    assert inserted.operation == "insert" and updated.operation == "update"
    assert inserted.row() == {"id": 1, "total": "12.50", "tags": '{a,"b c"}'}
    assert inserted.typed_row() == {"id": 1, "total": Decimal("12.50"), "tags": ["a", "b c"]}
    assert updated.typed_row() == {"id": 1, "total": Decimal("13.00"), "tags": ["a", "b c"]}


async def _topics_left(bootstrap: str, topic: str) -> list[str]:
    """``topic`` and the topics named under it still on the broker, once deletions settled."""
    from walbus.kafka import KafkaAdmin

    async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
        for _ in range(100):  # a deletion reaches the metadata a moment later
            left = sorted(t for t in await admin.list_topics() if t == topic or t.startswith(f"{topic}."))
            if not left:
                break
            await asyncio.sleep(0.2)
    return left


async def test_the_pipeline_leaves_no_topic_behind(services: Services) -> None:
    """The fixture deleted the database topic only: its .progress and .heartbeat topics stayed."""
    from walbus.client.testing import pipeline

    async with pipeline() as p:
        p.execute("CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t VALUES (1)")
        async with p.feed() as feed:
            await p.events(feed, 1)
        topic = p.topic
    assert await _topics_left(services.kafka_bootstrap, topic) == []


async def test_the_pipeline_leaves_no_dead_letter_topic_behind(services: Services) -> None:
    """A subscriber test whose group dead-letters an event (or replays) made the group's
    `<topic>.group--<group>.dlq` / `.replay` topics, which the fixture left on the broker."""
    from walbus.client import FeedEvent, RetryPolicy, replay_dead_letters
    from walbus.client.deadletters import dead_letter_topic, replay_topic
    from walbus.client.testing import pipeline
    from walbus.kafka import KafkaAdmin

    kafka = {"bootstrap_servers": services.kafka_bootstrap}
    async def poison(event: FeedEvent) -> None:
        raise ValueError("poison")

    async with pipeline() as p:
        p.execute("CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t VALUES (1)")
        async with p.feed() as feed:
            await p.events(feed, 1)  # in the topic: until_end below reads it
        async with p.feed(group_id="billing", retry=RetryPolicy(attempts=1), until_end=True) as feed:
            async with asyncio.timeout(60):
                await feed.run(poison)
        assert feed.stats.dead_letters == 1
        assert len(await replay_dead_letters(kafka, p.topic, "billing")) == 1
        topic = p.topic
        async with KafkaAdmin(client_kwargs=kafka) as admin:
            assert {dead_letter_topic(topic, "billing"), replay_topic(topic, "billing")} <= set(await admin.list_topics())
    assert await _topics_left(services.kafka_bootstrap, topic) == []
