"""Where things live in a warehouse, and what the SQL views are called.

::

    <warehouse>/<topic>/_walbus_loads/              the load log: offsets of each load (JSON)
    <warehouse>/<topic>/<schema>.<table>/history    Delta: every change, deduplicated, LSN order
    <warehouse>/<topic>/<schema>.<table>/current    Delta: one row per primary key (+ tombstones)

``<warehouse>`` is a local directory or any Hadoop filesystem URI (s3a://, hdfs://, abfss://).
Schema and table names keep letters, digits, ``_`` and ``-``; any other character is written
``~XX`` (its UTF-8 bytes in hex), so every PostgreSQL identifier maps to one safe path segment.

Views registered by ``walbus warehouse sql``: ``<schema>_<table>_history``,
``<schema>_<table>`` (live rows of the current table: no tombstones, no ``_walbus_deleted``)
and ``<schema>_<table>_all`` (the current table as stored, tombstones included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_VIEW_UNSAFE = re.compile(r"[^A-Za-z0-9_]")

LOADS_DIR = "_walbus_loads"


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


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


@dataclass(frozen=True)
class TablePaths:
    table: str  # "schema.table" as in the events
    history: str
    current: str

    @property
    def view_base(self) -> str:
        return _VIEW_UNSAFE.sub("_", self.table.replace(".", "_", 1))


def topic_root(warehouse: str, topic: str) -> str:
    return join(warehouse, escape_segment(topic))


def loads_path(warehouse: str, topic: str) -> str:
    return join(topic_root(warehouse, topic), LOADS_DIR)


def table_dir_name(table: str) -> str:
    schema, _, name = table.partition(".")
    return f"{escape_segment(schema)}.{escape_segment(name)}"


def table_from_dir_name(segment: str) -> str:
    schema, _, name = segment.partition(".")
    return f"{unescape_segment(schema)}.{unescape_segment(name)}"


def table_paths(warehouse: str, topic: str, table: str) -> TablePaths:
    base = join(topic_root(warehouse, topic), table_dir_name(table))
    return TablePaths(table, join(base, "history"), join(base, "current"))
