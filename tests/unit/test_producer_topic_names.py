"""The database topic must leave room for its side topics (<topic>.transaction, .heartbeat, …)."""

from __future__ import annotations

from typing import Any

import pytest

from producer.config import load
from walbus.config import ConfigError
from walbus.contract import (
    MAX_DATABASE_TOPIC_LENGTH,
    MAX_TOPIC_LENGTH,
    SIDE_TOPIC_SUFFIXES,
    database_topic,
    escape_topic_part,
    side_topic,
    table_topic,
    topic_name_error,
    unescape_topic_part,
)

DSN = "postgresql://u@h/shop"


def test_every_side_topic_of_the_longest_database_topic_is_legal() -> None:
    topic = "t" * MAX_DATABASE_TOPIC_LENGTH
    for suffix in SIDE_TOPIC_SUFFIXES:
        assert topic_name_error(side_topic(topic, suffix)) is None


def test_a_topic_without_room_for_its_side_topics_is_a_configuration_error() -> None:
    assert load(["--pg-dsn", DSN, "--kafka-bootstrap", "k:9092", "--topic", "t" * MAX_DATABASE_TOPIC_LENGTH]).topic_name
    with pytest.raises(ConfigError, match="--topic"):
        load(["--pg-dsn", DSN, "--kafka-bootstrap", "k:9092", "--topic", "t" * (MAX_DATABASE_TOPIC_LENGTH + 1)])


@pytest.mark.parametrize("topic", ["has space", "ö", "a/b", "..", "walbus.shop\n"])
def test_an_illegal_topic_name_is_a_configuration_error(topic: str) -> None:
    with pytest.raises(ConfigError, match="--topic"):
        load(["--pg-dsn", DSN, "--kafka-bootstrap", "k:9092", "--topic", topic])


def test_the_default_topic_of_a_long_database_name_under_a_long_prefix_fits() -> None:
    prefix = "p" * 150
    topic = database_topic(prefix, "ö" * 31)
    assert len(topic) <= MAX_DATABASE_TOPIC_LENGTH < MAX_TOPIC_LENGTH
    assert topic_name_error(side_topic(topic, "transaction")) is None
    assert database_topic(prefix, "shop") == f"{prefix}.shop"


def test_a_name_ending_in_a_newline_is_escaped_and_no_topic_name_ends_in_one() -> None:
    """The checks were regexes with "$", which also matches before a final newline: a table
    named "orders\n" (PostgreSQL takes any character but NUL in a quoted name) kept its
    newline in its per-table topic, which Kafka refuses; the deep Hypothesis profile found it."""
    assert escape_topic_part("orders\n") == "orders-0A"
    assert unescape_topic_part("orders-0A") == "orders\n"
    topic = table_topic("walbus", "shop", "public", "orders\n")
    assert topic_name_error(topic) is None and "\n" not in topic
    assert topic_name_error("walbus.shop\n") is not None


def test_a_slot_name_ending_in_a_newline_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="--slot"):
        load(["--pg-dsn", DSN, "--kafka-bootstrap", "k:9092", "--slot", "walbus_shop\n"])


def test_the_partition_count_recorded_first_is_kept() -> None:
    from producer.service import partitions_to_write

    def count(*args: Any, **kwargs: Any) -> int:
        return partitions_to_write(*args, **kwargs)[0]

    assert count(4, {}, {}) == 4  # nothing recorded: the topic's
    assert count(4, {"partitions": 2}, {}) == 2  # partitions added: still 2
    assert count(4, {}, {"other_slot": {"partitions": 2}}) == 2  # another producer's record
    assert partitions_to_write(4, {"partitions": 2}, {}, repartition=True) == (4, 1)
    assert partitions_to_write(1, {"partitions": 2}, {}) == (1, 1)  # the topic made again, smaller
    assert count(3, {"partitions": "x"}, {"s": {}}) == 3
    # Every slot of the topic writes with one count: another slot's --repartition is followed,
    # within what the topic has (slots on 6 and 2 put tables in two partitions at once).
    assert count(6, {"partitions": 2}, {"a": {"partitions": 6, "partitions_since": 1}}) == 6
    assert count(6, {"partitions": 2}, {"a": {"partitions": 6}}) == 6  # records from before the counter
    assert count(3, {"partitions": 6}, {"b": {"partitions": 2}}) == 3


def test_a_count_from_before_the_topic_was_made_smaller_is_not_followed() -> None:
    # Slots A and B on 3 partitions; the topic made again with 1 (A decides 1); partitions
    # added back to 3: B's stale 3 was the largest record, and A moved tables without
    # --repartition (a re-fuzz).
    from producer.service import partitions_to_write

    a, since = partitions_to_write(1, {"partitions": 3}, {"b": {"partitions": 3}})
    assert (a, since) == (1, 1)
    assert partitions_to_write(3, {"partitions": 1, "partitions_since": 1}, {"b": {"partitions": 3}}) == (1, 1)
    assert partitions_to_write(3, {"partitions": 3}, {"a": {"partitions": 1, "partitions_since": 1}}) == (1, 1)
