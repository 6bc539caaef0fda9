"""The dead-letter record of a source record: the record whole, with headers that say why and whence."""

from __future__ import annotations

from aiokafka import TopicPartition

from walbus.kafka import RECORD_OVERHEAD_BYTES, record_fits

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
    header_bytes = sum(len(k) + len(v) for k, v in headers) + 200  # + the cut headers below
    if not record_fits(max_bytes, key, value, header_bytes):
        size = len(key or b"") + len(value or b"")
        headers.append(("walbus.value.truncated", str(len(value or b"")).encode()))
        headers.append(("walbus.value.cut", f"source record of {size} bytes is over the dead-letter "
                        f"topic's max.message.bytes={max_bytes}".encode()))
        key = key[:1000] if key is not None else None
        room = max_bytes - RECORD_OVERHEAD_BYTES - header_bytes - len(key or b"")
        value = (value or b"")[:max(0, room)]
    if key is None and value is None:
        value = b""  # a record needs a key or a value: an empty value stands for neither
    return key, value, headers
