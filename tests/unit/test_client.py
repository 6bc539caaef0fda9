"""Pure parts of the client: filters, position metadata, table keys, `walbus tail` flags."""

from __future__ import annotations

import pytest

from walbus.app.tail import TailConfig
from walbus.client import EventFilter, table_key
from walbus.client.positions import (
    decode_legacy_metadata,
    decode_metadata,
    encode_metadata,
    newest,
    position_of_key,
)
from walbus.config import load_config
from walbus.contract import event_key, qualify_table


def test_filter_patterns_and_operations() -> None:
    f = EventFilter(["transactions", "audit.*"], ["insert", "delete"])
    assert f.wants("public.transactions", "insert")
    assert f.wants("billing.transactions", "delete")
    assert not f.wants("public.transactions", "update")
    assert f.wants("audit.log", "insert")
    assert not f.wants("public.users", "insert")
    assert EventFilter().wants("any.thing", "truncate")
    with pytest.raises(ValueError, match="unknown operation"):
        EventFilter(operations=["upsert"])


def test_filter_matches_schema_and_table_names_that_hold_dots() -> None:
    # The event's `table` is qualify_table(schema, table): a part with a dot is quoted.
    dotted_schema, dotted_table = qualify_table("my.app", "orders"), qualify_table("public", "a.b")
    assert EventFilter(["orders"]).wants(dotted_schema, "insert")
    assert EventFilter(['"my.app".*']).wants(dotted_schema, "insert")
    assert EventFilter(["my*.orders"]).wants(dotted_schema, "insert")
    assert not EventFilter(["my.*"]).wants(dotted_schema, "insert")  # schema "my" only
    assert EventFilter(['"a.b"']).wants(dotted_table, "insert")
    assert EventFilter(['public."a.b"']).wants(dotted_table, "insert")
    assert not EventFilter(["b"]).wants(dotted_table, "insert")
    assert not EventFilter(["public.a"]).wants(dotted_table, "insert")
    assert EventFilter(["public.a*"]).wants(dotted_table, "insert")
    assert EventFilter(['"we""ird".t']).wants(qualify_table('we"ird', "t"), "delete")
    with pytest.raises(ValueError, match=r"schema\.table"):
        EventFilter(["a.b.c"])


def test_position_metadata_round_trip() -> None:
    pos = (0x16B374D848, 3)
    text = encode_metadata(pos)
    assert text.endswith(event_key(*pos).decode())
    assert decode_metadata(text) == pos
    assert decode_metadata("") is None and decode_metadata("someone else's") is None
    # Version 1 was written without checking keys: it is only read as a legacy claim.
    assert decode_metadata("walbus-feed/1:" + event_key(*pos).decode()) is None
    assert decode_legacy_metadata("walbus-feed/1:" + event_key(*pos).decode()) == pos
    assert encode_metadata(None) == ""
    assert position_of_key(b"not a key") is None and position_of_key(None) is None
    assert newest(None, (1, 2), (1, 1), None) == (1, 2) and newest(None) is None


def test_table_keys() -> None:
    assert table_key(b'{"transaction_id":54441}') == 54441
    assert table_key({"a": 1, "b": "x"}) == (1, "x")
    assert table_key(b'{"a":[1,2]}') == (1, 2)
    assert table_key((1, "x")) == (1, "x")


def test_tail_merges_repeated_list_flags() -> None:
    argv = ["--topic", "t", "--table", "a", "--table=b", "--operation", "insert", "--max-events", "2"]
    config = load_config(TailConfig, [*argv, "--kafka-bootstrap", "k:9092"], prog="t", env={}, section="tail")
    assert (config.table, config.operation, config.max_events) == (["a", "b"], ["insert"], 2)


@pytest.mark.parametrize(
    ("option", "hint"),
    [("auto_offset_reset", "start="), ("enable_auto_commit", "commit"), ("isolation_level", "read_committed"),
     ("group_id", "group_id="), ("bootstrap_servers", "client_kwargs")],
)
def test_a_consumer_option_the_feed_sets_itself_is_a_clear_error_when_made(option: str, hint: str) -> None:
    # consumer_options={"auto_offset_reset": "earliest"} (a Kafka user's habit) was a TypeError
    # from inside aiokafka at start(): "got multiple values for keyword argument".
    from walbus.client import Feed, Table

    with pytest.raises(ValueError, match=rf"consumer_options: {option} .*{hint}"):
        Feed("walbus.d", bootstrap_servers="localhost:9092", consumer_options={option: "x"})
    if option in ("enable_auto_commit", "isolation_level", "bootstrap_servers"):
        with pytest.raises(ValueError, match=rf"consumer_options: {option} "):
            Table("walbus.d.public.t", bootstrap_servers="localhost:9092", consumer_options={option: "x"})
    else:  # the Table has no group and always reads from the beginning: not its options
        Table("walbus.d.public.t", bootstrap_servers="localhost:9092", consumer_options={option: "x"} if option != "group_id" else {})
    # Options the readers leave to the caller are taken as before.
    Feed("walbus.d", bootstrap_servers="localhost:9092", consumer_options={"session_timeout_ms": 30000})
    Table("walbus.d.public.t", bootstrap_servers="localhost:9092", consumer_options={"fetch_max_wait_ms": 10})


@pytest.mark.parametrize("option", ["session_timeout_ms", "acks", "max_poll_records"])
def test_a_client_option_that_is_no_connection_option_is_a_clear_error_when_made(option: str) -> None:
    # client_kwargs go to the reader's consumers, producers and admin clients alike: a consumer's
    # own option there was aiokafka's "unexpected keyword argument" TypeError at start(), or at
    # the first dead letter (the admin client's), far from where it was given.
    from walbus.client import Feed, Table

    for make in (lambda kw: Feed("walbus.d", client_kwargs=kw), lambda kw: Table("walbus.d.public.t", client_kwargs=kw)):
        with pytest.raises(ValueError, match=rf"client_kwargs: {option} is not a Kafka connection option.*consumer_options="):
            make({"bootstrap_servers": "localhost:9092", option: 1})
        make({"bootstrap_servers": "localhost:9092", "request_timeout_ms": 12000, "client_id": "x"})  # taken


@pytest.mark.parametrize("bad", ["walbus bad", "..", "t" * 250, "wal/bus"])
def test_a_topic_name_kafka_cannot_have_is_refused_when_made(bad: str) -> None:
    # Feed("walbus bad") subscribed, aiokafka logged "'walbus bad' is not a valid topic name"
    # and the feed waited forever for events (as `walbus tail --topic 'walbus bad'` did).
    from walbus.client import Feed, Table

    with pytest.raises(ValueError, match=r"^topic must be a Kafka topic name"):
        Feed(bad, bootstrap_servers="localhost:9092")
    with pytest.raises(ValueError, match=r"^topic must be a Kafka topic name"):
        Table(bad, bootstrap_servers="localhost:9092")
    with pytest.raises(ValueError, match=r"^source_topic must be a Kafka topic name"):
        Table("walbus.d.public.t", source_topic=bad, bootstrap_servers="localhost:9092")
