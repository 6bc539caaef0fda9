"""Output topics: created on first sight, checked once, partition counts and size limits cached.

Errors are sorted once per topic: a transient one (broker unreachable, timeouts, a
leader moving) is retried with backoff and, if it lasts, fails the worker (which
reopens from the committed offset); a permanent one (an invalid or colliding name,
a policy, an authorization) makes the topic *unusable*: its records go to the DLQ
and the other tables go on. A name Kafka finds colliding ('.' and '_' are one
character to it) is reported as such, so that the caller can take the table's
hash-suffixed name instead (walbus.contract.table_topic).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Final

from aiokafka.errors import BrokerResponseError, InvalidTopicError, KafkaError

from demux.config import DemuxConfig
from walbus.kafka import METADATA_WAIT_S, KafkaAdmin, TopicSpec
from walbus.retry import Backoff

log = logging.getLogger("walbus.demux.topics")


@dataclass(frozen=True, slots=True)
class TopicInfo:
    partitions: int
    # The topic's max.message.bytes: the largest record batch it accepts.
    max_bytes: int = 0
    # None: writable. Otherwise why records cannot go there (they go to the DLQ instead).
    unusable: str | None = None
    # Kafka refused the name as colliding with an existing topic's.
    collides: bool = False


REFRESH_S: Final = 5.0  # a topic's settings are read again at most this often (see TopicManager.refresh)


class TopicManager:
    def __init__(self, admin: KafkaAdmin, config: DemuxConfig, *, stop: asyncio.Event | None = None) -> None:
        self._admin = admin
        self._config = config
        self._stop = stop  # set on SIGTERM: retries end
        self._known: dict[str, TopicInfo] = {}
        self._refreshed: dict[str, float] = {}  # when each topic's settings were last read again (refresh)
        self._compact: dict[str, bool] = {}
        self._lock = asyncio.Lock()

    def cached(self, topic: str) -> TopicInfo | None:
        return self._known.get(topic)

    async def refresh(self, topics: set[str]) -> bool:
        """Read the settings of ``topics`` again, each at most once a REFRESH_S (a record too
        large for a topic's limit as read before: it may have been raised since, and without a
        restart every such record went to the DLQ; a fuzz). True when any was read again."""
        now = time.monotonic()
        due = [t for t in topics if t in self._known and now - self._refreshed.get(t, 0.0) >= REFRESH_S]
        for topic in due:
            self._refreshed[topic] = now
            compact = self._compact.get(topic, True)
            async with self._lock:
                self._known.pop(topic, None)
            await self.ensure(topic, compact=compact)
        return bool(due)

    def forget(self) -> None:
        """Drop what is cached: the next record of each topic reads its settings again
        (a broker refused a batch as too large, so a limit changed since it was read)."""
        self._known.clear()

    async def ensure(self, topic: str, *, compact: bool) -> TopicInfo:
        """The topic's settings, as checked for a keyed (``compact``) or a keyless table's rows.

        A table dropped and created again with or without a primary key asks with the other
        ``compact``: the check runs again (a keyless table's rows sent to the compacted topic
        its keyed namesake had created were refused by the broker, and the worker reopened on
        them forever, stalling its partition; a fuzz)."""
        info = self._known.get(topic)
        if info is not None and self._compact.get(topic) == compact:
            return info
        async with self._lock:  # several partition workers may meet a new table at once
            info = self._known.get(topic)
            if info is None or self._compact.get(topic) != compact:
                info = await self._ensure(topic, compact)
                self._known[topic] = info
                self._compact[topic] = compact
            return info

    async def _ensure(self, topic: str, compact: bool) -> TopicInfo:
        cfg = self._config
        spec = TopicSpec(
            topic,
            partitions=cfg.topic_partitions,
            replication_factor=cfg.topic_replication_factor,
            configs=cfg.topic_configs(compact=compact),
        )
        backoff = Backoff(initial=0.5, maximum=10.0, attempts=8)
        while True:
            try:
                created = await self._admin.ensure_topic(spec)
                unusable = None if created else await self._check_policy(topic, compact)
                partitions = await self._admin.partitions(topic, wait=METADATA_WAIT_S)
                max_bytes = await self._admin.max_message_bytes(topic, wait=METADATA_WAIT_S)
                return TopicInfo(partitions, max_bytes, unusable)
            except KafkaError as e:
                if _transient(e):
                    await backoff.wait(log, f"creating/describing topic {topic}", e, stop=self._stop)
                    if self._stop is not None and self._stop.is_set():
                        raise
                    continue
                return _unusable(topic, e)

    async def _check_policy(self, topic: str, compact: bool) -> str | None:
        conf = await self._admin.topic_config(topic, ["cleanup.policy"])
        policy = conf.get("cleanup.policy", "delete")
        policies = {p.strip() for p in policy.split(",")}
        if compact and "compact" not in policies:
            log.warning(
                "existing per-table topic is not compacted; it will keep every version instead of the latest row per key",
                extra={"topic": topic, "setting": "cleanup.policy", "value": policy, "expected": "compact"},
            )
        elif not compact and "compact" in policies:
            log.warning(
                "existing topic of a table without primary key is compacted; keyless rows cannot be written there, "
                "they go to the dead-letter topic",
                extra={"topic": topic, "setting": "cleanup.policy", "value": policy, "expected": "delete"},
            )
            return f"topic {topic} has cleanup.policy={policy}: a compacted topic refuses records without key"
        return None


def _transient(error: KafkaError) -> bool:
    """Worth retrying: anything but an error answer the broker marks as final."""
    return not isinstance(error, BrokerResponseError) or bool(error.retriable)


def _unusable(topic: str, error: KafkaError) -> TopicInfo:
    collides = isinstance(error, InvalidTopicError) and "collides" in str(error)
    reason = f"topic {topic} cannot be created or described: {error}"
    if not collides:  # a collision is no failure: the worker takes the hashed name (and logs it)
        log.error("topic refused by Kafka; its records go to the dead-letter topic",
                  extra={"topic": topic, "error": str(error)[:500]})
    return TopicInfo(0, 0, reason, collides)
