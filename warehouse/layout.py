"""Where things live in a warehouse, and what the SQL views are called.

::

    <warehouse>/<topic>/_walbus_loads/              the load log: offsets of each load (JSON)
    <warehouse>/<topic>/_walbus_quarantine/         Delta: records skipped by --skip-invalid
    <warehouse>/<topic>/<schema>.<table>/history    Delta: every change, deduplicated, LSN order
    <warehouse>/<topic>/<schema>.<table>/current    Delta: one row per primary key (+ tombstones)

``<warehouse>`` is a local directory or any Hadoop filesystem URI (s3a://, hdfs://, abfss://).
Schema and table names keep letters, digits, ``_`` and ``-``; any other character (``.``
included) is written ``~XX`` (its UTF-8 bytes in hex), so every (schema, table) pair maps to
its own safe path segment, and the one literal ``.`` of a table's segment splits it back.

Views registered by ``walbus warehouse sql``, for a *plain* table (schema of letters and
digits, table of letters, digits and ``_`` not ending in ``_history`` or ``_all``):
``<schema>_<table>_history``, ``<schema>_<table>`` (live rows of the current table: no
tombstones, no ``_walbus_deleted``) and ``<schema>_<table>_all`` (the current table as
stored, tombstones included). Any other table's views are named by its event ``table``
field (:func:`walbus.contract.qualify_table`), used in backticks: `` `sales_eu.orders` ``,
`` `sales_eu.orders.history` ``, `` `sales_eu.orders.all` ``. A plain name has no dot, a
qualified name exactly one unquoted dot, a suffixed one two: distinct tables never share a
view name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Final

from walbus.contract import qualify_table

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_PLAIN_SCHEMA = re.compile(r"[A-Za-z0-9]+")
_PLAIN_TABLE = re.compile(r"[A-Za-z0-9_]+")

LOADS_DIR: Final = "_walbus_loads"
QUARANTINE_DIR: Final = "_walbus_quarantine"
STREAM_DIR: Final = "_walbus_stream"  # Spark checkpoint of `walbus warehouse stream`
QUARANTINE_VIEW: Final = "_walbus_quarantine"  # no table view: plain ones start alphanumeric, others hold a dot


def escape_segment(name: str) -> str:
    return "".join(c if _SAFE.fullmatch(c) else "".join(f"~{b:02X}" for b in c.encode()) for c in name)


def unescape_segment(segment: str) -> str:
    data = bytearray()
    i = 0
    while i < len(segment):
        if segment[i] == "~":
            data.append(int(segment[i + 1 : i + 3], 16))
            i += 3
        else:
            data.extend(segment[i].encode())
            i += 1
    return data.decode()


def absolute_root(warehouse: str) -> str:
    """A local warehouse path made absolute (a Hadoop URI, ``scheme:…``, as it is): Delta reads
    a relative path in ``delta.`…``` as a table of a schema named ``delta``."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", warehouse):
        return warehouse
    return os.path.abspath(warehouse)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def _is_plain(schema: str, table: str) -> bool:
    return bool(
        _PLAIN_SCHEMA.fullmatch(schema)
        and _PLAIN_TABLE.fullmatch(table)
        and not table.endswith(("_history", "_all"))
    )


@dataclass(frozen=True)
class TablePaths:
    schema: str
    table: str
    history: str
    current: str

    @property
    def view_base(self) -> str:
        """The live-rows view's name (see the module doc)."""
        if _is_plain(self.schema, self.table):
            return f"{self.schema}_{self.table}"
        return qualify_table(self.schema, self.table)

    def view(self, kind: str) -> str:
        """``kind`` "" (live rows), "all" or "history": the view's name, unquoted."""
        if not kind:
            return self.view_base
        separator = "_" if _is_plain(self.schema, self.table) else "."
        return f"{self.view_base}{separator}{kind}"


def topic_root(warehouse: str, topic: str) -> str:
    return join(warehouse, escape_segment(topic))


def loads_path(warehouse: str, topic: str) -> str:
    return join(topic_root(warehouse, topic), LOADS_DIR)


def stream_checkpoint_path(warehouse: str, topic: str) -> str:
    """The default checkpoint of ``walbus warehouse stream`` (Spark's offsets and commits)."""
    return join(topic_root(warehouse, topic), STREAM_DIR)


def quarantine_path(warehouse: str, topic: str) -> str:
    return join(topic_root(warehouse, topic), QUARANTINE_DIR)


def table_dir_name(schema: str, table: str) -> str:
    return f"{escape_segment(schema)}.{escape_segment(table)}"


def table_from_dir_name(segment: str) -> tuple[str, str] | None:
    """(schema, table) of a table's directory; None for any other directory."""
    if segment.count(".") != 1:
        return None
    schema, _, name = segment.partition(".")
    return unescape_segment(schema), unescape_segment(name)


def table_paths(warehouse: str, topic: str, schema: str, table: str) -> TablePaths:
    base = join(topic_root(warehouse, topic), table_dir_name(schema, table))
    return TablePaths(schema, table, join(base, "history"), join(base, "current"))
