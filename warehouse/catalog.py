"""Each table's history and current Delta tables as external tables of a Spark catalog database.

With ``--catalog-database DB`` a load registers ``DB.<name>_history`` and ``DB.<name>_current``
(``CREATE TABLE IF NOT EXISTS … USING DELTA LOCATION …``; the data stay where they are), so
``spark.table("DB.public_orders_current")`` and ``walbus warehouse sql`` use names, not paths.

The session uses Spark's Hive catalog. Unless the Spark settings name a metastore of their own
(``spark.hadoop.hive.metastore.uris`` or a JDBC ``javax.jdo.option.ConnectionURL``), a local
warehouse keeps an embedded Derby metastore in ``<warehouse>/_walbus.catalog``: its files
(``metastore_db``, ``derby.log``) never land in the working directory. No escaped topic holds
a ``.``, so that directory is never taken for a topic's.

Names (one rule; Hive keeps ``[a-z0-9_]`` only, case-folded): a table whose schema is
``[a-z0-9]+`` and whose name is ``[a-z0-9_]+`` is ``<schema>_<table>``; any other is ``_``,
the schema, ``__``, the table, each with every character but ``[a-z0-9]`` written as ``_``
and two lowercase hex digits per UTF-8 byte (``"Sales"."Order Items"`` is
``__53ales___4frder_20_49tems``); then ``_history`` or ``_current``. Distinct tables get
distinct names; a name over 128 characters keeps its first 103 and a hash of the rest.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from typing import Final

from pyspark.sql import SparkSession

from warehouse import layout
from warehouse.schema import quote

CATALOG_DIR: Final = "_walbus.catalog"
KINDS: Final = ("history", "current")
MAX_NAME: Final = 128

_PLAIN_SCHEMA = re.compile(r"[a-z0-9]+")
_PLAIN_TABLE = re.compile(r"[a-z0-9_]+")
_KEPT = re.compile(r"[a-z0-9]")
_DATABASE = re.compile(r"[a-z0-9_]+")


class CatalogError(Exception):
    """The catalog holds another table under a name this warehouse needs."""


def _hex(name: str) -> str:
    return "".join(c if _KEPT.fullmatch(c) else "".join(f"_{b:02x}" for b in c.encode()) for c in name)


def table_name(schema: str, table: str, kind: str) -> str:
    """The catalog name of a table's ``history`` or ``current`` Delta table (module doc)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    if _PLAIN_SCHEMA.fullmatch(schema) and _PLAIN_TABLE.fullmatch(table):
        base = f"{schema}_{table}"
    else:
        base = f"_{_hex(schema)}__{_hex(table)}"
    room = MAX_NAME - len("_current")
    if len(base) > room:
        digest = hashlib.sha256(base.encode()).hexdigest()[:16]
        base = f"{base[: room - 17]}_{digest}"
    return f"{base}_{kind}"


def check_database(name: str) -> str:
    """``name`` if Hive keeps it as it is (lowercase letters, digits, ``_``); else ValueError."""
    if not _DATABASE.fullmatch(name):
        raise ValueError(f"--catalog-database: {name!r} must be lowercase letters, digits and _")
    return name


def _is_local(warehouse: str) -> bool:
    return "://" not in warehouse or warehouse.startswith("file:")


def session_conf(warehouse: str, conf: Mapping[str, str]) -> dict[str, str]:
    """Spark settings of a session that uses the catalog, to apply over the user's ``conf``
    (whose own metastore and warehouse directory stand)."""
    settings = {"spark.sql.catalogImplementation": "hive"}
    own_metastore = any(
        k in conf for k in ("spark.hadoop.hive.metastore.uris", "spark.hadoop.javax.jdo.option.ConnectionURL")
    )
    if own_metastore or not _is_local(warehouse):
        return settings
    home = os.path.abspath(layout.join(warehouse.removeprefix("file:"), CATALOG_DIR))
    if "spark.sql.warehouse.dir" not in conf:
        settings["spark.sql.warehouse.dir"] = f"file:{home}/warehouse"
    settings["spark.hadoop.javax.jdo.option.ConnectionURL"] = (
        f"jdbc:derby:;databaseName={home}/metastore_db;create=true"
    )
    # derby.log goes to derby.system.home (default: the working directory)
    options = conf.get("spark.driver.extraJavaOptions", "")
    settings["spark.driver.extraJavaOptions"] = f"{options} -Dderby.system.home={home}".strip()
    return settings


def _location(spark: SparkSession, name: str) -> str:
    row = spark.sql(f"DESCRIBE DETAIL {name}").first()
    return str(row["location"]) if row is not None else ""


def _same_place(a: str, b: str) -> bool:
    def norm(p: str) -> str:
        return re.sub(r"^file:(//)?", "", p).rstrip("/")

    return norm(a) == norm(b)


def register(spark: SparkSession, database: str, paths: layout.TablePaths, kinds: tuple[str, ...]) -> list[str]:
    """Register ``paths``' Delta tables of ``kinds`` in ``database``: their qualified names.

    An existing name is kept when it points at the same location; one pointing elsewhere
    (another topic's table of the same name, another warehouse) is a :class:`CatalogError`.
    """
    spark.sql(f"CREATE DATABASE IF NOT EXISTS {quote(database)}")
    names = []
    for kind in kinds:
        location = paths.history if kind == "history" else paths.current
        if _is_local(location):  # a relative LOCATION would not be the same place for every reader
            location = os.path.abspath(location.removeprefix("file:"))
        name = f"{quote(database)}.{quote(table_name(paths.schema, paths.table, kind))}"
        location_sql = location.replace("\\", "\\\\").replace("'", "\\'")
        spark.sql(f"CREATE TABLE IF NOT EXISTS {name} USING DELTA LOCATION '{location_sql}'")
        stored = _location(spark, name)
        if not _same_place(stored, location):
            raise CatalogError(
                f"catalog table {name} is {stored}, not {location}: "
                "one --catalog-database per topic and warehouse"
            )
        names.append(name)
    return names
