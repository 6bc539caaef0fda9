"""numeric(p,s) columns land in the warehouse as decimal(p,s), exactly (producer -> topic -> Delta)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.types import ArrayType, DecimalType, StringType, TimestampType

from tests.integration.test_producer import sql
from tests.support.kafka import read_topic
from tests.support.pipeline import running_producer
from tests.support.warehouse import kafka_options, table_paths
from warehouse.job import LoadSpec, run_load

pytestmark = [pytest.mark.spark, pytest.mark.integration]

DDL = """CREATE TABLE money (
  id int PRIMARY KEY, amount numeric(12,2) NOT NULL, plain numeric, rates numeric(5,4)[], wide numeric(40,2),
  name varchar(40), at timestamp(3)
)"""


async def test_numeric_columns_take_their_precision_and_scale(
    spark: Any, pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    sql(pg_dsn, DDL)
    spec = LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path))
    paths = table_paths(tmp_path, unique_name, "public.money")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name):
        sql(
            pg_dsn,
            "INSERT INTO money VALUES (1, 9999999999.99, 1.5, '{0.1234,NULL}', 5e37, 'n', '2026-01-02 03:04:05.123'),"
            " (2, -0.01, NULL, NULL, 12.5, NULL, NULL), (3, 0, 123456789012345678901234567890.5, '{}', NULL, NULL, NULL)",
        )
        await read_topic(kafka_bootstrap, unique_name, min_count=3)
    run_load(spark, spec)
    df = spark.read.format("delta").load(paths.current)
    types = {f.name: f.dataType for f in df.schema.fields}
    assert types["amount"] == DecimalType(12, 2)
    assert types["plain"] == DecimalType(38, 10)  # unconstrained: the fallback
    assert types["rates"] == ArrayType(DecimalType(5, 4), containsNull=True)
    assert types["wide"] == DecimalType(38, 10)  # wider than Spark's decimals: the fallback
    assert (types["name"], types["at"]) == (StringType(), TimestampType())
    rows = {r["id"]: r for r in df.collect()}
    assert [rows[i]["amount"] for i in (1, 2, 3)] == [Decimal("9999999999.99"), Decimal("-0.01"), Decimal("0.00")]
    assert rows[1]["rates"] == [Decimal("0.1234"), None] and rows[1]["plain"] == Decimal("1.5")
    assert rows[3]["plain"] is None and rows[3]["pg_raw_values"] == {"plain": "123456789012345678901234567890.5"}
    assert rows[1]["wide"] is None and rows[1]["pg_raw_values"] == {"wide": "5" + "0" * 37 + ".00"}
    assert rows[2]["wide"] == Decimal("12.5")

    # A wider numeric later: the tables' column is widened to decimal(16,4) (Delta's type
    # widening); before, it kept decimal(12,2) and a value needing the new digits was null.
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name):
        sql(
            pg_dsn,
            "ALTER TABLE money ALTER COLUMN amount TYPE numeric(16,4)",
            "INSERT INTO money (id, amount) VALUES (4, 12345678901.2345), (5, 7.5), (6, 1.2345)",
        )
        await read_topic(kafka_bootstrap, unique_name, min_count=6)
    run_load(spark, spec)
    df = spark.read.format("delta").load(paths.current)
    assert {f.name: f.dataType for f in df.schema.fields}["amount"] == DecimalType(16, 4)
    rows = {r["id"]: r for r in df.collect()}
    assert rows[4]["amount"] == Decimal("12345678901.2345") and rows[4]["pg_raw_values"] == {}
    assert rows[5]["amount"] == Decimal("7.5") and rows[5]["pg_raw_values"] == {}
    assert rows[6]["amount"] == Decimal("1.2345") and rows[6]["pg_raw_values"] == {}
    assert rows[1]["amount"] == Decimal("9999999999.99")  # written before, as it was
