"""walbus_native's Kafka record batches (NativeBatch) against aiokafka's own BatchBuilder: the
same records taken before the batch is full, the same bytes read back, a valid CRC-32C,
uncompressed and LZ4 (aiokafka decompresses ours with its own codec)."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from hypothesis import example, given, settings
from hypothesis import strategies as st

from walbus.aiokafka_shortcuts import NativeBatch, OutputBatch, _native_batches
from walbus.native import native_module

PAYLOADS = st.one_of(st.none(), st.binary(max_size=40), st.binary(min_size=100, max_size=3000))


def _read(batch: BatchBuilder) -> tuple[Any, ...]:
    built = MemoryRecords(bytes(batch._build())).next_batch()
    crc = built.validate_crc()  # before iterating, as aiokafka's batch requires
    records = [(r.offset, r.key, r.value, r.headers) for r in built]
    return (crc, built.compression_type, built.producer_id, built.producer_epoch, built.base_sequence,
            built.is_transactional, built.next_offset, records)


@settings(max_examples=300)
# A record that would fill the batch to exactly its size: aiokafka refuses it (found by this test).
@example([(None, None)] * 7 + [(None, b"\0"), (b"\0", b"\0" * 100)], 200, False, 4, 0)
@given(st.lists(st.tuples(PAYLOADS, PAYLOADS), min_size=1, max_size=60), st.sampled_from([200, 1000, 16384, 200_000]),
       st.booleans(), st.integers(0, 5), st.sampled_from([0, 3]))
def test_a_native_batch_reads_back_as_aiokafkas(records: list[tuple[bytes | None, bytes | None]], size: int,
                                                transactional: bool, start: int, codec: int) -> None:
    if native_module() is None:  # pure Python only here (test_prop_native checks it is built)
        return
    theirs = OutputBatch(0, batch=BatchBuilder(size, codec, is_transactional=transactional))
    ours = OutputBatch(0, batch=NativeBatch(size, transactional, codec))
    assert ours.native is not None and theirs.native is None
    keys, values = [k for k, _ in records], [v for _, v in records]
    start = min(start, len(records) - 1)
    taken = ours.extend(keys, values, start)
    assert taken == theirs.extend(keys, values, start) >= 1  # an empty batch takes any record
    assert ours.batch.size() == theirs.batch.size()
    if start + taken < len(records):  # full: one more record is refused by both
        assert ours.append(keys[start + taken], values[start + taken]) is False
    sent = []
    for out in (theirs, ours):
        batch = out.for_send()
        batch._set_producer_state(4242, 3, 17)
        sent.append(batch)
    assert _read(sent[0]) == _read(sent[1])
    assert _read(sent[1])[:2] == (True, codec)  # CRC, and the codec in the attributes
    assert sent[1]._build() is sent[1]._build()  # a retried send sends the same bytes
    assert sent[1].record_count() == taken


def test_the_native_batches_are_on_where_the_extension_is_built() -> None:
    assert _native_batches() is (native_module() is not None)
    assert _native_batches(3) is (native_module() is not None)  # LZ4 too (cramjam is a test dependency)


def test_a_native_lz4_batch_is_lz4_framed_as_kafka_writes_it() -> None:
    """Kafka's brokers take LZ4 frames of independent 64 KB blocks without checksums or a
    content size (KIP-57): the frame descriptor says exactly that, and a large run of records
    spans several blocks that aiokafka reads back whole."""
    if native_module() is None:
        return
    batch = NativeBatch(4 << 20, False, 3)
    values = [b'{"op":"c","after":{"id":%d,"v":"%s"}}' % (i, b"x" * (i % 50)) for i in range(20_000)]
    assert batch._builder.extend([None] * len(values), values, 0) == len(values)
    batch._set_producer_state(-1, -1, -1)
    built = bytes(batch._build())
    frame = built[61:]  # after the record batch's header
    assert frame[:4] == b"\x04\x22\x4d\x18"  # the LZ4 frame's magic number
    flags, block = frame[4], frame[5]
    assert flags >> 6 == 1 and flags & 0x20 and not flags & 0x1F  # version 1, independent blocks, nothing else
    assert block == 0x40  # 64 KB blocks
    assert len(built) < sum(map(len, values)) // 3
    read = MemoryRecords(built).next_batch()
    assert read.validate_crc() and read.compression_type == 3
    assert [r.value for r in read] == values


@settings(max_examples=200)
@given(st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=3000)), max_size=60), st.integers(0, 5),
       st.sampled_from([200, 16384, 200_000]), st.sampled_from([0, 3]))
def test_a_change_runs_records_fill_a_batch_as_their_lists_do(records: list[tuple[bytes, bytes]], start: int,
                                                             size: int, codec: int) -> None:
    """A change run's keys and values come as walbus_native.Records (one buffer): the batch
    copies them as it would the lists, and they read back as the lists."""
    module = native_module()
    if module is None:
        return
    keys, values = [k for k, _ in records], [v for _, v in records]
    as_records = module.Records(keys), module.Records(values)
    assert as_records[0] == keys and as_records[1] == values and as_records[0] == module.Records(keys)
    assert as_records[1].tolist() == values and list(as_records[1]) == values and len(as_records[1]) == len(values)
    assert as_records[1].max_len() == max(map(len, values), default=0)
    if values:
        assert as_records[1][-1] == values[-1] and as_records[1][0] == values[0]
    with pytest.raises(IndexError):
        as_records[1][len(values)]
    from_lists, from_records = NativeBatch(size, False, codec), NativeBatch(size, False, codec)
    taken = from_lists._builder.extend(keys, values, start)
    assert from_records._builder.extend(*as_records, start) == taken
    if taken:
        for b in (from_lists, from_records):
            b._set_producer_state(1, 0, 0)
        assert _read(from_lists)[1:] == _read(from_records)[1:]  # same records (timestamps aside: none are read)


def test_records_equal_only_equal_lists_and_records() -> None:
    module = native_module()
    if module is None:
        return
    records = module.Records([b"a", b"", b"bc"])
    assert records == [b"a", b"", b"bc"] and records != [b"a", b"", b"b"] and records != module.Records([b"a"])
    assert records != (b"a", b"", b"bc") and records != "abc" and records != 3  # a list's equality: lists only
    assert repr(records) == "<Records of 3 byte strings, 3 bytes>"
