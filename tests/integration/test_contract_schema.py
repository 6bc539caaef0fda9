"""Every message the producer sends over a varied workload validates against the published
JSON Schema of contract v1 (docs/contract-v1.schema.json), with both plugins."""

from __future__ import annotations

import json

import orjson
import pytest
from jsonschema import Draft202012Validator

from tests.integration.test_producer import TYPES_DDL, WORKLOAD, WORKLOAD_DML, sql
from tests.support.kafka import read_topic
from tests.support.pipeline import running_producer
from walbus.contract import decode_event, parse_event_key
from walbus.contract_schema import SCHEMA_PATH

pytestmark = pytest.mark.integration

BIG = "x" * 20000
DDL = [
    TYPES_DDL,
    *WORKLOAD,
    'CREATE TABLE "a.b" (id int PRIMARY KEY, "say ""hi""" text)',
    'CREATE TABLE "Order Items" (k1 int, k2 text, big text, PRIMARY KEY (k2, k1))',
    'ALTER TABLE "Order Items" ALTER COLUMN big SET STORAGE EXTERNAL',
    "CREATE TABLE idx_t (id int PRIMARY KEY, code text NOT NULL, a text)",
    "CREATE UNIQUE INDEX idx_t_code ON idx_t (code)",
    "ALTER TABLE idx_t REPLICA IDENTITY USING INDEX idx_t_code",
    "CREATE TABLE nopk (a int, b text)",
]
DML = [
    "SET TIME ZONE 'UTC'",
    """INSERT INTO typed VALUES (1, -32768, 2147483647, 1234567890.123456789, 'NaN', 'Infinity', 'zürich ☃ 日本',
       '\\x00ff10', true, '2024-02-29', '13:14:15.123456', '2024-01-02 03:04:05.678901', '2024-01-02 03:04:05+02',
       '1 day 02:03:04', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"a": [1, 2]}', '{"b": null}', '{1,2,3}',
       '{"x y",z}', 'happy', 42)""",
    "INSERT INTO typed (id, f8) VALUES (2, '-Infinity')",
    *WORKLOAD_DML,
    """INSERT INTO "a.b" VALUES (1, 'hi'), (2, NULL)""",
    """UPDATE "a.b" SET id = 3 WHERE id = 2""",
    """DELETE FROM "a.b" WHERE id = 1""",
    f"""INSERT INTO "Order Items" VALUES (1, 'k', '{BIG}')""",
    """UPDATE "Order Items" SET k1 = 2""",  # the TOASTed big is unchanged: listed, not sent
    "INSERT INTO idx_t VALUES (1, 'c1', 'a')",
    "UPDATE idx_t SET a = 'b'",
    "DELETE FROM idx_t",
    "INSERT INTO nopk VALUES (1, 'a'), (2, NULL)",
    "TRUNCATE nopk, \"a.b\"",
]
# typed, test_producer's workload, "a.b", "Order Items", idx_t, nopk (each truncate is one event per table)
EXPECTED = 2 + (200 + 67 + 20 + 28 + 50 + 19 + 10 + 1 + 1) + 5 + 2 + 3 + 3


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_every_produced_message_validates(pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str) -> None:
    validator = Draft202012Validator(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))
    sql(pg_dsn, *DDL)
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, plugin=plugin, slot=unique_name):
        sql(pg_dsn, *DML)
        records = await read_topic(kafka_bootstrap, unique_name, min_count=EXPECTED, timeout=90)
    assert len(records) == EXPECTED
    seen: set[tuple[str, bool, bool]] = set()
    for key, value in records:
        assert key is not None and value is not None
        obj = orjson.loads(value)
        errors = [e.message for e in validator.iter_errors(obj)]
        assert not errors, (value[:300], errors)
        event = decode_event(value)  # the schema is not looser than the decoder on these
        assert parse_event_key(key) == event.position
        seen.add((obj["operation"], "identity" in obj, "unchanged" in obj))
    # The workload reached the message shapes the schema describes.
    assert {("insert", False, False), ("update", True, False), ("update", True, True), ("delete", True, False),
            ("truncate", False, False)} <= seen
