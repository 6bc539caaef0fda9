"""The database topic must leave room for its side topics (<topic>.transaction, .heartbeat, …)."""

from __future__ import annotations

import pytest

from producer.config import load
from walbus.config import ConfigError
from walbus.contract import (
    MAX_DATABASE_TOPIC_LENGTH,
    MAX_TOPIC_LENGTH,
    SIDE_TOPIC_SUFFIXES,
    database_topic,
    side_topic,
    topic_name_error,
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


@pytest.mark.parametrize("topic", ["has space", "ö", "a/b", ".."])
def test_an_illegal_topic_name_is_a_configuration_error(topic: str) -> None:
    with pytest.raises(ConfigError, match="--topic"):
        load(["--pg-dsn", DSN, "--kafka-bootstrap", "k:9092", "--topic", topic])


def test_the_default_topic_of_a_long_database_name_under_a_long_prefix_fits() -> None:
    prefix = "p" * 150
    topic = database_topic(prefix, "ö" * 31)
    assert len(topic) <= MAX_DATABASE_TOPIC_LENGTH < MAX_TOPIC_LENGTH
    assert topic_name_error(side_topic(topic, "transaction")) is None
    assert database_topic(prefix, "shop") == f"{prefix}.shop"
