"""The dead-letter record of a source record: the record whole, with headers that say why and whence."""

from __future__ import annotations

from aiokafka import TopicPartition

from walbus.kafka import cut_to_fit

Headers = list[tuple[str, bytes]]


def dead_letter_record(source: TopicPartition, offset: int, key: bytes | None, value: bytes | None,
                       error: str, max_bytes: int) -> tuple[bytes | None, bytes | None, Headers]:
    """(key, value, headers) for the dead-letter topic; cut, and said so, only when it cannot take them whole."""
    headers = [
        ("walbus.error", error.encode()[:4000]),
        ("walbus.source.topic", source.topic.encode()),
        ("walbus.source.partition", str(source.partition).encode()),
        ("walbus.source.offset", str(offset).encode()),
    ]
    return cut_to_fit(max_bytes, key, value, headers)
