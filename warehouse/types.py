"""PostgreSQL type names (``pg_type.typname``, as in the event's ``types``) -> Spark types,
and the Spark expressions that turn contract-v1 text values into them.

Values arrive as strings (each value's text, see :mod:`warehouse.decode`):
integers and floats as JSON number text, ``NaN``/``Infinity`` as PostgreSQL prints
them, everything else as PostgreSQL's text output.

Exactness rule: a value is converted only when the Spark type holds it exactly. Anything
else (a numeric beyond the column's decimal, numeric ``NaN``, dates and timestamps that are
``infinity``, BC or past year 9999, bytea in escape format, multi-dimensional arrays) is
stored as NULL in the typed column **and** its exact PostgreSQL text is kept in the row's
``pg_raw_values`` map (column name -> text). Nothing is ever rounded or silently lost.

numeric: a ``numeric(p,s)`` column (the event's ``typmods``, written into the type as
``numeric(12,2)`` by the loader) maps to ``decimal(p,s)`` when Spark can hold it (p <= 38,
0 <= s <= p). Unconstrained ``numeric``, events without ``typmods`` (from producers before
2026-11) and wider or negative-scale modifiers map to ``decimal(38, NUMERIC_SCALE)`` (scale 10
by default: 28 integer digits, 10 fractional). Values with more digits on either side than the
column's decimal holds go to ``pg_raw_values`` as described. An existing table keeps the
decimal type it was created with (see docs/warehouse.md on ``ALTER TABLE``).
"""

from __future__ import annotations

import re
from typing import Final

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    TimestampType,
)

from walbus.contract import array_delimiter
from warehouse import NUMERIC_SCALE

DECIMAL_PRECISION: Final = 38

_SCALARS: Final[dict[str, DataType]] = {
    "int2": IntegerType(),
    "int4": IntegerType(),
    "int8": LongType(),
    # oid and xid are unsigned 32-bit: they do not fit a Spark int.
    "oid": LongType(),
    "xid": LongType(),
    "float4": FloatType(),
    "float8": DoubleType(),
    "bool": BooleanType(),
    "date": DateType(),
    "timestamp": TimestampType(),
    "timestamptz": TimestampType(),
    "bytea": BinaryType(),
}


_NUMERIC_DECLARED = re.compile(r"numeric\((-?\d+),(-?\d+)\)")


def spark_type(pg_type: str, *, numeric_scale: int = NUMERIC_SCALE) -> DataType:
    """The Spark type of a column of PostgreSQL type ``pg_type`` (unknown types: string);
    ``pg_type`` may carry its modifier, as :attr:`walbus.contract.ColumnType.declared` writes it."""
    if pg_type.startswith("_") and len(pg_type) > 1:
        return ArrayType(spark_type(pg_type[1:], numeric_scale=numeric_scale), containsNull=True)
    name = pg_type.split("(", 1)[0]
    if name == "numeric":
        m = _NUMERIC_DECLARED.fullmatch(pg_type)
        precision, scale = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
        if 0 <= scale <= precision <= DECIMAL_PRECISION and precision > 0:
            return DecimalType(precision, scale)
        return DecimalType(DECIMAL_PRECISION, numeric_scale)
    return _SCALARS.get(name, StringType())


# Types whose values the next one holds too (int4 -> int8 within one load: a load holding
# both failed, and so did its replay once the table was moved away, as the docs advise).
_WIDENING: Final = ((IntegerType(), LongType()), (FloatType(), DoubleType()))


def _wider(a: DataType, b: DataType) -> DataType | None:
    for chain in _WIDENING:
        if a in chain and b in chain:
            return chain[max(chain.index(a), chain.index(b))]
    return None


def widest(a: DataType, b: DataType) -> DataType | None:
    """A type that holds the values of both (two decimals: the digits of each on either side of
    the point, within 38; int and bigint: bigint; real and double: double), or None when there
    is none (another type: a schema change)."""
    if isinstance(a, DecimalType) and isinstance(b, DecimalType):
        scale = max(a.scale, b.scale)
        precision = max(a.precision - a.scale, b.precision - b.scale) + scale
        if precision > DECIMAL_PRECISION:
            return DecimalType(DECIMAL_PRECISION, min(scale, DECIMAL_PRECISION))
        return DecimalType(precision, scale)
    if isinstance(a, ArrayType) and isinstance(b, ArrayType):
        element = widest(a.elementType, b.elementType)
        return None if element is None else ArrayType(element, containsNull=True)
    return a if a == b else _wider(a, b)


def delta_widens(old: DataType, new: DataType) -> bool:
    """Whether Delta's type widening changes a column of type ``old`` into ``new`` (walbus'
    widenings: a bigger integer, real to double, a decimal with no fewer digits on either side
    of the point, an array's elements so), keeping every value."""
    if isinstance(old, ArrayType) and isinstance(new, ArrayType):
        return delta_widens(old.elementType, new.elementType)
    if isinstance(old, DecimalType) and isinstance(new, DecimalType):
        return (
            old != new and new.scale >= old.scale and new.precision - new.scale >= old.precision - old.scale
        )
    return old != new and _wider(old, new) == new


def compatible(existing: DataType, incoming: DataType) -> bool:
    """Whether values of ``incoming`` type can be stored in a column of ``existing`` type.

    Decimals of any precision/scale are compatible: numeric has no fixed scale in the
    contract and the existing column's scale decides (see the module doc).
    """
    if isinstance(existing, DecimalType) and isinstance(incoming, DecimalType):
        return True
    if isinstance(existing, ArrayType) and isinstance(incoming, ArrayType):
        return compatible(existing.elementType, incoming.elementType)
    return bool(existing == incoming) or _wider(existing, incoming) == existing


# PostgreSQL text forms that the Spark type holds exactly (ISO DateStyle, AD, years 1-9999).
_DATE_RE = r"^\d{4}-\d{2}-\d{2}$"
_TS_RE = r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d{1,6})?([+-]\d{2}(:?\d{2}){0,2}|Z)?$"
_BYTEA_RE = r"^\\x([0-9a-fA-F]{2})*$"


def _array_element_re(delimiter: str) -> str:
    """One element of an array literal: a quoted string (backslash escapes) or a run without
    the delimiter (``,``; ``;`` in a ``box[]``: walbus.contract.array_delimiter)."""
    return rf'"(?:[^"\\]|\\.)*"|[^{delimiter}]+'


def _simple_array_re(delimiter: str) -> str:
    """A one-dimensional array with default bounds ("{...}", no nested braces outside quotes)."""
    item = rf'("(?:[^"\\]|\\.)*"|[^{{}}{delimiter}"]+)'
    return rf"^\{{({item}({delimiter}{item})*)?\}}$"


def _numeric_re(scale: int, precision: int = DECIMAL_PRECISION) -> str:
    integer_digits = precision - scale
    frac = rf"(\.\d{{0,{scale}}}0*)?" if scale > 0 else r"(\.0*)?"
    return rf"^-?\d{{1,{max(integer_digits, 1)}}}{frac}$"


def convert(raw: Column, pg_type: str, target: DataType) -> tuple[Column, Column]:
    """(typed value, exact) for a string column ``raw`` of PostgreSQL type ``pg_type``.

    ``exact`` is false when ``raw`` is not null but cannot be held by ``target``; the caller
    keeps ``raw`` in ``pg_raw_values`` for those.
    """
    if isinstance(target, ArrayType):
        return _convert_array(raw, pg_type[1:] if pg_type.startswith("_") else "text", target)
    value = _convert_scalar(raw, pg_type, target)
    exact = raw.isNull() | value.isNotNull()
    return value, exact


def _convert_scalar(raw: Column, pg_type: str, target: DataType) -> Column:
    if isinstance(target, StringType):
        return raw
    if isinstance(target, BooleanType):
        # top-level bools are JSON true/false; inside arrays PostgreSQL prints t/f
        return F.when(raw.isin("true", "t"), F.lit(True)).when(raw.isin("false", "f"), F.lit(False))
    if isinstance(target, DecimalType):
        # try_cast alone would round extra fractional digits: check the digits first
        return F.when(raw.rlike(_numeric_re(target.scale, target.precision)), raw.try_cast(target))
    if isinstance(target, DateType):
        # the regex turns away 'infinity', 'BC' and 5-digit years, which try_cast would misread
        return F.when(raw.rlike(_DATE_RE), raw.try_cast(target))
    if isinstance(target, TimestampType):
        return F.when(raw.rlike(_TS_RE), raw.try_cast(target))
    if isinstance(target, BinaryType):
        return F.when(raw.rlike(_BYTEA_RE), F.unhex(F.substring(raw, 3, 1 << 30)))
    return raw.try_cast(target)


def _unquote(element: Column) -> Column:
    """One array element's text: quoted -> unescaped string, bare NULL -> null."""
    unquoted = F.regexp_replace(F.regexp_replace(element, r'^"|"$', ""), r"\\(.)", "$1")
    return F.when(element.startswith('"'), unquoted).when(element == "NULL", F.lit(None)).otherwise(element)


def _convert_array(raw: Column, element_pg_type: str, target: ArrayType) -> tuple[Column, Column]:
    element_type = target.elementType
    delimiter = array_delimiter(element_pg_type)
    # One-dimensional arrays with default bounds only; anything else (multi-dimensional,
    # "[0:1]={...}") is kept as text in pg_raw_values.
    simple = raw.rlike(_simple_array_re(delimiter))
    body = F.regexp_replace(F.substring(raw, 2, 1 << 30), r"\}$", "")
    texts = F.transform(F.regexp_extract_all(body, F.lit(_array_element_re(delimiter)), 0), _unquote)
    if isinstance(element_type, StringType):
        # each element's text is its value: exact, without two more passes over the elements
        # (lambdas are evaluated element by element, interpreted)
        return F.when(simple, texts), raw.isNull() | simple
    converted = F.transform(texts, lambda t: _convert_scalar(t, element_pg_type, element_type))
    all_exact = F.forall(
        F.arrays_zip(texts.alias("t"), converted.alias("c")),
        lambda z: z["t"].isNull() | z["c"].isNotNull(),
    )
    value = F.when(simple, converted)
    exact = raw.isNull() | (simple & all_exact)
    return value, exact


def describe(pg_type: str, spark: DataType) -> str:
    """``int4 (int)``: for error messages."""
    return f"{pg_type} ({spark.simpleString()})"
