"""A consumer group's dead letters: events its handler failed on after every retry.

They go to ``<topic>.group--<group>.dlq`` (the group's name escaped as a topic-name part), as
the original record (same key and value) with headers that say why and from where:

``walbus-error`` (the exception, ``Type: message``), ``walbus-attempts``, ``walbus-group``,
``walbus-topic``, ``walbus-partition``, ``walbus-offset`` (the original record's position in
the database topic) and ``walbus-failed-at`` (ISO 8601, UTC).

``replay`` copies the dead letters not replayed yet to ``<topic>.group--<group>.replay``, which a
``Feed`` of that group reads besides the database topic (without its duplicate check: a
replayed event is old on purpose). The topics are created on first use; a running member
sees a new replay topic at its consumer's next metadata refresh (``metadata_max_age_ms``,
5 minutes by default) or restart. How far a group's dead letters were replayed is the
committed offset of the consumer group ``<group>.dlq-replay`` on the dead-letter topic.

The "group--" part keeps them apart from the per-table topics: their earlier names,
``<topic>.<group>.dlq`` and ``.replay``, were the table topics of a table ``dlq`` or ``replay``
in a schema named as the group (an escaped name never holds "--", and a long table topic's
hashed form has it only before its hash, at the end). Records this group left in those earlier
topics (told by their ``walbus-group`` header, which no table row has) are listed, and
``replay`` moves them to the new replay topic: its dead letters not replayed yet, and replayed
events the group had not read yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError

from walbus.contract import escape_topic_part, topic_name_error
from walbus.kafka import (
    DEFAULT_MAX_MESSAGE_BYTES,
    METADATA_WAIT_S,
    KafkaAdmin,
    TopicSpec,
    cut_to_fit,
    topic_partitions,
)
from walbus.retry import Backoff

log = logging.getLogger("walbus.client.deadletters")

H_ERROR = "walbus-error"
H_ATTEMPTS = "walbus-attempts"
H_GROUP = "walbus-group"
H_TOPIC = "walbus-topic"
H_PARTITION = "walbus-partition"
H_OFFSET = "walbus-offset"
H_FAILED_AT = "walbus-failed-at"

_MAX_ERROR_CHARS = 2000


GROUP_TOPIC_MARK: Final = "group--"


def dead_letter_topic(topic: str, group: str) -> str:
    return f"{topic}.{GROUP_TOPIC_MARK}{escape_topic_part(group)}.dlq"


def replay_topic(topic: str, group: str) -> str:
    return f"{topic}.{GROUP_TOPIC_MARK}{escape_topic_part(group)}.replay"


def earlier_group_topics(topic: str, group: str) -> tuple[str, str]:
    """The dead-letter and replay topics' names before the "group--" part: maybe a table's."""
    part = escape_topic_part(group)
    return f"{topic}.{part}.dlq", f"{topic}.{part}.replay"


def replay_group(group: str) -> str:
    return f"{group}.dlq-replay"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a record came from in the database topic."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record of a dead-letter topic, with its headers decoded."""

    offset: int  # in the dead-letter topic
    key: bytes | None
    value: bytes | None
    error: str
    attempts: int
    origin: Origin | None
    failed_at: str
    topic: str | None = None  # the dead-letter topic (the group's, or its earlier name)

    def to_json_obj(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "offset": self.offset,
            "key": self.key.decode("utf-8", "replace") if self.key is not None else None,
            "value": self.value.decode("utf-8", "replace") if self.value is not None else None,
            "error": self.error,
            "attempts": self.attempts,
            "origin": None if self.origin is None else {"topic": self.origin.topic, "partition": self.origin.partition, "offset": self.origin.offset},
            "failed_at": self.failed_at,
        }


def error_text(error: BaseException | str) -> str:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return text[:_MAX_ERROR_CHARS]


def dead_letter_headers(*, error: str, attempts: int, group: str, origin: Origin) -> list[tuple[str, bytes]]:
    return [
        (H_ERROR, error.encode("utf-8", "replace")),
        (H_ATTEMPTS, str(attempts).encode()),
        (H_GROUP, group.encode()),
        (H_TOPIC, origin.topic.encode()),
        (H_PARTITION, str(origin.partition).encode()),
        (H_OFFSET, str(origin.offset).encode()),
        (H_FAILED_AT, datetime.now(UTC).isoformat().encode()),
    ]


def origin_of(headers: Sequence[tuple[str, bytes]]) -> Origin | None:
    """The original position a dead or replayed record carries in its headers."""
    h = dict(headers)
    try:
        return Origin(h[H_TOPIC].decode(), int(h[H_PARTITION]), int(h[H_OFFSET]))
    except (KeyError, ValueError, UnicodeDecodeError):
        return None


def _is_groups(msg: Any, group: bytes) -> bool:
    """A record of ``group``'s, in a topic with an earlier group topic's name (which may be a
    table's topic: its rows carry no ``walbus-group`` header)."""
    return any(k == H_GROUP and v == group for k, v in (msg.headers or ()))


def _decode(msg: Any) -> DeadLetter:
    h = {k: v for k, v in (msg.headers or ())}
    try:
        attempts = int(h.get(H_ATTEMPTS, b"0"))
    except ValueError:
        attempts = 0
    return DeadLetter(
        offset=msg.offset,
        key=msg.key,
        value=msg.value,
        error=h.get(H_ERROR, b"").decode("utf-8", "replace"),
        attempts=attempts,
        origin=origin_of(list(msg.headers or ())),
        failed_at=h.get(H_FAILED_AT, b"").decode("utf-8", "replace"),
        topic=msg.topic,
    )


class DeadLetterError(RuntimeError):
    """A dead letter that can never be written (the broker refuses it for good)."""


# The group topics take records as large as the database topic's (a dead letter is an event
# with headers): with aiokafka's 1 MB default a larger event's dead letter was refused, and
# retried forever, and the feed never got past it (a fuzz).
LARGE_TOPIC: Final = (("max.message.bytes", str(DEFAULT_MAX_MESSAGE_BYTES)),)


def group_topics(topic: str, group: str) -> tuple[str, str]:
    """The group's dead-letter and replay topics; ValueError when Kafka could not have them (a
    long topic and group id: the dead letter would have been retried forever)."""
    names = (dead_letter_topic(topic, group), replay_topic(topic, group))
    for name in names:
        error = topic_name_error(name)
        if error is not None:
            raise ValueError(f"the dead-letter topics of group {group!r} on {topic}: {error}; use a shorter group_id, or dead_letters=False")
    return names


class DeadLetterWriter:
    """Writes a group's dead letters; creates the topics on first use, retries until written."""

    def __init__(self, client_kwargs: Mapping[str, Any], topic: str, group: str) -> None:
        self._kwargs = dict(client_kwargs)
        self.topic = group_topics(topic, group)[0]
        self.group = group
        self._producer: AIOKafkaProducer | None = None
        self._limit = DEFAULT_MAX_MESSAGE_BYTES
        # Several run() lanes dead-letter at once: one producer for all (each started its own,
        # and all but one were never stopped; a client fuzz).
        self._starting = asyncio.Lock()
        self._recheck = False  # a write failed: the topic may be gone (deleted under the feed)

    async def _ensure_topic(self) -> None:
        async with KafkaAdmin(client_kwargs=self._kwargs) as admin:
            await admin.ensure_topic(TopicSpec(self.topic, configs=LARGE_TOPIC))
            self._limit = await admin.max_message_bytes(self.topic, wait=METADATA_WAIT_S)

    async def _started(self) -> AIOKafkaProducer:
        async with self._starting:
            if self._recheck and self._producer is not None:
                # Made once, the topic was taken for granted: deleted under a running feed, each
                # dead letter was retried forever against a topic nobody made again (the feed
                # stalled; the broker does not create it). Made again here, as on first use.
                await self._ensure_topic()
                self._recheck = False
            if self._producer is None:
                await self._ensure_topic()
                self._recheck = False
                producer = AIOKafkaProducer(**self._kwargs, acks="all", enable_idempotence=True,
                                            max_request_size=DEFAULT_MAX_MESSAGE_BYTES)
                try:
                    await producer.start()
                except BaseException:
                    await producer.stop()
                    raise
                self._producer = producer
            return self._producer

    async def write(self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> None:
        """Send one dead letter; transient faults are retried with backoff (never dropped).
        One the topic cannot take whole is cut to fit, and says so in its headers; a fault that
        retrying cannot mend raises :class:`DeadLetterError`."""
        backoff = Backoff(initial=0.5, maximum=30.0)
        while True:
            try:
                producer = await self._started()
                fitted = cut_to_fit(self._limit, key, value, headers)
                await producer.send_and_wait(self.topic, key=fitted[0], value=fitted[1], headers=fitted[2])
                return
            except KafkaError as e:
                if not e.retriable and not isinstance(e, KafkaConnectionError | KafkaTimeoutError):
                    raise DeadLetterError(f"cannot write a dead letter to {self.topic}: {type(e).__name__}: {e}") from e
                self._recheck = True
                await backoff.wait(log, f"writing a dead letter to {self.topic}", e)

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()


async def _read_all(kwargs: Mapping[str, Any], topic: str, *, group: str | None = None,
                    start_group: str | None = None) -> tuple[list[Any], AIOKafkaConsumer]:
    """Every partition of ``topic`` (a group's own topics have one; an earlier name may be a
    table's topic of several) from ``group``'s committed offset (else from ``start_group``'s,
    else from the beginning) to its end, partition after partition, and the consumer (to
    commit; the caller stops it)."""
    tps = await topic_partitions(kwargs, topic, wait=False)
    consumer = AIOKafkaConsumer(**kwargs, group_id=group, enable_auto_commit=False, auto_offset_reset="earliest", isolation_level="read_committed")
    try:
        await consumer.start()
        consumer.assign(tps)
        out: list[Any] = []
        for tp in tps:
            if start_group is not None and group is not None and await consumer.committed(tp) is None:
                start = await committed_offset(kwargs, start_group, tp)
                if start is not None:
                    consumer.seek(tp, start)
            end = (await consumer.end_offsets([tp]))[tp]
            while await consumer.position(tp) < end:
                batches = await consumer.getmany(tp, timeout_ms=1000)
                out += [m for m in batches.get(tp, []) if m.offset < end]
        return out, consumer
    except BaseException:
        await consumer.stop()
        raise


async def committed_offset(kwargs: Mapping[str, Any], group: str, tp: TopicPartition) -> int | None:
    consumer = AIOKafkaConsumer(**kwargs, group_id=group, enable_auto_commit=False)
    try:
        await consumer.start()
        committed: int | None = await consumer.committed(tp)
        return committed
    finally:
        await consumer.stop()


async def list_dead_letters(client_kwargs: Mapping[str, Any], topic: str, group: str) -> list[DeadLetter]:
    """Every dead letter of ``group`` on ``topic`` (empty if it never had one): those left in
    the earlier topic name first, then the dead-letter topic's."""
    dlq, earlier = dead_letter_topic(topic, group), earlier_group_topics(topic, group)[0]
    async with KafkaAdmin(client_kwargs=dict(client_kwargs)) as admin:
        existing = set(await admin.list_topics())
    out: list[DeadLetter] = []
    for name in (earlier, dlq):
        if name in existing:
            msgs, consumer = await _read_all(client_kwargs, name)
            await consumer.stop()
            out += [_decode(m) for m in msgs if name == dlq or _is_groups(m, group.encode())]
    return out


async def list_demux_dead_letters(client_kwargs: Mapping[str, Any], dlq_topic: str) -> list[DeadLetter]:
    """Every record of a demux's dead-letter topic (``<database topic>.dlq``): its reason
    (``walbus.error``) and the source record it stands for (``walbus.source.*``)."""
    async with KafkaAdmin(client_kwargs=dict(client_kwargs)) as admin:
        if dlq_topic not in await admin.list_topics():
            return []
    msgs, consumer = await _read_all(client_kwargs, dlq_topic)
    await consumer.stop()
    out = []
    for m in msgs:
        h = {k: v for k, v in (m.headers or ())}
        try:
            origin: Origin | None = Origin(h["walbus.source.topic"].decode(), int(h["walbus.source.partition"]), int(h["walbus.source.offset"]))
        except (KeyError, ValueError, UnicodeDecodeError):
            origin = None
        error = h.get("walbus.error", b"").decode("utf-8", "replace")
        if "walbus.value.cut" in h:
            error += f" ({h['walbus.value.cut'].decode('utf-8', 'replace')}: value cut)"
        out.append(DeadLetter(offset=m.offset, key=m.key, value=m.value, error=error, attempts=0, origin=origin, failed_at=""))
    return out


async def replay_dead_letters(client_kwargs: Mapping[str, Any], topic: str, group: str) -> list[DeadLetter]:
    """Send the dead letters not replayed yet back to the group (its replay topic); returns them.

    The replay group's offset is committed after the copies are written: a replay that fails
    half-way is done again, and the feed may see those events twice. The group's records in the
    earlier topic names are moved too (module doc): the dead letters, with the same progress
    as before, and the replayed events past the group's committed offset there."""
    dlq, replay = group_topics(topic, group)
    earlier_dlq, earlier_replay = earlier_group_topics(topic, group)
    async with KafkaAdmin(client_kwargs=dict(client_kwargs)) as admin:
        existing = set(await admin.list_topics())
    out: list[DeadLetter] = []
    for name in (earlier_dlq, earlier_replay, dlq):
        if name not in existing:
            continue
        # The earlier replay topic: from where the group had read it.
        msgs, consumer = await _read_all(client_kwargs, name, group=replay_group(group),
                                         start_group=group if name == earlier_replay else None)
        try:
            copies = msgs if name == dlq else [m for m in msgs if _is_groups(m, group.encode())]
            if copies:
                await _copy(client_kwargs, replay, copies)
            if name == earlier_replay:
                if copies:
                    log.warning("replayed events moved from the group's earlier replay topic",
                                extra={"from": name, "to": replay, "events": len(copies), "group": group})
            else:
                out += [_decode(m) for m in copies]
            if msgs:
                await consumer.commit({TopicPartition(name, m.partition): m.offset + 1 for m in msgs})
        finally:
            await consumer.stop()
    return out


async def _copy(client_kwargs: Mapping[str, Any], replay: str, msgs: Sequence[Any]) -> None:
    async with KafkaAdmin(client_kwargs=dict(client_kwargs)) as admin:
        await admin.ensure_topic(TopicSpec(replay, configs=LARGE_TOPIC))
    producer = AIOKafkaProducer(**client_kwargs, acks="all", enable_idempotence=True, max_request_size=DEFAULT_MAX_MESSAGE_BYTES)
    await producer.start()
    try:
        # Each send's result is awaited: flush() only waits, and a copy the broker refused (a
        # replay topic made with a smaller limit, no write access) was dropped while the caller
        # committed the letter as replayed. Failing here commits nothing: run the replay again.
        sent = [await producer.send(replay, key=m.key, value=m.value, headers=list(m.headers or ())) for m in msgs]
        await asyncio.gather(*sent)
    except KafkaError as e:
        raise DeadLetterError(
            f"cannot replay dead letters to {replay}: {type(e).__name__}: {e}; none was marked replayed "
            "(those copied already come again with the next replay)"
        ) from e
    finally:
        await producer.stop()
