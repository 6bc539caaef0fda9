"""Heartbeats (issue 18), pure parts: the record's wire form, the intervals, the configuration."""

from __future__ import annotations

import pytest

from producer.config import load
from producer.heartbeat import IDLE_CONFIRM_S, action_timeout, confirm_interval
from walbus.config import ConfigError
from walbus.contract import ContractError, Heartbeat, decode_heartbeat, heartbeat_topic, heartbeats

BASE = ["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1"]


def test_heartbeat_round_trips_and_is_keyed_by_slot() -> None:
    hb = Heartbeat("walbus_shop", 0x40A2F380, 0x40A2F400, 1_763_900_000_123)
    assert decode_heartbeat(hb.to_json()) == hb
    assert hb.key() == b"walbus_shop"
    assert heartbeat_topic("walbus.shop") == "walbus.shop.heartbeat"


@pytest.mark.parametrize("value", [
    b"not json", b"[]", b'{"v":2,"slot":"s","confirmed_lsn":1,"received_lsn":1,"ts_ms":1}',
    b'{"v":1,"slot":"s","confirmed_lsn":-1,"received_lsn":1,"ts_ms":1}',
    b'{"v":1,"slot":"s","confirmed_lsn":1,"received_lsn":1.5,"ts_ms":1}',
    b'{"v":1,"slot":1,"confirmed_lsn":1,"received_lsn":1,"ts_ms":1}',
    b'{"v":1,"slot":"s","confirmed_lsn":1,"received_lsn":1}',
])
def test_a_bad_heartbeat_is_a_contract_error(value: bytes) -> None:
    with pytest.raises(ContractError):
        decode_heartbeat(value)


def test_the_readers_pass_over_tombstones_and_values_that_are_no_heartbeat() -> None:
    a, b = Heartbeat("a", 10, 12, 1), Heartbeat("b", 7, 9, 2)
    values = [a.to_json(), None, b"not json", b'{"v":2,"slot":"s"}', b.to_json()]
    assert list(heartbeats(values)) == [a, b]


def test_the_idle_position_is_confirmed_even_with_heartbeats_off() -> None:
    assert confirm_interval(0.5) == 0.5
    assert confirm_interval(0) == IDLE_CONFIRM_S


def test_the_action_query_times_out_by_the_next_beat_within_bounds() -> None:
    assert action_timeout(5) == 5
    assert action_timeout(0.1) == 1.0
    assert action_timeout(3600) == 60.0


def test_heartbeat_options_are_checked() -> None:
    assert load(BASE).heartbeat_interval == 10.0
    with pytest.raises(ConfigError, match="--heartbeat-interval"):
        load([*BASE, "--heartbeat-interval", "-1"])
    with pytest.raises(ConfigError, match="--heartbeat-interval"):
        load([*BASE, "--heartbeat-interval", "nan"])
    with pytest.raises(ConfigError, match="--heartbeat-action-query"):
        load([*BASE, "--heartbeat-interval", "0", "--heartbeat-action-query", "SELECT 1"])
    with pytest.raises(ConfigError, match="empty"):
        load([*BASE, "--heartbeat-action-query", " "])
    cfg = load([*BASE, "--heartbeat-interval", "0"])
    assert cfg.heartbeat_interval == 0


def test_a_heartbeat_in_flight_holds_the_slot_like_any_record() -> None:
    """Heartbeats go on the sink's side-record counter (the last Progress slot): the slot is
    confirmed past a transaction, or to the idle server position, only once Kafka acknowledged
    everything sent before, the heartbeat included."""
    from producer.progress import Progress

    p = Progress(1 + 1, confirmed_lsn=100)  # one partition + the side-record slot
    p.appended[1] += 1  # a heartbeat sent, not yet acknowledged
    assert not p.advance_idle(150) and p.confirmed_lsn == 100
    p.commit(200)
    assert p.confirmed_lsn == 100
    p.ack(1, 1)
    assert p.confirmed_lsn == 200
    assert p.advance_idle(300) and p.confirmed_lsn == 300
