"""What the slot may forget: the read position versus the confirmed position.

A transaction's commit becomes confirmable once Kafka acknowledged every event
appended before it, on every partition. Acks arrive in order per partition
(aiokafka queues one batch per partition at a time), so "acknowledged" is one
counter per partition, and a commit is a snapshot of the append counters.
"""

from __future__ import annotations

from collections import deque


class Progress:
    def __init__(self, partitions: int, confirmed_lsn: int = 0) -> None:
        self.appended = [0] * partitions
        self.acked = [0] * partitions
        self._checkpoints: deque[tuple[int, tuple[int, ...]]] = deque()
        self.read_lsn = confirmed_lsn  # end of the last transaction read from the slot
        self.confirmed_lsn = confirmed_lsn  # end of the last transaction Kafka fully acknowledged

    def in_flight_of(self, counters: int) -> int:
        """What the first ``counters`` counters appended and Kafka did not acknowledge yet: the
        database topic's partitions, not the side records' counter after them (see
        KafkaSink.send_side_record; a heartbeat is in flight right after each beat)."""
        return sum(self.appended[:counters]) - sum(self.acked[:counters])

    def idle(self) -> bool:
        return not self._checkpoints and self.appended == self.acked

    def commit(self, end_lsn: int) -> None:
        """A transaction ended at ``end_lsn``; its events are all appended."""
        if end_lsn > self.read_lsn:
            self.read_lsn = end_lsn
        if not self._checkpoints and self.appended == self.acked:
            self.confirmed_lsn = max(self.confirmed_lsn, end_lsn)
        else:
            self._checkpoints.append((end_lsn, tuple(self.appended)))

    def ack(self, partition: int, upto: int) -> None:
        """Kafka acknowledged the first ``upto`` events appended to ``partition``."""
        self.acked[partition] = upto
        cps = self._checkpoints
        acked = self.acked
        while cps and all(a >= need for a, need in zip(acked, cps[0][1], strict=True)):
            self.confirmed_lsn = max(self.confirmed_lsn, cps.popleft()[0])

    def advance_idle(self, server_lsn: int) -> bool:
        """Between transactions with nothing in flight, the server's position may be confirmed
        (WAL of other tables or databases): the slot's WAL can then be recycled."""
        if self.idle() and server_lsn > self.confirmed_lsn:
            self.confirmed_lsn = server_lsn
            self.read_lsn = max(self.read_lsn, server_lsn)
            return True
        return False
