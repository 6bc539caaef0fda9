"""Catalog names of the warehouse's tables and the Spark settings of a session with a catalog."""

from __future__ import annotations

import re

import pytest

from warehouse.catalog import CATALOG_DIR, MAX_NAME, check_database, session_conf, table_name

LONG = "é" * 31 + "x"  # 63 bytes, PostgreSQL's longest name
# pairs that differ only in case, in where a dot or an underscore sits, in a suffix-like ending
PAIRS = [
    ("public", "orders"), ("Public", "orders"), ("public", "Orders"), ("public", "order_items"),
    ("public", "order items"), ("public", "order.items"), ("public.order", "items"), ("public_order", "items"),
    ("public", "order_items_history"), ("public", "order_items_current"), ("s", "t_history"), ("s", "t"),
    ("a.b", "c"), ("a", "b.c"), ("a_b", "c"), ("a", "b_c"), ("public", "ö"), ("public", "o"), ("_", "_"),
    ("s", "_5f"), ("s", "_"), ("s_", "5f"), (LONG, LONG), (LONG, LONG[:-1] + "y"), ("public", LONG),
]


def test_plain_tables_keep_their_names() -> None:
    assert table_name("public", "order_items", "history") == "public_order_items_history"
    assert table_name("public", "order_items", "current") == "public_order_items_current"


def test_other_tables_are_hex_escaped() -> None:
    assert table_name("Sales", "Order Items", "history") == "__53ales___4frder_20_49tems_history"
    assert table_name("public", "ö", "current") == "_public___c3_b6_current"


def test_names_are_distinct_lowercase_word_characters_of_bounded_length() -> None:
    names = [table_name(s, t, k) for s, t in PAIRS for k in ("history", "current")]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    for name in names:
        assert re.fullmatch(r"[a-z0-9_]+", name) and len(name) <= MAX_NAME, name
        assert name.endswith(("_history", "_current"))


def test_the_kind_is_history_or_current() -> None:
    with pytest.raises(ValueError, match="kind"):
        table_name("s", "t", "all")


@pytest.mark.parametrize("name", ["Shop", "shop-dw", "shop.dw", "", "ö"])
def test_a_database_name_hive_would_change_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="--catalog-database"):
        check_database(name)
    assert check_database("shop_dw2") == "shop_dw2"


def test_a_local_warehouse_keeps_its_metastore_and_derby_log() -> None:
    conf = session_conf("/data/wh", {"spark.driver.extraJavaOptions": "-Dx=1"})
    home = f"/data/wh/{CATALOG_DIR}"
    assert conf == {
        "spark.sql.catalogImplementation": "hive",
        "spark.sql.warehouse.dir": f"file:{home}/warehouse",
        "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={home}/metastore_db;create=true",
        "spark.driver.extraJavaOptions": f"-Dx=1 -Dderby.system.home={home}",
    }


def test_a_remote_warehouse_or_a_metastore_of_ones_own_gets_no_derby() -> None:
    hive = {"spark.sql.catalogImplementation": "hive"}
    assert session_conf("s3a://bucket/wh", {}) == hive
    assert session_conf("/data/wh", {"spark.hadoop.hive.metastore.uris": "thrift://m:9083"}) == hive
    assert "spark.sql.warehouse.dir" not in session_conf("/data/wh", {"spark.sql.warehouse.dir": "/elsewhere"})
