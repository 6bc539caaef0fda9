"""walbus's one partitioner is Kafka's default one (murmur2 of the key, as the Java client)."""

from __future__ import annotations

import pytest

from walbus.kafka import partition_for

# Utils.murmur2 of the Java client (signed 32-bit), as Kafka's and Akka's tests list them.
JAVA_MURMUR2 = {
    b"1": -1993445489,
    b"12": 126087238,
    b"123": -267702483,
    b"1234": -1614185708,
    b"12345": -1188365604,
    b"21": -973932308,
}


@pytest.mark.parametrize(("key", "java_hash"), sorted(JAVA_MURMUR2.items()))
@pytest.mark.parametrize("partitions", [2, 3, 7, 12])
def test_partition_is_the_java_default_partitioners(key: bytes, java_hash: int, partitions: int) -> None:
    # DefaultPartitioner / BuiltInPartitioner: toPositive(murmur2(key)) % numPartitions.
    assert partition_for(key, partitions) == (java_hash & 0x7FFFFFFF) % partitions


def test_one_partition_is_partition_zero() -> None:
    assert partition_for(b"anything", 1) == 0
    assert {partition_for(b"key%d" % i, 4) for i in range(50)} == {0, 1, 2, 3}
