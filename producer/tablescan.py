"""Reading table rows the way the stream sees them: COPY text output, converted like pgoutput's.

Both snapshot kinds read rows here. ``COPY … TO STDOUT`` in text format hands over each
value's type output function text — exactly what pgoutput sends in its tuples — so the
same :func:`producer.codec.text_converter` gives identical JSON values, and COPY is the
fastest way PostgreSQL has to hand rows out (no per-row protocol overhead, bounded
memory: libpq returns one row per CopyData message, read in blocks of rows).

The column list mirrors pgoutput's Relation message: attnum order, no dropped and no
generated columns (pgoutput does not send those), so read events carry the same
``columns``/``types`` as the stream's inserts of the same table.
"""

from __future__ import annotations

import contextlib
import re
import select
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import psycopg
from psycopg import pq, sql

from producer.catalog import TYPE_NAME, TYPE_NAME_JOIN, type_modifiers, type_names_cte
from producer.codec import CaptureFilter, Relation
from walbus.contract import FLOAT_SPECIALS, FLOAT_TYPES, INT_TYPES

Conn = psycopg.Connection[tuple[object, ...]]

# COPY's text format escapes backslash, the delimiter and a few control characters; the
# output side produces nothing else (no octal or hex escapes), see CopyAttributeOutText.
_ESCAPES = {b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t", b"v": b"\v"}
_ESCAPE_RE = re.compile(rb"\\(.)", re.DOTALL)


def _unescape_match(m: re.Match[bytes]) -> bytes:
    c = m.group(1)
    return _ESCAPES.get(c, c)


def copy_field(raw: bytes) -> bytes | None:
    """One COPY text field: ``\\N`` is NULL, backslash escapes undone."""
    if raw == b"\\N":
        return None
    return _ESCAPE_RE.sub(_unescape_match, raw) if b"\\" in raw else raw


@dataclass
class ScanTable:
    """A captured table as the snapshot reads it."""

    relation: Relation
    kind: str  # pg_class.relkind
    sql_types: list[str]  # format_type(): with its modifier (a bare "character" is char(1)), for key literals
    estimated_rows: int = 0
    pages: int = 0  # heap pages when described
    oid: int = 0  # pg_class oid when described
    persistence: str = "p"  # pg_class.relpersistence: u(nlogged) and t(emp) tables' changes are never decoded

    @property
    def key_types(self) -> list[str]:
        """The primary key's columns with their types (``id integer``): the order of its values."""
        return [f"{c} {self.sql_types[i]}" for c, i in zip(self.relation.pk, self.relation.pk_index, strict=True)]

    @property
    def qualified(self) -> str:
        return self.relation.qualified

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(self.relation.schema, self.relation.name)

    def column_list(self) -> sql.Composed:
        return sql.SQL(", ").join(sql.Identifier(c) for c in self.relation.columns)

    def pk_list(self) -> sql.Composed:
        return sql.SQL(", ").join(sql.Identifier(c) for c in self.relation.pk)

    def key_literal(self, key_text: Sequence[str]) -> sql.Composed:
        """``(v1::type1, v2::type2)`` from the key's text output (typed: text order is not key order)."""
        types = [self.sql_types[i] for i in self.relation.pk_index]
        return sql.SQL("({})").format(
            sql.SQL(", ").join(sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(t)) for v, t in zip(key_text, types, strict=True))
        )


def describe_table(conn: Conn, schema: str, name: str, capture: CaptureFilter, relid: int) -> ScanTable | None:
    """The table's read layout, on ``conn`` (inside the snapshot transaction when there is one,
    so that it matches the rows read). None when the table does not exist."""
    row = conn.execute(
        "SELECT c.oid::int8, c.relkind::text, c.relreplident::text, greatest(c.reltuples, 0)::int8, "
        "(pg_relation_size(c.oid) / current_setting('block_size')::int8)::int8, c.relpersistence::text "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        (schema, name),
    ).fetchone()
    if row is None:
        return None
    oid, kind, replident, estimate, pages = int(str(row[0])), str(row[1]), str(row[2]), int(str(row[3])), int(str(row[4]))
    persistence = str(row[5])
    cols = conn.execute(
        f"WITH RECURSIVE {type_names_cte('SELECT DISTINCT atttypid FROM pg_attribute WHERE attrelid = %s')} "
        f"SELECT a.attname, {TYPE_NAME}, format_type(a.atttypid, a.atttypmod), a.atttypmod, a.attnotnull "
        f"FROM pg_attribute a JOIN type_names n ON n.oid = a.atttypid {TYPE_NAME_JOIN} "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' ORDER BY a.attnum",
        (oid, oid),
    ).fetchall()
    pk = [
        str(r[0])
        for r in conn.execute(
            "SELECT a.attname FROM pg_index i JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) ON true "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.ord",
            (oid,),
        ).fetchall()
    ]
    columns = [str(c[0]) for c in cols]
    types = [str(c[1]) for c in cols]
    # Read events carry no identity; flags only matter for deletes, which name the key.
    identity = [c in pk for c in columns]
    rel = Relation(
        relid, schema, name, columns, types, identity, pk, replident,
        not_null=[c[4] is True for c in cols], modifiers=[type_modifiers(t, int(str(c[3]))) for t, c in zip(types, cols, strict=True)],
    ).prepare(capture)
    return ScanTable(rel, kind, [str(c[2]) for c in cols], estimate, pages, oid, persistence)


def table_identity(conn: Conn, schema: str, name: str, key_columns: Sequence[str] | None = None) -> tuple[int, list[str]] | None:
    """The table's pg_class oid and its key's columns with their types, as
    :attr:`ScanTable.key_types` gives them; None when it does not exist. Takes no lock.

    The key is chosen as :meth:`Relation.prepare` chooses it: ``key_columns`` (``--key-columns``)
    when the table has them all, else the primary key. Compared with the primary key alone, a
    table keyed by other columns (or keyless) never matched its own description, and its
    incremental snapshot retried its first chunk for ever."""
    row = conn.execute(
        "SELECT c.oid::int8, array(SELECT format('%%s %%s', a.attname, format_type(a.atttypid, a.atttypmod)) "
        "FROM pg_index i JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) ON true "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
        "WHERE i.indrelid = c.oid AND i.indisprimary ORDER BY k.ord), "
        "array(SELECT format('%%s %%s', a.attname, format_type(a.atttypid, a.atttypmod)) "
        "FROM unnest(%s::text[]) WITH ORDINALITY AS k(name, ord) "
        "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = k.name "
        "AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' ORDER BY k.ord) "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        (list(key_columns or []), schema, name),
    ).fetchone()
    if row is None:
        return None
    named = [str(t) for t in cast("list[object]", row[2])]
    key = named if key_columns and len(named) == len(key_columns) else [str(t) for t in cast("list[object]", row[1])]
    return int(str(row[0])), key


def _str_float(text: str) -> float | str:
    return text if text in FLOAT_SPECIALS else float(text)


def _str_bool(text: str) -> bool:
    return text == "t"


def str_converters(types: Sequence[str]) -> list[Callable[[str], Any] | None]:
    """Per column, what turns a decoded text field into its JSON value (None: the text itself)."""
    out: list[Callable[[str], Any] | None] = []
    for t in types:
        if t in INT_TYPES:
            out.append(int)
        elif t in FLOAT_TYPES:
            out.append(_str_float)
        elif t == "bool":
            out.append(_str_bool)
        else:
            out.append(None)
    return out


def convert_line(line: bytes, converters: Sequence[Any], str_convs: Sequence[Callable[[str], Any] | None]) -> list[Any]:
    """A COPY text line as JSON-ready values — the initial snapshot's hot path: a row without
    a backslash (no NULL, no escape) is decoded once and split, and text columns cost nothing."""
    if b"\\" in line or (int in str_convs and not line.isascii()):
        # int() of a str takes any Unicode digit or space (int("\u0663") == 3), of bytes ASCII
        # only, as PostgreSQL writes an integer: convert_row reads such a line as a native
        # run's fallback does.
        return convert_row(line, converters)[0]
    try:
        return [f if c is None else c(f) for c, f in zip(str_convs, line[:-1].decode().split("\t"), strict=True)]
    except ValueError:
        # Text the converters refuse: convert_row decides, so the error is the same whichever
        # way the line came (a native run leaves such a line to convert_row).
        return convert_row(line, converters)[0]


def convert_row(line: bytes, converters: Sequence[Any]) -> tuple[list[Any], Sequence[bytes | None]]:
    """A COPY text line (with its newline) as JSON-ready values, and the raw fields."""
    raw = line[:-1].split(b"\t")
    if b"\\" not in line:
        # No backslash: no NULL and no escape anywhere in the row (the common case).
        return [conv(f) for conv, f in zip(converters, raw, strict=True)], raw
    fields = [copy_field(f) for f in raw]
    return [None if f is None else conv(f) for conv, f in zip(converters, fields, strict=True)], fields


def fetch_fields(conn: Conn, query: sql.Composed) -> list[list[bytes | None]]:
    """Every row of ``query`` as its raw text fields (each value's type output text, as COPY
    and pgoutput give it, unescaped; None for NULL).

    Sent with the extended protocol (libpq's PQexecParams, no parameters): a query holding
    SQL written by someone else (an ``additional-conditions`` filter) runs as one statement
    or fails to parse. The simple protocol — COPY always uses it, and psycopg does for a
    query without parameters — would run ``…; COMMIT; DROP …`` too.
    """
    res = conn.pgconn.exec_params(query.as_bytes(conn), [])
    if res.status != pq.ExecStatus.TUPLES_OK:
        _raise_for(conn, res)
    return [[res.get_value(r, c) for c in range(res.nfields)] for r in range(res.ntuples)]


def convert_fields(fields: Sequence[bytes | None], converters: Sequence[Any]) -> list[Any]:
    """Raw text fields (:func:`fetch_fields`) as JSON-ready values."""
    return [None if f is None else conv(f) for conv, f in zip(converters, fields, strict=True)]


def copy_table_blocks(
    conn: Conn, table: ScanTable, pages: tuple[int, int | None] | None = None, block_rows: int = 4096,
    stop: threading.Event | None = None,
) -> Iterator[list[bytes]]:
    """Every row of a table as COPY text lines (each with its newline), in blocks of at most
    ``block_rows``: in storage order (COPY of a plain table skips the executor), or of the
    heap pages ``[first, end)`` only (a TID range scan: one table read by several
    connections; ``end`` None: to the last page)."""
    if pages is not None:
        lo, hi = pages
        cond = sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({lo},0)"))
        if hi is not None:
            cond = sql.SQL("{} AND ctid < {}::tid").format(cond, sql.Literal(f"({hi},0)"))
        statement = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT").format(table.column_list(), table.ident, cond)
    elif table.kind == "r":
        statement = sql.SQL("COPY {} ({}) TO STDOUT").format(table.ident, table.column_list())
    else:
        statement = sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT").format(table.column_list(), table.ident)
    return copy_out_blocks(conn, statement.as_bytes(conn), block_rows, stop)


class CopyStopped(Exception):
    """``stop`` was set while a COPY waited for the server; the COPY was cancelled."""


# How often a COPY waiting for the server looks at its ``stop`` (a lock wait, a stalled server).
STOP_CHECK_S = 0.5


def _raise_for(conn: Conn, res: pq.abc.PGresult) -> NoReturn:
    if not res.error_field(pq.DiagnosticField.SQLSTATE):  # no server error: the connection failed
        raise psycopg.OperationalError(res.get_error_message(conn.info.encoding) or conn.pgconn.error_message.decode(errors="replace"))
    raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)


def _wait_readable(conn: Conn, stop: threading.Event | None) -> None:
    """Until the connection has input (without the GIL); cancels the statement and raises
    :class:`CopyStopped` once ``stop`` is set."""
    while not select.select([conn.pgconn.socket], [], [], STOP_CHECK_S)[0]:
        if stop is not None and stop.is_set():
            try:
                conn.cancel_safe(timeout=5.0)
            except psycopg.Error:
                pass  # the caller closes the connection, which ends the statement too
            else:
                _drain(conn.pgconn)  # cancelled: the server ends the statement at once
            raise CopyStopped("stopped while the COPY waited for the server")


def _drain(pgconn: Any) -> None:
    """Read a cancelled statement's rest, so the connection takes the next one."""
    with contextlib.suppress(psycopg.Error):
        while (res := pgconn.get_result()) is not None:
            if res.status == pq.ExecStatus.COPY_OUT:
                while pgconn.get_copy_data(0)[0] >= 0:
                    pass


def copy_out_blocks(
    conn: Conn, statement: bytes, block_rows: int, stop: threading.Event | None = None,
) -> Iterator[list[bytes]]:
    """The lines of a ``COPY … TO STDOUT``, straight from libpq: every line already in its
    buffer is taken without a wait (psycopg's ``Copy.read()`` runs its wait machinery once
    a row, the snapshot's largest cost), and a block goes out before each wait for the
    network, so a slow server never holds back lines already read.

    ``stop`` set while it waits for the server (a table lock, a stalled server) cancels the
    COPY and raises :class:`CopyStopped`: a producer asked to stop is not held by a wait
    that may never end."""
    pgconn = conn.pgconn
    pgconn.send_query(statement)  # COPY always uses the simple protocol; ``statement`` is ours
    while pgconn.is_busy():  # before its first row a COPY may wait long: on a lock
        _wait_readable(conn, stop)
        pgconn.consume_input()
    res = pgconn.get_result()
    if res is None or res.status != pq.ExecStatus.COPY_OUT:
        if res is None:
            raise psycopg.OperationalError("COPY returned no result")
        while pgconn.get_result() is not None:  # the rest, or libpq stays busy
            pass
        _raise_for(conn, res)
    block: list[bytes] = []
    get = pgconn.get_copy_data
    while True:
        nbytes, data = get(1)  # 1: never blocks; -2 (a broken connection) raises
        if nbytes > 0:
            block.append(bytes(data))
            if len(block) >= block_rows:
                yield block
                block = []
        elif nbytes == 0:  # no whole line buffered: hand over what there is, wait (without the GIL)
            if block:
                yield block
                block = []
            _wait_readable(conn, stop)
            pgconn.consume_input()
        else:  # -1: the COPY is over, its outcome follows
            break
    if block:
        yield block
    failed = None
    while (end := pgconn.get_result()) is not None:  # every result, or libpq stays busy
        if end.status != pq.ExecStatus.COMMAND_OK and failed is None:
            failed = end
    if failed is not None:
        _raise_for(conn, failed)


def key_text(fields: Sequence[bytes | None], table: ScanTable) -> list[str]:
    """The primary key's text output from a row's raw fields (None never: keys are NOT NULL)."""
    return [(fields[i] or b"").decode() for i in table.relation.pk_index]


def _filtered(cond: list[sql.Composable], where: str | None) -> sql.Composed:
    if where:
        # Parenthesised: ``a OR b`` must not escape the key bounds.
        cond = [*cond, sql.SQL("({})").format(sql.SQL(where))]
    return sql.SQL(" AND ").join(cond)


def select_chunk(
    table: ScanTable, after: Sequence[str] | None, upto: Sequence[str], limit: int, where: str | None = None,
) -> sql.Composed:
    """The next chunk of an incremental snapshot: keys in (after, upto], key order, ``limit``
    rows, only those ``where`` (an ``additional-conditions`` filter, SQL) holds for."""
    cond: list[sql.Composable] = [sql.SQL("({}) <= {}").format(table.pk_list(), table.key_literal(upto))]
    if after is not None:
        cond.append(sql.SQL("({}) > {}").format(table.pk_list(), table.key_literal(after)))
    return sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT {}").format(
        table.column_list(), table.ident, _filtered(cond, where), table.pk_list(), sql.Literal(limit)
    )


def nullable_key_columns(table: ScanTable) -> list[str]:
    """The key's columns without NOT NULL (describe_table says): ``--key-columns`` may name
    such, a primary key has none."""
    rel = table.relation
    return [rel.columns[i] for i in rel.pk_index if i < len(rel.not_null) and not rel.not_null[i]]


def null_key_query(table: ScanTable, where: str | None = None) -> sql.Composed | None:
    """A row (of those ``where`` holds for) whose key holds a NULL; None when no key column
    can. Such a row cannot be chunked: a row comparison with NULL is never true, and in
    ``ORDER BY … DESC`` NULL comes first (it was the "largest key")."""
    nullable = nullable_key_columns(table)
    if not nullable:
        return None
    nulls = sql.SQL(" OR ").join(sql.SQL("{}.{} IS NULL").format(table.ident, sql.Identifier(c)) for c in nullable)
    return sql.SQL("SELECT 1 FROM {} WHERE {} LIMIT 1").format(table.ident, _filtered([sql.SQL("({})").format(nulls)], where))


def key_unique_indexed(conn: Conn, table: ScanTable) -> bool:
    """Whether a unique index (whole, on columns) of the table has only key columns as its keys:
    then no two rows share a key (NULLs aside: :func:`null_key_query`)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = %s AND i.indisunique AND i.indpred IS NULL "
        "AND i.indexprs IS NULL AND NOT EXISTS (SELECT 1 FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) k(attnum) "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum WHERE a.attname <> ALL(%s::text[])))",
        (table.oid, list(table.relation.pk)),
    ).fetchone()
    return bool(row and row[0])


def duplicate_key_query(table: ScanTable, where: str | None = None) -> sql.Composed:
    """A key two rows (of those ``where`` holds for) share: ``--key-columns`` need not be
    unique, and chunks go on after the last key read, so the other rows of a chunk's last key
    would never be read."""
    return sql.SQL("SELECT 1 FROM {} WHERE {} GROUP BY {} HAVING count(*) > 1 LIMIT 1").format(
        table.ident, _filtered([sql.SQL("true")], where),
        sql.SQL(", ").join(sql.SQL("{}.{}").format(table.ident, sql.Identifier(c)) for c in table.relation.pk),
    )


def max_key_query(table: ScanTable, where: str | None = None) -> sql.Composed:
    """The largest primary key now (text output) of the rows ``where`` holds for; no row when
    there is none. Run it with :func:`fetch_fields`: ``where`` may be anyone's SQL."""
    # Qualified in ORDER BY: a bare name would mean the ::text output column, sorted as text.
    # No alias: a filter may name the table as select_chunk's query does.
    cols = [sql.SQL("{}.{}").format(table.ident, sql.Identifier(c)) for c in table.relation.pk]
    # A NULL key (--key-columns) sorts first in DESC and is no bound: rows holding one are left
    # to null_key_query's check, made before.
    cond: list[sql.Composable] = [sql.SQL("true")]
    cond += [sql.SQL("{}.{} IS NOT NULL").format(table.ident, sql.Identifier(c)) for c in nullable_key_columns(table)]
    return sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT 1").format(
        sql.SQL(", ").join(sql.SQL("{}::text").format(c) for c in cols),
        table.ident,
        _filtered(cond, where),
        sql.SQL(", ").join(sql.SQL("{} DESC").format(c) for c in cols),
    )
