"""The warehouse's decimal types from the events' typmods (pure planning, no Spark session)."""

from __future__ import annotations

import pytest
from pyspark.sql.types import (
    ArrayType,
    DataType,
    DecimalType,
    IntegerType,
    StringType,
    TimestampType,
)

from warehouse.schema import SourceColumn, plan
from warehouse.types import spark_type, widest


@pytest.mark.parametrize(
    ("declared", "want"),
    [
        ("numeric(12,2)", DecimalType(12, 2)),
        ("numeric(12,0)", DecimalType(12, 0)),
        ("numeric(38,38)", DecimalType(38, 38)),
        ("numeric", DecimalType(38, 10)),  # unconstrained, or an event without typmods
        ("numeric(39,2)", DecimalType(38, 10)),  # wider than Spark's decimals
        ("numeric(5,-2)", DecimalType(38, 10)),  # negative scale (PostgreSQL 15)
        ("numeric(3,5)", DecimalType(38, 10)),  # scale beyond precision
        ("_numeric(10,3)", ArrayType(DecimalType(10, 3), containsNull=True)),
        ("varchar(40)", StringType()),
        ("timestamp(3)", TimestampType()),
        ("int4", IntegerType()),
    ],
)
def test_numeric_with_its_modifier_is_a_decimal_of_that_precision_and_scale(declared: str, want: DataType) -> None:
    assert spark_type(declared, numeric_scale=10) == want


def test_widest_integer_and_float_hold_both_and_narrower_values_fit() -> None:
    # int4 and int8 in one load (ALTER COLUMN … TYPE bigint between them) failed the load, and
    # its replay once the table was moved away as the docs advise (a fuzz).
    from pyspark.sql.types import DoubleType, FloatType, IntegerType, LongType, StringType

    from warehouse.types import compatible

    assert widest(IntegerType(), LongType()) == widest(LongType(), IntegerType()) == LongType()
    assert widest(FloatType(), DoubleType()) == DoubleType()
    assert widest(IntegerType(), DoubleType()) is None and widest(LongType(), StringType()) is None
    assert compatible(LongType(), IntegerType()) and compatible(DoubleType(), FloatType())
    assert not compatible(IntegerType(), LongType()) and not compatible(FloatType(), DoubleType())


def test_widest_decimal_holds_both() -> None:
    assert widest(DecimalType(12, 2), DecimalType(14, 4)) == DecimalType(14, 4)
    assert widest(DecimalType(12, 2), DecimalType(6, 5)) == DecimalType(15, 5)
    assert widest(DecimalType(30, 0), DecimalType(20, 20)) == DecimalType(38, 20)  # 50 digits: capped
    assert widest(ArrayType(DecimalType(4, 1)), ArrayType(DecimalType(4, 2))) == ArrayType(DecimalType(5, 2))
    assert widest(IntegerType(), DecimalType(4, 1)) is None
    assert widest(StringType(), StringType()) == StringType()


def test_a_new_table_takes_each_numeric_columns_precision() -> None:
    p = plan("s.t", None, [("id", "int4"), ("amount", "numeric(12,2)"), ("plain", "numeric")], numeric_scale=10)
    assert [c.spark for c in p.columns] == [IntegerType(), DecimalType(12, 2), DecimalType(38, 10)]
    assert p.columns[1].pg_type == "numeric(12,2)"


def test_a_precision_change_within_a_load_takes_a_decimal_for_both() -> None:
    p = plan("s.t", None, [("amount", "numeric(14,4)"), ("amount", "numeric(12,2)")], numeric_scale=10)
    assert p.columns[0].spark == DecimalType(14, 4)


def test_an_existing_decimal_is_widened_when_delta_can_and_kept_otherwise() -> None:
    existing = [SourceColumn("amount", "numeric(12,2)", DecimalType(12, 2))]
    p = plan("s.t", existing, [("amount", "numeric(14,4)")], numeric_scale=10)
    assert p.added == () and p.columns[0].spark == DecimalType(14, 4) and p.columns[0].pg_type == "numeric(14,4)"
    assert p.widened == p.columns
    # fewer digits on either side: the column holds them, and keeps its type
    p = plan("s.t", existing, [("amount", "numeric(10,1)")], numeric_scale=10)
    assert p.columns[0].spark == DecimalType(12, 2) and p.widened == ()
