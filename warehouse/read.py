"""Reading one load's slice of the database topic with Spark's own Kafka source.

The slice is fixed before Spark reads anything: ``start`` comes from the load log (where the
last successful load stopped), ``end`` is the topic's end offsets when the job starts. Both
are explicit per-partition offsets, so a replayed load reads exactly the same records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

import orjson
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from walbus.contract import (
    CONTRACT_VERSION,
    FIELD_BITS,
    FIELD_ORDER,
    KEY_FORMAT,
    OPERATIONS,
    ROW_OPERATIONS,
)
from walbus.kafka import KafkaAdmin, KafkaOptions, retry_retriable, topic_offsets
from warehouse.schema import quote

Offsets = dict[int, int]  # partition -> offset

# The Spark types of the contract-v1 fields (walbus.contract.FIELD_ORDER: a field added to
# the contract fails here until it is given a type). ``values`` as array<string>: Spark's
# JSON reader hands a string field the raw JSON text of a non-string value (2000 -> "2000",
# true -> "true"), so every value survives parsing exactly and the pg type decides how to
# read it (warehouse.types). The integer fields are parsed as their raw text too (1.0 and 1
# both read as decimal 1) and cast once checked (see :func:`checked`).
_FIELD_TYPES: Final = {
    "v": "int",
    "lsn": "decimal(20,0)",
    "commit_lsn": "decimal(20,0)",
    "seq": "bigint",
    "xid": "bigint",
    "operation": "string",
    "table": "string",
    "timestamp": "string",
    "pk": "array<string>",
    "not_null": "array<string>",
    "typmods": "map<string, array<int>>",
    "columns": "array<string>",
    "types": "array<string>",
    "values": "array<string>",
    "identity": "struct<columns: array<string>, types: array<string>, values: array<string>>",
    "unchanged": "array<string>",
}
ENVELOPE_SCHEMA: Final = ", ".join(
    f"{quote(name)} {'string' if name in FIELD_BITS else _FIELD_TYPES[name]}" for name in FIELD_ORDER
)
INVALID: Final = "invalid_reason"  # why a record is not a contract-v1 event; null if it is
FIELDS: Final = "_walbus_fields"  # the event's fields, as checked() gives them


class TopicError(RuntimeError):
    """The topic cannot be read as asked (missing, or records deleted before being loaded)."""


@dataclass(frozen=True)
class TopicBounds:
    earliest: Offsets
    latest: Offsets


async def _bounds(options: KafkaOptions, topic: str) -> TopicBounds:
    client_kwargs = options.kafka_client_kwargs()

    async def topics() -> set[str]:
        async with KafkaAdmin(client_kwargs=client_kwargs) as admin:
            return await admin.list_topics()

    # A broker that is down while the load starts is a transient fault, not a failed load.
    if topic not in await retry_retriable(topics, "listing the topics"):
        raise TopicError(f"topic {topic!r} does not exist on {options.kafka_bootstrap}")
    earliest, latest = await topic_offsets(client_kwargs, topic)
    return TopicBounds(earliest, latest)


def topic_bounds(options: KafkaOptions, topic: str) -> TopicBounds:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_bounds(options, topic))
    # called from async code (a loop is running in this thread): use a thread of its own
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _bounds(options, topic)).result()


def check_no_gap(topic: str, start: Offsets, earliest: Offsets) -> None:
    """Fail when records between the last load and now were deleted by retention."""
    lost = {p: (s, earliest[p]) for p, s in start.items() if p in earliest and earliest[p] > s}
    if lost:
        detail = ", ".join(f"partition {p}: next to load {s}, earliest kept {e}" for p, (s, e) in sorted(lost.items()))
        raise TopicError(
            f"records of {topic} were deleted by Kafka retention before being loaded ({detail}); "
            "the warehouse would miss changes. Raise the topic's retention and reload the "
            "affected tables from a fresh warehouse path."
        )


def spark_kafka_options(options: KafkaOptions) -> dict[str, str]:
    """The ``kafka.*`` options of Spark's Kafka source for walbus' Kafka settings."""
    out = {
        "kafka.bootstrap.servers": options.kafka_bootstrap,
        "kafka.security.protocol": options.kafka_security_protocol,
    }
    if options.kafka_security_protocol.startswith("SASL"):
        module = (
            "org.apache.kafka.common.security.plain.PlainLoginModule"
            if options.kafka_sasl_mechanism == "PLAIN"
            else "org.apache.kafka.common.security.scram.ScramLoginModule"
        )
        user = orjson.dumps(options.kafka_sasl_username or "").decode()
        password = orjson.dumps(options.kafka_sasl_password or "").decode()
        out["kafka.sasl.mechanism"] = options.kafka_sasl_mechanism
        out["kafka.sasl.jaas.config"] = f"{module} required username={user} password={password};"
    if options.kafka_security_protocol in ("SSL", "SASL_SSL"):
        if options.kafka_ssl_cafile:
            out["kafka.ssl.truststore.type"] = "PEM"
            out["kafka.ssl.truststore.location"] = options.kafka_ssl_cafile
        if options.kafka_ssl_certfile:
            # PEM key material inline: the files need to exist on the driver only.
            with open(options.kafka_ssl_certfile) as fh:
                out["kafka.ssl.keystore.certificate.chain"] = fh.read()
            with open(options.kafka_ssl_keyfile or options.kafka_ssl_certfile) as fh:
                out["kafka.ssl.keystore.key"] = fh.read()
            out["kafka.ssl.keystore.type"] = "PEM"
    return out


def offsets_json(topic: str, offsets: Offsets) -> str:
    return orjson.dumps({topic: {str(p): o for p, o in sorted(offsets.items())}}).decode()


def read_slice(
    spark: SparkSession, options: KafkaOptions, topic: str, start: Offsets, end: Offsets
) -> DataFrame:
    """The records ``start <= offset < end`` of each partition, as raw Kafka rows."""
    parts = sorted(p for p in end if end[p] > start.get(p, 0))
    reader = spark.read.format("kafka")
    for key, value in spark_kafka_options(options).items():
        reader = reader.option(key, value)
    return (
        reader.option("assign", orjson.dumps({topic: parts}).decode())
        .option("startingOffsets", offsets_json(topic, {p: start.get(p, 0) for p in parts}))
        .option("endingOffsets", offsets_json(topic, {p: end[p] for p in parts}))
        # a gap is checked before reading (check_no_gap) with a clearer message
        .option("failOnDataLoss", "true")
        # split each partition's offset range over the cores: one Kafka partition would
        # otherwise be read and parsed by a single task
        .option("minPartitions", str(max(spark.sparkContext.defaultParallelism, 1)))
        .load()
    )


# -- the contract's checks as Spark expressions -------------------------------------------
# walbus.contract.decode_event + check_key, rule for rule and in the same order (the first
# broken rule is the reason), without a Python worker: the value is parsed once into a
# variant (exact JSON types) and once with ENVELOPE_SCHEMA (the fields the load uses).
# tests/integration/test_prop_warehouse_check.py holds both to the same verdict on every record.
# Known gaps, all text walbus never writes (orjson cannot): a lone surrogate escape
# ("\ud800"), a number beyond the double range (1e400) and a whole JSON value followed by
# "]" and more are accepted here and refused by decode_event.

_WRAPPED: Final = "_walbus_json"  # [value]: a parse that stops early leaves a second element
_TEXT: Final = "_walbus_text"
_EVENT: Final = "_walbus_event"
_JSON_SPACE: Final = "[ \\t\\n\\r]*"
# split_table's grammar: a part is double-quoted (inner quotes doubled) or holds neither
# a dot nor a quote; neither part is empty.
_PART: Final = '("(?:[^"]|"")+"|[^."]+)'
_QUALIFIED: Final = rf"\A{_PART}\.{_PART}\z"
_INTEGER_TEXT: Final = r"\A-?[0-9]+\z"
_MAX_64: Final = (1 << max(FIELD_BITS.values())) - 1  # orjson reads bigger integers as floats


def _number(value: int) -> Column:
    """An integer literal of any size (py4j passes Python ints as Java longs)."""
    return F.lit(Decimal(value))


def _field(name: str) -> Column:
    """The field as a variant: SQL null when absent, a variant null for JSON null."""
    return F.variant_get(F.col(_WRAPPED), f"$[0].{name}", "variant")


def _json_type(name: str) -> Column:
    """The field's JSON type as schema_of_variant names it (BIGINT, STRING, ARRAY<…>, VOID…)."""
    return F.schema_of_variant(_field(name))


def _shown(name: str) -> Column:
    """The field as JSON text for a reason (None when absent, as Python shows it)."""
    return F.coalesce(F.to_json(_field(name)), F.lit("None"))


def _is_string(name: str) -> Column:
    return F.coalesce(_json_type(name) == "STRING", F.lit(False))


def _items(name: str) -> Column:
    """The field as an array of variants; null when absent or not a JSON array."""
    return F.try_variant_get(F.col(_WRAPPED), f"$[0].{name}", "array<variant>")


def _strings(name: str) -> Column:
    """Whether the list field holds strings only (no null, number or list)."""
    only_strings = F.forall(_items(name), lambda x: F.coalesce(F.schema_of_variant(x) == "STRING", F.lit(False)))
    return F.coalesce(only_strings, F.lit(False))


def _names_check(name: str) -> list[tuple[Column, str | Column]]:
    """An optional list of names (pk, unchanged): absent is [], anything else a list of strings."""
    present = _field(name).isNotNull()
    return [
        (present & _items(name).isNull(), f"field {name!r} must be a list"),
        (present & ~_strings(name), f"{name}: names must be strings"),
    ]


def _not_null_checks() -> list[tuple[Column, str | Column]]:
    """Like :func:`_names_check`, but JSON null is absent too (decode_event)."""
    present = _field("not_null").isNotNull() & ~F.is_variant_null(_field("not_null"))
    return [
        (present & _items("not_null").isNull(), "field 'not_null' must be a list"),
        (present & ~_strings("not_null"), "not_null: names must be strings"),
    ]


def _int32(item: Column) -> Column:
    """A JSON integer (not 12.0 or "12") in PostgreSQL's int4 range."""
    return F.coalesce((F.schema_of_variant(item) == "BIGINT") & F.try_variant_get(item, "$", "int").isNotNull(), F.lit(False))


def _typmods_checks() -> list[tuple[Column, str | Column]]:
    """decode_event's _typmods: null, or an object of column -> list of int32s."""
    typmods = _field("typmods")
    present = typmods.isNotNull() & ~F.is_variant_null(typmods)
    entries = F.try_variant_get(F.col(_WRAPPED), "$[0].typmods", "map<string, variant>")
    lists = F.map_values(entries)
    good = F.forall(lists, lambda mods: F.coalesce(F.forall(F.try_variant_get(mods, "$", "array<variant>"), _int32), F.lit(False)))
    return [
        (present & ~F.coalesce(F.schema_of_variant(typmods).startswith("OBJECT<"), F.lit(False)), "field 'typmods' must be an object"),
        (present & ~F.coalesce(good, F.lit(False)), "field 'typmods' must map each column to a list of 32-bit integers"),
    ]


def _image_checks(prefix: str, where: str, present: Column) -> list[tuple[Column, str | Column]]:
    """decode_event's _image: columns, types and values lists of one length, names strings."""
    columns, types, values = (f"{prefix}{part}" for part in ("columns", "types", "values"))
    sizes = [F.array_size(_items(n)) for n in (columns, types, values)]
    return [
        (present & (_field(columns).isNull() | _field(types).isNull() | _field(values).isNull()),
         f"{where}: needs columns, types and values"),
        (present & (_items(columns).isNull() | _items(types).isNull() | _items(values).isNull()),
         f"{where}: columns, types and values must be lists"),
        (present & ((sizes[0] != sizes[1]) | (sizes[1] != sizes[2])), f"{where}: columns, types and values differ in length"),
        (present & ~_strings(columns), f"{where} columns: names must be strings"),
        (present & ~_strings(types), f"{where} types: names must be strings"),
    ]


def _int_checks(name: str) -> list[tuple[Column, str | Column]]:
    """decode_event's _int_field: a JSON integer (not 1.0, "1" or true) in 0 .. 2**bits - 1."""
    raw = F.col(f"{_EVENT}.{quote(name)}")  # the number's own text (1.0 stays 1.0)
    kind = F.coalesce(_json_type(name), F.lit("None"))
    integer = ((kind == "BIGINT") | kind.rlike(r"\ADECIMAL\([0-9]+,0\)\z")) & raw.rlike(_INTEGER_TEXT)
    number = raw.try_cast("decimal(38,0)")
    # a number as written (the variant shows 15.0 as 15), anything else as JSON
    shown = F.when(kind.isin("BIGINT", "DOUBLE") | kind.startswith("DECIMAL("), raw).otherwise(_shown(name))
    got = F.concat(F.lit(f"field {name!r} must be an integer, got "), shown)
    return [
        # orjson reads an integer beyond 64 bits as a float: "must be an integer" there too
        (~integer | number.isNull() | (number > _number(_MAX_64)), got),
        ((number < 0) | (number >= _number(1 << FIELD_BITS[name])),
         F.concat(F.lit(f"field {name!r} is out of range: "), raw)),
    ]


def _signed(unsigned: Column) -> Column:
    """A 64-bit unsigned value as the bigint of the same bits (Java's %X prints those bits)."""
    return F.when(unsigned > _number((1 << 63) - 1), unsigned - _number(1 << 64)).otherwise(unsigned).try_cast("bigint")


def _reason() -> Column:
    """The first contract rule a row breaks (decode_event's order, then check_key), or null."""
    table = F.col(f"{_EVENT}.table")
    operation = F.col(f"{_EVENT}.operation")
    has_row = _field("columns").isNotNull()
    identity = _field("identity")
    has_identity = identity.isNotNull() & ~F.is_variant_null(identity)
    version = F.coalesce(_json_type("v"), F.lit("None"))
    numeric = version.isin("BIGINT", "DOUBLE", "BOOLEAN") | version.startswith("DECIMAL(")
    key = F.col("key").cast("string")
    expected_key = F.format_string(
        KEY_FORMAT, _signed(F.col(f"{_EVENT}.commit_lsn").try_cast("decimal(20,0)")), F.col(f"{_EVENT}.seq").try_cast("bigint")
    )
    checks: list[tuple[Column, str | Column]] = [
        (F.col("value").isNull(), "record without a value"),
        (~F.is_valid_utf8(F.col("value")), "value is not JSON: not valid UTF-8"),
        (F.col(_WRAPPED).isNull() | F.variant_get(F.col(_WRAPPED), "$[1]", "variant").isNotNull()
         | F.variant_get(F.col(_WRAPPED), "$[0]", "variant").isNull(), "value is not JSON"),
        (~F.col(_TEXT).rlike(rf"\A{_JSON_SPACE}\{{"), "value is not a JSON object"),
        (~(numeric & F.coalesce(F.try_variant_get(_field("v"), "$", "double") == CONTRACT_VERSION, F.lit(False))),
         F.concat(F.lit("unknown contract version "), _shown("v"), F.lit(f" (this build reads v{CONTRACT_VERSION})"))),
        (~(_is_string("operation") & operation.isin(*sorted(OPERATIONS))),
         F.concat(F.lit("unknown operation "), _shown("operation"))),
        (~_is_string("table"), F.concat(F.lit("field 'table' must be 'schema.table', got "), _shown("table"))),
        (~table.rlike(_QUALIFIED), F.concat(F.lit("table name "), _shown("table"), F.lit(" is not 'schema.table'"))),
        (~_is_string("timestamp"), "field 'timestamp' must be a string"),
        *_names_check("pk"),
        *_not_null_checks(),
        *_typmods_checks(),
        *_image_checks("", "row", has_row),
        (~has_row & operation.isin(*sorted(ROW_OPERATIONS)), F.concat(operation, F.lit(" event without columns/types/values"))),
        *_image_checks("identity.", "identity", has_identity),
        *_names_check("unchanged"),
        *(check for name in FIELD_ORDER if name in FIELD_BITS for check in _int_checks(name)),
        (F.coalesce(key != expected_key, F.lit(True)),
         F.concat(F.lit("key "), F.coalesce(F.substring(key, 1, 40), F.lit("None")),
                  F.lit(" is not the event's position "), expected_key)),
    ]
    reason: Column | None = None
    for broken, text in checks:
        message = F.lit(text) if isinstance(text, str) else text
        reason = F.when(broken, message) if reason is None else reason.when(broken, message)
    assert reason is not None
    return reason


def _unquote(part: Column) -> Column:
    return F.when(part.startswith('"'), F.replace(F.substring(part, 2, F.length(part) - 2), F.lit('""'), F.lit('"'))).otherwise(part)


def _quote(name: Column) -> Column:
    """walbus.contract.qualify_table's spelling of one part."""
    needs = name.contains(".") | name.contains('"')
    return F.when(needs, F.concat(F.lit('"'), F.replace(name, F.lit('"'), F.lit('""')), F.lit('"'))).otherwise(name)


def _respelled(table: Column) -> Column:
    """``qualify_table(*split_table(table))``, for a table that passed the checks."""
    parts = [_unquote(F.regexp_extract(table, _QUALIFIED, group)) for group in (1, 2)]
    return F.concat(_quote(parts[0]), F.lit("."), _quote(parts[1]))


# -- the fast path: one parse ----------------------------------------------------------------
# Nearly every record is an event as walbus writes it (orjson: integers as integers, names
# as strings, lists as lists). One from_json parse of ``[value]`` against the contract's
# fields, each a variant (its exact JSON type) but ``values`` (each value's own JSON text),
# shows whether a record is such a canonical event: every rule below implies decode_event's
# and check_key's, so a record passing them all is valid, and its fields are taken from this
# parse. Any other record (invalid, or valid but unusual: an LSN beyond 2**63, a float in
# an identity) goes through the exact checks above, which name the broken rule.

_FAST: Final = "_walbus_fast"
FAST_OK: Final = "_walbus_fast_ok"  # the fast parse proves the record a contract-v1 event
_FAST_TYPED: Final = "_walbus_fast_typed"
# Every field but ``values`` as a variant: only its JSON type is read from it (a value taken
# out of a variant builds a Cast expression per value: a quarter of the parse's time, when
# taken so). The values come from a second, typed parse (ENVELOPE_SCHEMA), Spark's plain
# JSON reader; where the two parses differ on a field (a parse that failed, or a type the
# typed parse bent), the rules below fail and the record takes the exact path.
_FAST_SCHEMA: Final = "array<struct<" + ", ".join(
    f"{quote(name)}: variant" for name in FIELD_ORDER if name != "values"
) + ">>"
_SEQ_LIMIT: Final = 1 << FIELD_BITS["seq"]
# identity values whose text the variant keeps exactly: strings, integers, nulls
_EXACT_IDENTITY: Final = (
    r"\AOBJECT<columns: ARRAY<(STRING|VOID)>, types: ARRAY<(STRING|VOID)>, values: ARRAY<(STRING|BIGINT|VOID)>>\z"
)


def _typed(name: str) -> str:
    return f"_walbus_typed_{name}"


def _kind(name: str) -> str:
    return f"_walbus_kind_{name}"


def _fast_columns() -> list[Column]:
    """Each field of the fast parses once: its JSON type (schema_of_variant, from the variant
    parse) and its value, typed as the exact path types it, from the typed parse (the integer
    fields from their own text). Later expressions read these columns many times."""
    out: list[Column] = []
    for name in FIELD_ORDER:
        typed = F.col(f"{_FAST_TYPED}.{quote(name)}")
        if name != "values":
            out.append(F.schema_of_variant(F.col(f"{_FAST}.{quote(name)}")).alias(_kind(name)))
        out.append((typed.try_cast(_FIELD_TYPES[name]) if name in FIELD_BITS else typed).alias(_typed(name)))
    return out


def _names(name: str) -> Column:
    """The field is a JSON list of strings (no null, number or list in it)."""
    kind, names = F.col(_kind(name)), F.col(_typed(name))
    return ((kind == "ARRAY<STRING>") & F.forall(names, lambda n: n.isNotNull())) | (
        (kind == "ARRAY<VOID>") & (F.array_size(names) == 0)
    )


def _no_nulls(names: Column) -> Column:
    return F.forall(names, lambda n: n.isNotNull())


def _fast_valid() -> Column:
    """Whether the fast parse shows a canonical contract-v1 event (see above)."""

    def kind(name: str) -> Column:
        return F.col(_kind(name))

    def typed(name: str) -> Column:
        return F.col(_typed(name))

    size = F.array_size(typed("values"))
    row = _names("columns") & _names("types") & (F.array_size(typed("columns")) == size) & (
        F.array_size(typed("types")) == size
    )
    ident = typed("identity")
    identity = kind("identity").isNull() | (kind("identity") == "VOID") | (
        kind("identity").rlike(_EXACT_IDENTITY)
        & _no_nulls(ident["columns"]) & _no_nulls(ident["types"])
        & (F.array_size(ident["columns"]) == F.array_size(ident["values"]))
        & (F.array_size(ident["types"]) == F.array_size(ident["values"]))
    )
    integers = [
        (kind(name) == "BIGINT") & (typed(name) >= 0) & (typed(name) < _SEQ_LIMIT if FIELD_BITS[name] < 63 else F.lit(True))
        for name in FIELD_ORDER if name in FIELD_BITS
    ]
    # No rule against a key given twice: both parses keep the last one, as orjson does (a
    # typed parse that fails on the last one keeps an earlier one, but then the last one's
    # JSON type breaks the field's rule).
    rules = [
        F.col("value").isNotNull() & F.is_valid_utf8(F.col("value")),
        F.col(_FAST).isNotNull(),
        (kind("v") == "BIGINT") & (typed("v") == CONTRACT_VERSION),
        (kind("operation") == "STRING") & typed("operation").isin(*sorted(OPERATIONS)),
        (kind("table") == "STRING") & typed("table").rlike(_QUALIFIED),
        (kind("timestamp") == "STRING") & typed("timestamp").isNotNull(),
        _names("pk"),
        kind("not_null").isNull() | (kind("not_null") == "VOID") | _names("not_null"),
        _fast_typmods(),
        F.when(kind("columns").isNotNull(), row).otherwise(~typed("operation").isin(*sorted(ROW_OPERATIONS))),
        identity,
        kind("unchanged").isNull() | _names("unchanged"),
        *integers,
        F.col("key").cast("string") == F.format_string(KEY_FORMAT, typed("commit_lsn").try_cast("bigint"), typed("seq")),
    ]
    ok = rules[0]
    for rule in rules[1:]:
        ok = ok & rule
    return F.coalesce(ok, F.lit(False))


def _fast_typmods() -> Column:
    """Whether ``typmods`` is absent, null or canonical: every value a list of int32s (a name
    that looks like a type in schema_of_variant's text only sends the record the exact way)."""
    kind, typed = F.col(_kind("typmods")), F.col(_typed("typmods"))
    lists_of_ints = kind.startswith("OBJECT<") & ~kind.rlike("ARRAY<(?!BIGINT>)") & typed.isNotNull() & F.forall(
        F.map_values(typed), lambda mods: mods.isNotNull() & F.forall(mods, lambda m: m.isNotNull())
    )
    return kind.isNull() | (kind == "VOID") | lists_of_ints


def _slow_field(name: str) -> Column:
    if name in FIELD_BITS:
        return F.col(f"{_EVENT}.{quote(name)}").try_cast(_FIELD_TYPES[name])
    return F.col(f"{_EVENT}.{quote(name)}")


@dataclass(frozen=True)
class _Expressions:
    """The contract checks' Column expressions, built once per SparkContext: building them is
    thousands of py4j calls (~1 s a load on this machine kind, half of a small load's parse
    phase), and an expression tree is not tied to any one DataFrame."""

    fast: Column  # [value] parsed against _FAST_SCHEMA, as one inline()d column
    fast_one: Column  # that parse when the value was one JSON value
    fast_columns: list[Column]
    fast_ok: Column
    fast_fields: Column  # the event's fields from the fast parse, in a struct (FIELDS)
    slow: Column  # the exact checks' parses, as one inline()d column
    invalid: Column
    slow_fields: Column  # the event's fields from the exact checks' parses (FIELDS)
    events: list[Column]  # parse_events' columns


def _build_expressions() -> _Expressions:
    text = F.col("value").cast("string")
    fast = F.from_json(F.concat(F.lit("["), text, F.lit("]")), _FAST_SCHEMA)
    fast_typed = F.from_json(text, ENVELOPE_SCHEMA)
    slow = F.struct(
        text.alias(_TEXT),
        F.try_parse_json(F.concat(F.lit("["), text, F.lit("]"))).alias(_WRAPPED),
        F.from_json(text, ENVELOPE_SCHEMA).alias(_EVENT),
    )

    def event_field(name: str) -> Column:
        value = F.col(f"{FIELDS}.{quote(name)}")
        if name == "table":
            # a name without a quote is spelled as qualify_table spells it already
            respelled = F.when(value.contains('"'), _respelled(value)).otherwise(value)
            return F.when(F.col(INVALID).isNull(), respelled).alias(name)
        if name in ("types", "values"):  # without columns the event has no row image (decode_event)
            return F.when(F.col(f"{FIELDS}.columns").isNotNull(), value).alias(name)
        return value.alias(name)

    return _Expressions(
        # each inline() (a Generate node) keeps the optimizer from copying a parse into every
        # expression that reads it
        fast=F.inline(F.array(F.struct(fast.alias(_FAST), fast_typed.alias(_FAST_TYPED)))),
        # one element: the value was one JSON value (a second one is text after it)
        fast_one=F.when(F.array_size(_FAST) == 1, F.col(_FAST)[0]),
        fast_columns=_fast_columns(),
        fast_ok=_fast_valid(),
        # in a struct: a Kafka row has a `timestamp` column of its own
        fast_fields=F.struct(*[F.col(_typed(n)).alias(n) for n in FIELD_ORDER]).alias(FIELDS),
        slow=F.inline(F.array(slow)),
        invalid=_reason().alias(INVALID),
        slow_fields=F.struct(*[_slow_field(n).alias(n) for n in FIELD_ORDER]).alias(FIELDS),
        events=[
            F.col("partition").alias("kafka_partition"), F.col("offset").alias("kafka_offset"), F.col(INVALID),
            *[event_field(name) for name in FIELD_ORDER],
        ],
    )


_built: list[tuple[Any, _Expressions]] = []  # (the SparkContext's JVM object, its expressions)
_built_lock = threading.Lock()


def _expressions(spark: SparkSession) -> _Expressions:
    """:class:`_Expressions` for ``spark``'s context (a new context builds them anew)."""
    context = spark.sparkContext._jsc
    with _built_lock:
        if not _built or _built[0][0] is not context:
            _built[:] = [(context, _build_expressions())]
        return _built[0][1]


# The columns of a record that the exact checks read (besides the value); they are all a
# load keeps of a record after the fast parse.
_RECORD: Final = ("key", "partition", "offset")


def fast_checked(raw: DataFrame) -> DataFrame:
    """Kafka rows -> ``partition``, ``offset``, ``key``, :data:`FAST_OK` (the fast parse shows a
    canonical event), :data:`FIELDS` (its fields, where FAST_OK) and ``value``, kept only
    where FAST_OK is false: those records, and only those, go on to :func:`exact_checked`.

    The exact checks are a separate plan on purpose: they are ten times the fast parse's
    expressions, and compiling and planning them cost more than the parse itself on a slice
    where every record passes the fast one (the usual case)."""
    x = _expressions(raw.sparkSession)
    parsed = raw.select("*", x.fast).withColumn(_FAST, x.fast_one)
    parsed = parsed.select("*", *x.fast_columns).withColumn(FAST_OK, x.fast_ok)
    return parsed.select(*_RECORD, FAST_OK, x.fast_fields, F.when(~F.col(FAST_OK), F.col("value")).alias("value"))


def exact_checked(rows: DataFrame) -> DataFrame:
    """Rows of :func:`fast_checked` whose FAST_OK is false -> ``partition``, ``offset``,
    ``key``, ``value``, :data:`INVALID` (the first contract rule the record breaks, or null: a
    valid but unusual event) and :data:`FIELDS` from the exact checks' parses."""
    x = _expressions(rows.sparkSession)
    return rows.select(*_RECORD, "value", x.slow).select(*_RECORD, "value", x.invalid, x.slow_fields)


def fast_events(fast: DataFrame) -> DataFrame:
    """The events of :func:`fast_checked` rows whose FAST_OK is true (see :func:`parse_events`)."""
    x = _expressions(fast.sparkSession)
    return fast.where(F.col(FAST_OK)).withColumn(INVALID, F.lit(None).cast("string")).select(*x.events)


def summary_events(fast: DataFrame) -> DataFrame:
    """:func:`fast_events`' columns for every :func:`fast_checked` row, all null where FAST_OK
    is false: a load's first pass summarises its tables and counts the records left to the
    exact checks (those under a null ``table``) in one job, as it fills the cache."""
    x = _expressions(fast.sparkSession)
    events = fast.withColumn(INVALID, F.lit(None).cast("string")).select(F.col(FAST_OK), *x.events)
    return events.select(*[F.when(F.col(FAST_OK), F.col(quote(c))).alias(c) for c in events.columns if c != FAST_OK])


def exact_events(fast: DataFrame) -> DataFrame:
    """The events of :func:`fast_checked` rows whose FAST_OK is false (see :func:`parse_events`)."""
    return exact_checked(fast.where(~F.col(FAST_OK))).select(*_expressions(fast.sparkSession).events)


def parse_events(raw: DataFrame) -> DataFrame:
    """Kafka rows -> one row per event: partition/offset, :data:`INVALID`, envelope fields
    (typed as :data:`_FIELD_TYPES`), from the fast parse or else the exact checks' parses.

    ``table`` is respelled as :func:`walbus.contract.qualify_table` spells it, so two
    spellings of one (schema, table) pair load as one table. A load runs the two halves
    itself (:func:`fast_events`, :func:`exact_events`), the second only when needed.
    """
    fast = fast_checked(raw)
    return fast_events(fast).unionByName(exact_events(fast))


def invalid_events() -> Column:
    """Rows that are not contract-v1 events (see :func:`check_record`)."""
    return F.col(INVALID).isNotNull()


def describe_invalid(topic: str, row: Any) -> str:
    return f"record at {topic} partition {row['kafka_partition']} offset {row['kafka_offset']}: {row[INVALID]}"
