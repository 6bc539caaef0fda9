"""Pure warehouse logic: type mapping, schema evolution rules, path naming."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    TimestampType,
)

from warehouse import layout
from warehouse.schema import SchemaChangeError, SourceColumn, plan
from warehouse.spark import (
    KAFKA_CONNECTOR,
    default_sql_warehouse,
    on_this_host,
    packages,
    sql_warehouse_conf,
)
from warehouse.types import _numeric_re, compatible, spark_type


@pytest.mark.parametrize(
    ("pg", "spark"),
    [
        ("int2", IntegerType()),
        ("int4", IntegerType()),
        ("int8", LongType()),
        ("oid", LongType()),
        ("numeric", DecimalType(38, 10)),
        ("float4", FloatType()),
        ("float8", DoubleType()),
        ("bool", BooleanType()),
        ("date", DateType()),
        ("timestamp", TimestampType()),
        ("timestamptz", TimestampType()),
        ("bytea", BinaryType()),
        ("text", StringType()),
        ("varchar", StringType()),
        ("uuid", StringType()),
        ("jsonb", StringType()),
        ("interval", StringType()),
        ("my_enum", StringType()),
        ("_int4", ArrayType(IntegerType(), True)),
        ("_text", ArrayType(StringType(), True)),
        ("_numeric", ArrayType(DecimalType(38, 10), True)),
    ],
)
def test_type_mapping(pg: str, spark: object) -> None:
    assert spark_type(pg) == spark


def test_numeric_scale_option_and_decimal_compatibility() -> None:
    assert spark_type("numeric", numeric_scale=2) == DecimalType(38, 2)
    assert compatible(DecimalType(38, 2), DecimalType(38, 10))
    assert not compatible(IntegerType(), LongType())
    assert compatible(ArrayType(DecimalType(38, 2)), ArrayType(DecimalType(38, 4)))


@pytest.mark.parametrize(
    ("text", "fits"),
    [
        ("0", True),
        ("-12.5", True),
        ("1234567890123456789012345678", True),  # 28 integer digits
        ("12345678901234567890123456789", False),  # 29: beyond decimal(38,10)
        ("0.1234567890", True),
        ("0.12345678901", False),  # 11 fractional digits would be rounded
        ("0.12345678900000", True),  # trailing zeros lose nothing
        ("NaN", False),
    ],
)
def test_numeric_exactness_rule(text: str, fits: bool) -> None:
    assert bool(re.match(_numeric_re(10), text)) is fits


def _cols(*pairs: tuple[str, str]) -> list[SourceColumn]:
    return [SourceColumn(n, t, spark_type(t)) for n, t in pairs]


def test_plan_new_table_keeps_event_order() -> None:
    p = plan("s.t", None, [("id", "int4"), ("b", "text")], numeric_scale=10)
    assert [c.name for c in p.columns] == ["id", "b"] and p.added == p.columns


def test_plan_added_and_dropped_columns() -> None:
    existing = _cols(("id", "int4"), ("b", "text"))
    p = plan("s.t", existing, [("id", "int4"), ("c", "int8")], numeric_scale=10)
    assert [c.name for c in p.columns] == ["id", "b", "c"]  # b stays
    assert [c.name for c in p.added] == ["c"]


def test_plan_compatible_type_change_is_fine() -> None:
    existing = _cols(("id", "int4"), ("b", "varchar"))
    p = plan("s.t", existing, [("id", "int4"), ("b", "text")], numeric_scale=10)
    assert p.added == () and p.columns[1].pg_type == "text"


def test_plan_incompatible_type_change_says_what_changed() -> None:
    existing = _cols(("id", "int4"), ("amount", "int4"))
    with pytest.raises(SchemaChangeError, match=r"'amount' changed type from int4 \(int\) to text \(string\)"):
        plan("s.t", existing, [("id", "int4"), ("amount", "text")], numeric_scale=10)


def test_plan_widens_what_delta_can_widen() -> None:
    # int -> bigint across loads failed the table, on every load after (a fuzz)
    existing = _cols(("id", "int4"), ("a", "int4"), ("r", "float4"), ("d", "numeric(12,2)"), ("arr", "_int4"), ("s", "int8"))
    p = plan("s.t", existing, [("id", "int4"), ("a", "int8"), ("r", "float8"), ("d", "numeric(14,4)"), ("arr", "_int8"),
                               ("s", "int4")], numeric_scale=10)
    assert {c.name: c.spark.simpleString() for c in p.columns} == {
        "id": "int", "a": "bigint", "r": "double", "d": "decimal(14,4)", "arr": "array<bigint>", "s": "bigint",
    }
    assert [c.name for c in p.widened] == ["a", "r", "d", "arr"] and p.added == ()
    # past 38 digits no decimal holds both: the column keeps its type (values: pg_raw_values)
    wide = plan("s.t", _cols(("d", "numeric")), [("d", "numeric(30,20)")], numeric_scale=10)
    assert wide.widened == () and wide.columns[0].spark.simpleString() == "decimal(38,10)"
    with pytest.raises(SchemaChangeError, match=r"cannot make of the column.*Move its directory away"):
        plan("s.t", _cols(("a", "int4")), [("a", "float8")], numeric_scale=10)


def test_plan_two_types_in_one_load() -> None:
    with pytest.raises(SchemaChangeError, match="within this load"):
        plan("s.t", None, [("a", "int4"), ("a", "text")], numeric_scale=10)
    # int and bigint widen (a fuzz: that load failed, and its replay after moving the table away)
    assert plan("s.t", None, [("a", "int4"), ("a", "int8")], numeric_scale=10).columns[0].spark == spark_type("int8")
    # a column new to the tables takes the latest event's type (a table dropped and created
    # again with other types: its load failed for good, the documented recovery too)
    for order in ([("a", "int4"), ("a", "text")], [("a", "text"), ("a", "int4")]):
        (col,) = plan("s.t", None, order, numeric_scale=10, latest={"a": "text"}).columns
        assert (col.pg_type, col.spark) == ("text", spark_type("text"))
    existing = _cols(("a", "int4"))
    with pytest.raises(SchemaChangeError):  # an existing column: its table keeps failing (documented)
        plan("s.t", existing, [("a", "int4"), ("a", "text")], numeric_scale=10, latest={"a": "text"})


def test_plan_stores_a_column_named_like_a_metadata_column_under_another_name() -> None:
    # refused before ("clash with walbus metadata columns"): a legal PostgreSQL table not loaded
    reserved = {"pg_lsn", "pg_seq", "_walbus_deleted"}
    p = plan("s.t", None, [("pg_lsn", "int4"), ("PG_SEQ", "text"), ("_Walbus_Deleted", "bool"), ("_WALBUS_PREV_x", "int4"),
                           ("_walbus_probe", "text"), ("v", "text")],
             reserved=reserved, reserved_prefixes=["_walbus_prev_"], numeric_scale=10)
    assert [(c.name, c.pg_name) for c in p.columns] == [
        ("_walbus_col_pg_lsn", "pg_lsn"), ("_walbus_col_PG_SEQ", "PG_SEQ"),
        ("_walbus_col__Walbus_Deleted", "_Walbus_Deleted"), ("_walbus_col__WALBUS_PREV_x", "_WALBUS_PREV_x"),
        ("_walbus_probe", "_walbus_probe"), ("v", "v")]
    assert [c.source for c in p.columns] == ["pg_lsn", "PG_SEQ", "_Walbus_Deleted", "_WALBUS_PREV_x", None, None]


@pytest.mark.parametrize(
    ("schema", "table"),
    [("public", "transactions"), ("Weird Schema", "tab/le.x"), ("ünï", "cödé"), ("a.b", "c"), ("a", "b.c")],
)
def test_table_dir_names_round_trip(schema: str, table: str) -> None:
    segment = layout.table_dir_name(schema, table)
    assert re.fullmatch(r"[A-Za-z0-9_~-]+\.[A-Za-z0-9_~-]+", segment)
    assert layout.table_from_dir_name(segment) == (schema, table)


def test_table_dir_names_are_distinct_where_dots_are() -> None:
    # "a.b"."c" and "a"."b.c" were one directory when the event's name was split at its first dot
    assert layout.table_dir_name("a.b", "c") != layout.table_dir_name("a", "b.c")
    assert layout.table_from_dir_name(layout.LOADS_DIR) is None
    assert layout.table_from_dir_name(layout.QUARANTINE_DIR) is None


def test_paths_and_view_names() -> None:
    paths = layout.table_paths("s3a://bucket/wh/", "walbus.shop", "public", "transactions")
    assert paths.history == "s3a://bucket/wh/walbus~2Eshop/public.transactions/history"
    assert paths.current.endswith("/public.transactions/current")
    assert [paths.view(k) for k in ("", "all", "history")] == [
        "public_transactions", "public_transactions_all", "public_transactions_history"
    ]
    odd = layout.table_paths("/wh", "walbus.shop", "public", "Order Items")
    assert [odd.view(k) for k in ("", "all", "history")] == [
        "public.Order Items", "public.Order Items.all", "public.Order Items.history"
    ]


# pairs whose views shared a name before: spaces and underscores, the split of schema and
# table at an underscore, a table named like another's _history view, dots in either part
_VIEW_PAIRS = [
    ("public", "a b"), ("public", "a_b"), ("sales_eu", "orders"), ("sales", "eu_orders"),
    ("s", "t"), ("s", "t_history"), ("s", "t_all"), ("s", "t.history"), ("s.t", "history"),
    ("s", "t.all"), ("a.b", "c"), ("a", "b.c"), ("a_b", "c"), ("a", "b_c"), ("public", "ö"),
]


def test_view_names_are_distinct_for_distinct_tables() -> None:
    names = [layout.table_paths("/wh", "t", s, t).view(k) for s, t in _VIEW_PAIRS for k in ("", "all", "history")]
    names += [layout.QUARANTINE_VIEW, layout.table_paths("/wh", "t", "walbus", "quarantine").view("")]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


def test_packages_match_installed_pyspark() -> None:
    import pyspark

    delta, kafka = packages()
    # The connector of the same minor version: not every patch release has its jars (4.0.5's
    # connector is 4.0.0's, see KAFKA_CONNECTOR).
    minor = ".".join(pyspark.__version__.split(".")[:2])
    assert kafka.endswith(":" + KAFKA_CONNECTOR.get(minor, pyspark.__version__))
    assert kafka.rsplit(":", 1)[1].startswith(minor + ".")
    assert delta.startswith("io.delta:delta-spark_")



@pytest.mark.parametrize(
    ("master", "here"),
    [("local[2]", True), ("local", True), ("local-cluster[2,1,1024]", True), ("spark://127.0.0.1:7077", True),
     ("spark://localhost:7077", True), ("spark://10.0.0.5:7077", False), ("spark://127.0.0.1.example:7077", False),
     ("spark://127.0.0.1:7077,127.0.0.2:7077", False), ("yarn", False), ("k8s://https://127.0.0.1:6443", False)],
)
def test_masters_on_this_host_bind_the_driver_to_loopback(master: str, here: bool) -> None:
    assert on_this_host(master) is here


@pytest.mark.parametrize(("master", "here"), [("local[1]", True), ("spark://127.0.0.1:7077", True), (None, True),
                                              ("yarn", False), ("spark://10.0.0.5:7077", False)])
def test_a_driver_on_this_host_keeps_the_session_catalog_out_of_the_cwd(
    master: str | None, here: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    expected = {"spark.sql.warehouse.dir": default_sql_warehouse()} if here else {}
    assert sql_warehouse_conf(master) == expected
    assert not default_sql_warehouse().startswith(os.getcwd())


def test_under_spark_submit_the_session_catalog_is_the_submitters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")
    assert sql_warehouse_conf(None) == {}


def test_the_history_notes_each_key_change_once() -> None:
    from warehouse.schema import key_changes_of, key_changes_property, with_key_changes

    first = with_key_changes([], {("id",): (0x100, 3)}, 0x100)
    assert first == [((-1, -1), ("id",))]
    # a change inside a load: the new key rules after the old one's last event
    inside = with_key_changes(first, {("id",): (0x200, 1), ("id", "k"): (0x300, 0)}, 0x200)
    assert inside == [((-1, -1), ("id",)), ((0x200, 1), ("id", "k"))]
    assert with_key_changes(inside, {("id",): (0x200, 1), ("id", "k"): (0x300, 0)}, 0x200) == inside  # written again
    # a change between loads: from the load's first event on
    between = with_key_changes(inside, {("id",): (0x500, 0)}, 0x400)
    assert between[-1] == ((0x400, -1), ("id",))
    assert with_key_changes([], {}, 0x100, ["id"]) == [((-1, -1), ("id",))]  # an older walbus' history
    assert key_changes_of({"walbus.primaryKeys": key_changes_property(between)}) == between


def test_plan_stores_names_that_differ_only_in_case_apart() -> None:
    # Delta keeps column names case-insensitively: these failed the whole load inside Delta,
    # then were refused ("differ only in case"); now the later one is stored under another name
    p = plan("s.t", None, [("a", "text"), ("A", "int4")], numeric_scale=10)
    assert [(c.name, c.pg_name, c.pg_type) for c in p.columns] == [("a", "a", "text"), ("_walbus_col_A", "A", "int4")]
    # a column added later, in a later load: the existing columns keep their names
    later = plan("s.t", p.columns, [("A", "int8"), ("a", "text"), ("À", "text"), ("_WALBUS_COL_A", "text")], numeric_scale=10)
    assert [(c.name, c.pg_name) for c in later.columns] == [
        ("a", "a"), ("_walbus_col_A", "A"), ("À", "À"), ("_walbus_col__WALBUS_COL_A", "_WALBUS_COL_A")]
    assert [c.name for c in later.added] == ["À", "_walbus_col__WALBUS_COL_A"]
    assert [(c.name, c.spark) for c in later.widened] == [("_walbus_col_A", spark_type("int8"))]
    # two clashes of one name: each its own stored name, none equal to another ignoring case
    twice = plan("s.t", None, [("pg_lsn", "int4"), ("PG_LSN", "int4"), ("Pg_Lsn", "int4")], reserved={"pg_lsn"}, numeric_scale=10)
    assert [c.name for c in twice.columns] == ["_walbus_col_pg_lsn", "_walbus_col2_PG_LSN", "_walbus_col3_Pg_Lsn"]
    # an existing column stored as its own name that starts with _walbus_ (an older walbus) keeps it
    old = plan("s.t", [SourceColumn("_walbus_x", "text", spark_type("text"))], [("_walbus_x", "text"), ("_WALBUS_X", "text")],
               numeric_scale=10)
    assert [(c.name, c.pg_name) for c in old.columns] == [("_walbus_x", "_walbus_x"), ("_walbus_col__WALBUS_X", "_WALBUS_X")]


@pytest.mark.parametrize("pair", [("\u0131", "i"), ("\u017f", "s"), ("ß", "SS"), ("\u212a", "k"), ("Σ", "ς")])
def test_stored_names_are_apart_by_every_case_rule(pair: tuple[str, str]) -> None:
    # Java's char-wise equalsIgnoreCase (Spark's resolver) finds dotless i and i equal, and case
    # folding "ß" and "ss": the second is stored apart, to be safe under any of them
    first, second = plan("s.t", None, [(pair[0], "text"), (pair[1], "text")], numeric_scale=10).columns
    assert (first.name, second.name) == (pair[0], "_walbus_col_" + pair[1])


def test_stored_names_never_clash() -> None:
    import itertools

    names = ["a", "A", "pg_lsn", "PG_LSN", "_walbus_col_a", "_WALBUS_COL_A", "_walbus_col2_A", "_walbus_prev_id",
             "_walbus_deleted", "walbus_col_a"]
    for order in [*itertools.permutations(names, 4), names, names[::-1]]:
        kw: dict[str, Any] = {"reserved": {"pg_lsn", "_walbus_deleted"}, "reserved_prefixes": ["_walbus_prev_"], "numeric_scale": 10}
        cols = plan("s.t", None, [(n, "text") for n in order], **kw).columns
        stored = [c.name.lower() for c in cols]
        assert len(set(stored)) == len(stored), order
        assert not {"pg_lsn", "_walbus_deleted"} & set(stored), order
        assert not [n for n in stored if n.startswith("_walbus_prev_")], order
        assert all(c.name == c.pg_name or c.name.startswith("_walbus_col") for c in cols), order
        # the same events in the same order: the same names
        assert plan("s.t", None, [(n, "text") for n in order], **kw).columns == cols


def test_sql_json_rows_with_two_columns_of_one_name_are_an_error() -> None:
    # SELECT 1 AS x, 2 AS x printed {"x":2}: the other value lost without a word
    from pyspark.sql import Row

    from warehouse.cli import json_line, row_dict

    with pytest.raises(ValueError, match=r"more than one column \(or struct field\) named 'x'"):
        row_dict(Row("x", "x")(1, 2))
    nested = Row("s", "y")(Row("a", "a")(1, 2), 3)
    with pytest.raises(ValueError, match="named 'a'"):
        row_dict(nested)
    # names apart in case are apart in JSON; structs in arrays and maps are checked too
    ok = Row("x", "X", "l", "m")(1, 2, [Row("a", "b")(1, 2)], {"k": Row("c")(3)})
    assert json_line(row_dict(ok)) == '{"x":1,"X":2,"l":[{"a":1,"b":2}],"m":{"k":{"c":3}}}'
    with pytest.raises(ValueError, match="named 'b'"):
        row_dict(Row("l")([Row("b", "b")(1, 2)]))


def test_sql_json_lines_keep_nan_infinity_and_bytes_apart_from_null() -> None:
    # orjson wrote NaN and ±Infinity as null (a SQL NULL to the reader) and bytea as Python's
    # repr "bytearray(b'\\x00\\xff')"
    from decimal import Decimal

    import orjson

    from warehouse.cli import json_line

    row = {"f": float("nan"), "g": float("inf"), "h": [float("-inf"), 1.5, None], "b": bytearray(b"\x00\xff"),
           "m": {"k": float("nan")}, "n": None, "d": Decimal("1.50")}
    assert orjson.loads(json_line(row)) == {
        "f": "NaN", "g": "Infinity", "h": ["-Infinity", 1.5, None], "b": "\\x00ff", "m": {"k": "NaN"}, "n": None, "d": "1.50",
    }
