"""The demux worker's small parts without Kafka: positions, dead-letter records, transaction counts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiokafka import TopicPartition

from demux.dead_letter import dead_letter_record
from demux.metrics import DemuxMetrics, TransactionCounts
from demux.positions import Positions, at_position
from walbus.contract import encode_event, event_key
from walbus.kafka import record_fits
from walbus.metrics import new_registry

TP = TopicPartition("walbus.shop", 2)


def test_positions_replay_and_checkpoint() -> None:
    pos = Positions("g", TP)
    assert pos.checkpoint() == "g|walbus.shop|2|-1" and not pos.is_replay(event_key(1, 0))
    pos.last_key = event_key(5, 1)
    assert pos.is_replay(event_key(5, 1)) and pos.is_replay(event_key(4, 9))
    assert not pos.is_replay(event_key(5, 2))
    pos.advance(41)
    assert pos.next_offset == 42 and pos.checkpoint() == "g|walbus.shop|2|42"


class _Consumer:
    def __init__(self) -> None:
        self.seeks: list[int] = []

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append(offset)


@dataclass
class _Record:
    offset: int
    key: bytes | None
    value: bytes | None = None


def test_positions_tell_the_transaction_a_partition_resumes_in() -> None:
    # A group committed without the last position (an older demux): look back before it.
    pos, consumer = Positions("g", TP), _Consumer()
    asyncio.run(pos.start(consumer, (1010, "")))
    assert pos.probing and consumer.seeks == [10] and pos.resumed_at() is None
    # The look-back comes in batches: the record before the committed offset decides.
    assert pos.resumed_in([_Record(1008, event_key(0x100, 0)), _Record(1009, event_key(0x200, 4))]) is None and pos.probing
    assert pos.resumed_in([_Record(1010, event_key(0x200, 5))]) == 0x200 and not pos.probing
    asyncio.run(pos.start(consumer, (10, "someone else's")))
    assert pos.resumed_in([_Record(9, b"not a position"), _Record(10, event_key(0x200, 5))]) is None and not pos.probing


def test_positions_travel_with_the_committed_offset() -> None:
    # The last position is the offset's metadata: no look-back, however long a re-send was.
    pos, consumer = Positions("g", TP), _Consumer()
    asyncio.run(pos.start(consumer, (5000, "walbus-demux/1:" + event_key(0x300, 7).decode())))
    assert not pos.probing and consumer.seeks == [5000] and pos.last_key == event_key(0x300, 7)
    assert pos.resumed_at() == 0x300 and pos.is_replay(event_key(0x300, 7)) and not pos.is_replay(event_key(0x300, 8))
    pos.last_key = event_key(0x400, 0)
    assert pos.metadata() == "walbus-demux/1:" + event_key(0x400, 0).decode()
    # Learned by a look-back: committed only once the look-back is complete.
    asyncio.run(pos.start(consumer, (5000, "walbus-feed/2:" + event_key(0x300, 7).decode())))
    assert pos.probing and pos.last_key is None and consumer.seeks[-1] == 4000
    pos.last_key = event_key(0x200, 0)
    assert pos.metadata() == ""
    pos.resumed_in([_Record(5000, event_key(0x500, 0))])
    assert pos.metadata() == "walbus-demux/1:" + event_key(0x200, 0).decode()
    # Nothing processed yet: nothing to say.
    asyncio.run(pos.start(consumer, (0, "")))
    assert not pos.probing and pos.metadata() == "" and consumer.seeks[-1] == 0


def test_at_position_needs_an_event_at_its_own_key() -> None:
    value = encode_event(lsn=1, commit_lsn=7, seq=3, xid=1, operation="insert", table="public.t", timestamp="x",
                         pk=["id"], new={"columns": ["id"], "types": ["int4"], "values": [1]}, identity=None)
    assert at_position(event_key(7, 3), value)
    assert not at_position(event_key(7, 4), value)
    assert not at_position(None, value) and not at_position(event_key(7, 3), None)
    assert not at_position(event_key(7, 3), b"not json")


def test_dead_letter_record_whole_when_it_fits() -> None:
    key, value, headers = dead_letter_record(TP, 17, b"k", b"v" * 10, "bad", 1_000_000)
    assert (key, value) == (b"k", b"v" * 10)
    assert dict(headers) == {"walbus.error": b"bad", "walbus.source.topic": b"walbus.shop",
                             "walbus.source.partition": b"2", "walbus.source.offset": b"17"}
    assert dead_letter_record(TP, 1, None, None, "e", 1000)[:2] == (None, b"")
    assert dead_letter_record(TP, 1, b"k", None, "e", 1000)[:2] == (b"k", None)


def test_dead_letter_record_cut_to_the_topic_and_said_so() -> None:
    key, value, headers = dead_letter_record(TP, 1, b"k" * 5000, b"v" * 50_000, "too big", 10_000)
    names = dict(headers)
    assert key == b"k" * 1000 and value is not None and 0 < len(value) < 10_000
    assert names["walbus.value.truncated"] == b"50000" and b"10000" in names["walbus.value.cut"]
    assert record_fits(10_000, key, value, sum(len(k) + len(v) for k, v in headers))


def test_transaction_counts_reach_the_metrics_on_flush() -> None:
    registry = new_registry()
    counts = TransactionCounts(DemuxMetrics(registry), 2)
    counts.records, counts.replayed = 10, 2
    counts.produced["public.t"] = 7
    counts.tombstones["public.t"] = 1
    counts.other[("dead_letter", "contract")] += 1
    counts.other[("unwritten", "public.t", "size")] += 1
    counts.flush()
    value = registry.get_sample_value
    assert value("walbus_demux_records_consumed_total", {"partition": "2"}) == 10
    assert value("walbus_demux_replayed_skipped_total") == 2
    assert value("walbus_demux_records_produced_total", {"table": "public.t"}) == 7
    assert value("walbus_demux_tombstones_total", {"table": "public.t"}) == 1
    assert value("walbus_demux_dead_letters_total", {"reason": "contract"}) == 1
    assert value("walbus_demux_unwritten_outputs_total", {"table": "public.t", "reason": "size"}) == 1
    assert (counts.records, counts.replayed, counts.produced, counts.other) == (0, 0, {}, {})


def test_primary_key_values_from_one_image() -> None:
    from walbus.contract import RowImage

    image = RowImage(("id", "region", "doc"), ("int4", "text", "text"), (7, "eu", "x"))
    assert image.key_values(("region", "id")) == {"region": "eu", "id": 7}  # key order, not column order
    assert image.key_values(("id", "missing")) is None
    assert image.key_values(("id", "doc"), skip=("doc",)) is None  # an unchanged TOAST column is no key value
