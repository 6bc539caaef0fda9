"""Table names and topic names in the contract: every name PostgreSQL accepts round-trips."""

from __future__ import annotations

import re

import pytest

from walbus.contract import (
    MAX_TOPIC_LENGTH,
    ContractError,
    database_topic,
    decode_event,
    escape_topic_part,
    qualify_table,
    split_table,
    table_topic,
    unescape_topic_part,
)

KAFKA_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
NAMES = ["order_items", "Order Items", "ö", "a.b", "a_b", "my-db", "my-DB", "a--b", "a-2E", "-", "--",
         '"q"', "x" * 63, "ö" * 31, "日本語", " ", "a\tb", "emoji😀", "-2D", "..", "-_-", "a-ö", "a- b", "-."]


@pytest.mark.parametrize("name", NAMES)
def test_topic_part_round_trips_and_is_kafka_legal(name: str) -> None:
    part = escape_topic_part(name)
    assert unescape_topic_part(part) == name
    assert re.fullmatch(r"[A-Za-z0-9_-]+", part)
    assert "--" not in part  # reserved for the hash suffix


def test_common_names_are_unchanged() -> None:
    assert table_topic("walbus", "shop", "public", "order_items") == "walbus.shop.public.order_items"
    assert database_topic("walbus", "my-db") == "walbus.my-db"
    assert table_topic("walbus", "shop.eu", "public", "Order Items") == "walbus.shop-2Eeu.public.Order-20Items"


def test_dot_and_underscore_names_get_distinct_topics() -> None:
    a, b = table_topic("walbus", "d", "public", "a.b"), table_topic("walbus", "d", "public", "a_b")
    assert a != b and a.replace(".", "_") != b.replace(".", "_")


@pytest.mark.parametrize("schema,table", [("s" * 63, "ü" * 31), ("ö" * 31, "ü" * 31), ("public", "😀" * 15)])
def test_long_names_are_cut_with_a_hash(schema: str, table: str) -> None:
    topic = table_topic("walbus", "d" * 63, schema, table)
    assert KAFKA_TOPIC.match(topic) and len(topic) <= MAX_TOPIC_LENGTH
    assert re.search(r"--[0-9a-f]{8}$", topic)
    other = table_topic("walbus", "d" * 63, schema, table[:-1] + "x")
    assert other != topic


def test_hashed_form_for_colliding_names() -> None:
    plain = table_topic("walbus", "db", "public", "a_b")
    hashed = table_topic("walbus", "db", "public", "a_b", hashed=True)
    assert hashed.startswith(plain) and hashed != plain and KAFKA_TOPIC.match(hashed)
    assert hashed != table_topic("walbus", "db", "public_a", "b", hashed=True)


@pytest.mark.parametrize("schema,table", [("public", "a.b"), ('a"b', "c"), ("x.y", "z.w"), ("p", '"'), ("public", "Order Items")])
def test_qualified_table_splits_back(schema: str, table: str) -> None:
    assert split_table(qualify_table(schema, table)) == (schema, table)


def test_plain_names_keep_their_form() -> None:
    assert qualify_table("public", "Order Items") == "public.Order Items"
    assert qualify_table("public", "a.b") == 'public."a.b"'


@pytest.mark.parametrize("bad", ["ab", ".b", "a.", '"a.b', 'a"b.c', "a.b.c", '"a"x.b'])
def test_malformed_qualified_names_are_contract_errors(bad: str) -> None:
    with pytest.raises(ContractError):
        split_table(bad)


@pytest.mark.parametrize("field,value", [("lsn", -1), ("commit_lsn", 1 << 64), ("seq", 1 << 32), ("seq", -1), ("xid", -5)])
def test_positions_out_of_the_key_range_are_contract_errors(field: str, value: int) -> None:
    fields = {"lsn": 1, "commit_lsn": 2, "seq": 0, "xid": 3, field: value}
    text = ('{{"v":1,"lsn":{lsn},"commit_lsn":{commit_lsn},"seq":{seq},"xid":{xid},'
            '"operation":"truncate","table":"a.b","timestamp":"t","pk":[]}}').format(**fields)
    with pytest.raises(ContractError, match=r"out of range|must be an integer"):  # orjson reads 2**64 as a float
        decode_event(text.encode())
