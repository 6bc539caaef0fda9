"""Type names and keys from the system catalogs, through a normal (second) connection.

The replication connection cannot run SQL while it streams, so the decoders ask
this cache; it queries PostgreSQL only on a miss (a new relation, a changed
schema, a type created after start).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Final, Protocol

import psycopg

from producer.session import session_options
from walbus.contract import qualify_table

log = logging.getLogger("walbus.producer.catalog")


@dataclass(frozen=True)
class TableInfo:
    schema: str
    name: str
    columns: tuple[str, ...]
    type_oids: tuple[int, ...]
    pk: tuple[str, ...]
    replident: str  # d f n i
    identity: tuple[str, ...]  # the replica identity's columns (pk, index, all or none)
    typmods: tuple[int, ...] = ()  # pg_attribute.atttypmod per column (-1: none)
    not_null: tuple[str, ...] = ()  # the columns with pg_attribute.attnotnull
    # Generated (STORED) columns: not among ``columns``. pgoutput and the snapshots leave them
    # out; wal2json sends them, and its decoder drops them (a types fuzz).
    generated: tuple[str, ...] = ()
    kind: str = "r"  # pg_class.relkind: p(artitioned) tables have no rows of their own


# The types whose modifier an event carries (``typmods``, docs/contract.md), as SQL writes it.
# Others (interval's fields, extension types) have none there: their typmod means what the
# type's own typmodout says, which a consumer could not read.
_LENGTH_TYPES: Final = frozenset({"varchar", "bpchar"})  # typmod = length + 4 (VARHDRSZ)
_PLAIN_TYPES: Final = frozenset({"bit", "varbit", "time", "timetz", "timestamp", "timestamptz"})
_MODIFIED_TYPES: Final = _LENGTH_TYPES | _PLAIN_TYPES | {"numeric", "interval"}
_INTERVAL_FULL_PRECISION: Final = 0xFFFF
_MODIFIER_TEXT = re.compile(r"\((-?\d+)(?:,(-?\d+))?\)")


# Each type oid with the name walbus gives it: its own, or for a domain (over domains too) its
# base type's. pgoutput's Relation message names a domain column by its base type
# (getBaseType); snapshot rows and wal2json's changes, which name the domain, say the same, so
# a column has one type and one JSON value whatever wrote the event (an int domain's values
# are JSON integers, its key the same in a compacted topic).
def type_names_cte(seed: str) -> str:
    """``type_names(oid, base)``, for a RECURSIVE WITH, of the type oids ``seed`` selects:
    join it with :data:`TYPE_NAME_JOIN` for the name of each."""
    return (
        f"type_names(oid, base) AS (SELECT s.oid, s.oid FROM ({seed}) s(oid) UNION ALL "
        "SELECT n.oid, t.typbasetype FROM type_names n JOIN pg_type t ON t.oid = n.base AND t.typtype = 'd')"
    )


# joins type_names n: the row of pg_type t that names n.oid
TYPE_NAME_JOIN: Final = "JOIN pg_type t ON t.oid = n.base AND t.typtype <> 'd'"

# The name walbus gives the type t (of TYPE_NAME_JOIN): its typname, or ``schema.name`` (parts
# quoted as the event's ``table`` field quotes them: walbus.contract.qualify_table) for a type
# outside pg_catalog that has a built-in type's name. Values are converted by type name (int4
# → JSON integer…): an enum s.int4 went through int() and stopped the producer, and a consumer
# could not tell it from the built-in either.
_QUOTED_PART = "CASE WHEN {0} ~ '[.\"]' THEN '\"' || replace({0}, '\"', '\"\"') || '\"' ELSE {0}::text END"
TYPE_NAME: Final = (
    "CASE WHEN t.typnamespace <> 'pg_catalog'::regnamespace AND EXISTS (SELECT 1 FROM pg_type b "
    "WHERE b.typnamespace = 'pg_catalog'::regnamespace AND b.typname = t.typname) THEN "
    + _QUOTED_PART.format("(SELECT nspname FROM pg_namespace WHERE oid = t.typnamespace)")
    + " || '.' || " + _QUOTED_PART.format("t.typname") + " ELSE t.typname::text END"
)


def qualified_type_name(schema: str, name: str, builtin_names: frozenset[str]) -> str:
    """:data:`TYPE_NAME` of a type known by its schema and name (pgoutput's Type message,
    which names pg_catalog by an empty string)."""
    if schema in ("", "pg_catalog") or name not in builtin_names:
        return name
    return qualify_table(schema, name)


def _base(typname: str) -> str:
    return typname[1:] if typname.startswith("_") else typname  # an array: its element's modifier


def type_modifiers(typname: str, typmod: int) -> list[int] | None:
    """The modifier of a column of ``typname`` (``pg_type.typname``) from its atttypmod."""
    if typmod < 0:
        return None
    base = _base(typname)
    if base == "numeric":
        packed = typmod - 4
        scale = ((packed & 0x7FF) ^ 1024) - 1024  # 11 bits, signed since PostgreSQL 15
        return [(packed >> 16) & 0xFFFF, scale]
    if base in _LENGTH_TYPES:
        return [typmod - 4]
    if base in _PLAIN_TYPES:
        return [typmod]
    if base == "interval":
        precision = typmod & 0xFFFF
        return None if precision == _INTERVAL_FULL_PRECISION else [precision]
    return None


def modifiers_from_text(typname: str, declared: str | None) -> list[int] | None:
    """The same from ``format_type``'s text (``numeric(12,2)``, ``timestamp(3) without time
    zone``, ``interval day to second(3)``), as wal2json writes a column's type."""
    base = _base(typname)
    if declared is None or base not in _MODIFIED_TYPES:
        return None
    m = _MODIFIER_TEXT.search(declared)
    if m is None:
        return None
    return [int(g) for g in m.groups() if g is not None]


class CatalogLookup(Protocol):
    """What the decoders need to know of the catalog."""

    def typname(self, oid: int) -> str: ...

    def table(self, schema: str, name: str, relid: int | None = None) -> TableInfo:
        """The table as the catalog has it now: by ``relid`` (its oid: it survives a rename)
        when given, else by name. :class:`TableGone` when it is not there."""
        ...

    def remember_type(self, oid: int, schema: str, name: str) -> None: ...


class UnknownTypeError(LookupError):
    pass


class TableGone(LookupError):
    """A table a change names is not in the catalog (any more): renamed or dropped since the
    change was written, while the producer lagged behind. The decoders then describe it from
    the change itself (see each decoder), never stop on it."""


# A miss is asked again after these pauses: the walsender may decode a commit a moment before
# the transaction is visible to other sessions (a table created in it is not there yet).
TABLE_RETRY_S: Final = (0.01, 0.05, 0.2)


class Catalog:
    """A :class:`CatalogLookup` over a psycopg connection, cached."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._types: dict[int, str] = {}
        self._fixed: frozenset[str] | None = None
        self._builtin_names: frozenset[str] | None = None
        self._tables: dict[tuple[str, str], TableInfo] = {}

    def _connection(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._dsn, autocommit=True, application_name="walbus-catalog", options=session_options(self._dsn))
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def load_types(self) -> None:
        rows = self._connection().execute(
            f"WITH RECURSIVE {type_names_cte('SELECT oid FROM pg_type')} "
            f"SELECT n.oid::int8, {TYPE_NAME} FROM type_names n {TYPE_NAME_JOIN}"
        ).fetchall()
        self._types = {int(str(oid)): str(name) for oid, name in rows}
        self._builtin_names = frozenset(str(r[0]) for r in self._connection().execute(
            "SELECT typname FROM pg_type WHERE typnamespace = 'pg_catalog'::regnamespace"
        ).fetchall())
        # (a name is fixed only when every type of that name is: one schema's may be varlena)
        fixed = self._connection().execute(
            "SELECT typname FROM pg_type WHERE typtype <> 'd' GROUP BY typname "
            "HAVING bool_and(typlen > 0 OR typstorage = 'p')"
        ).fetchall()
        self._fixed = frozenset(str(r[0]) for r in fixed)

    def fixed_length_types(self) -> frozenset[str]:
        """The type names whose values PostgreSQL never TOASTs (fixed length, or plain
        storage): a column of one is never left out of an update as an unchanged TOAST value."""
        if self._fixed is None:
            self.load_types()
        assert self._fixed is not None
        return self._fixed

    def typname(self, oid: int) -> str:
        name = self._types.get(oid)
        if name is None:
            self.load_types()
            name = self._types.get(oid)
            if name is None:
                raise UnknownTypeError(f"type oid {oid} is not in pg_type")
        return name

    def remember_type(self, oid: int, schema: str, name: str) -> None:
        if self._builtin_names is None:
            self.load_types()
        assert self._builtin_names is not None
        self._types[oid] = qualified_type_name(schema, name, self._builtin_names)

    def invalidate(self, schema: str, name: str) -> None:
        self._tables.pop((schema, name), None)

    def table(self, schema: str, name: str, relid: int | None = None) -> TableInfo:
        info = self._tables.get((schema, name))
        if info is None:
            for pause in (*TABLE_RETRY_S, None):
                row = self._find_table(schema, name, relid)
                if row is not None or pause is None:
                    break
                time.sleep(pause)
            if row is None:
                raise TableGone(f"table {schema}.{name} is not in the catalog (renamed or dropped since)")
            info = self._query_table(schema, name, *row)
            self._tables[(schema, name)] = info
        return info

    def _find_table(self, schema: str, name: str, relid: int | None) -> tuple[int, str, str] | None:
        """(oid, relreplident, relkind) of the table, by oid when given, else by name."""
        conn = self._connection()
        if relid is not None:
            found = conn.execute(
                "SELECT oid::int8, relreplident::text, relkind::text FROM pg_class WHERE oid = %s::int8::oid", (relid,)
            ).fetchone()
        else:
            found = conn.execute(
                "SELECT c.oid::int8, c.relreplident::text, c.relkind::text FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s",
                (schema, name),
            ).fetchone()
        return None if found is None else (int(str(found[0])), str(found[1]), str(found[2]))

    def _query_table(self, schema: str, name: str, relid: int, replident: str, kind: str) -> TableInfo:
        conn = self._connection()
        every = conn.execute(
            "SELECT attname, atttypid::int8, atttypmod, attnotnull, attgenerated <> '' FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (relid,),
        ).fetchall()
        cols = [c for c in every if c[4] is not True]
        pk = self._index_columns(conn, relid, "indisprimary")
        if replident == "d":
            identity = pk
        elif replident == "i":
            identity = self._index_columns(conn, relid, "indisreplident")
        elif replident == "f":
            identity = tuple(str(c[0]) for c in cols)
        else:
            identity = ()
        return TableInfo(
            schema, name, tuple(str(c[0]) for c in cols), tuple(int(str(c[1])) for c in cols), pk, replident, identity,
            tuple(int(str(c[2])) for c in cols), tuple(str(c[0]) for c in cols if c[3] is True),
            tuple(str(c[0]) for c in every if c[4] is True), kind,
        )

    @staticmethod
    def _index_columns(conn: psycopg.Connection[tuple[object, ...]], relid: int, which: str) -> tuple[str, ...]:
        rows = conn.execute(
            "SELECT a.attname FROM pg_index i "
            "JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) ON true "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            f"WHERE i.indrelid = %s AND i.{which} ORDER BY k.ord",
            (relid,),
        ).fetchall()
        return tuple(str(r[0]) for r in rows)
