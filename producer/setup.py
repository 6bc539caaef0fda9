"""Checks and set-up before streaming: server settings, privileges, tables, publication, slot.

Everything here is a configuration matter: failures raise ConfigError with what to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from producer.codec import CaptureFilter
from producer.replication import quote_ident
from producer.session import session_options
from walbus.config import ConfigError, split_unquoted
from walbus.contract import ContractError, qualify_table, split_pattern, split_table
from walbus.logs import redact_dsn

TableName = tuple[str, str]  # (schema, table), exactly as PostgreSQL spells them
WILDCARDS = "*?["

log = logging.getLogger("walbus.producer.setup")


@dataclass(frozen=True)
class SlotState:
    exists: bool
    plugin: str | None = None
    confirmed_flush_lsn: int = 0
    active_pid: int | None = None
    # wal_status 'lost': the WAL from its position on is gone (max_slot_wal_keep_size); it cannot stream.
    lost: bool = False


def connect(dsn: str, application_name: str = "walbus-setup") -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10, application_name=application_name, options=session_options(dsn))
    except psycopg.OperationalError as e:
        raise ConfigError(f"cannot connect to PostgreSQL at {redact_dsn(dsn)}: {str(e).strip()}") from None


def check_server(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    row = conn.execute("SHOW wal_level").fetchone()
    if row is None or row[0] != "logical":
        raise ConfigError(
            f"wal_level is {row[0] if row else '?'!s}, logical decoding needs wal_level = logical "
            "(set it in postgresql.conf and restart PostgreSQL)"
        )
    row = conn.execute("SELECT rolsuper OR rolreplication FROM pg_roles WHERE rolname = current_user").fetchone()
    if not (row and row[0]):
        raise ConfigError("the PostgreSQL user lacks the REPLICATION privilege: ALTER ROLE … WITH REPLICATION")


def check_select(conn: psycopg.Connection[tuple[object, ...]], tables: list[TableName], *, partitioned: bool) -> None:
    """ConfigError naming the GRANT when the role may not read every column the initial
    snapshot copies of ``tables`` (a partitioned table counts only with ``partitioned``: read
    as itself). Checked before the slot is created: the COPY failed with a traceback and left
    a new slot holding WAL, at every restart (a fuzz). pgoutput needs no SELECT right to stream."""
    if not tables:
        return
    rows = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = ANY(%s::regclass[]) AND (c.relkind = 'r' OR %s) AND NOT has_table_privilege(c.oid, 'SELECT') "
        "AND (NOT has_any_column_privilege(c.oid, 'SELECT') OR EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = c.oid "
        "AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' AND NOT has_column_privilege(c.oid, a.attnum, 'SELECT'))) "
        "ORDER BY 1, 2",
        ([sql_table(t) for t in tables], partitioned),
    ).fetchall()
    if rows:
        unreadable = [(str(r[0]), str(r[1])) for r in rows]
        user = conn.execute("SELECT current_user::text").fetchone()
        role = quote_ident(str(user[0])) if user else "…"
        raise ConfigError(
            f"the PostgreSQL user may not read {', '.join(qualify_table(*t) for t in unreadable)}, which the initial snapshot "
            f"reads: GRANT SELECT ON {', '.join(sql_table(t) for t in unreadable)} TO {role} (or leave the tables out with "
            "--exclude-tables, or stream without reading the tables: --snapshot-mode no_data)"
        )


def check_encoding(conn: psycopg.Connection[tuple[object, ...]], plugin: str) -> None:
    """The producer reads text as UTF-8: the server converts it for the client (the snapshots,
    pgoutput), but wal2json writes the database's own encoding whatever the client asks."""
    row = conn.execute("SELECT current_setting('client_encoding'), current_setting('server_encoding')").fetchone()
    client, server = (str(row[0]), str(row[1])) if row else ("?", "?")
    if client != "UTF8":
        raise ConfigError(
            f"client_encoding is {client} (the DSN's client_encoding or PGCLIENTENCODING): the producer reads UTF8, "
            "leave the setting out"
        )
    if plugin == "wal2json" and server not in ("UTF8", "SQL_ASCII"):
        raise ConfigError(
            f"the database's encoding is {server}: wal2json writes its changes in it, not in UTF8; use --plugin pgoutput"
        )


def table_pattern(pattern: str, flag: str, *, exact: bool = True) -> str:
    """A ``--tables``-style entry (walbus's table patterns, docs/contract.md). With ``exact``
    (an include list) an entry without wildcards names one existing table:
    ``schema.table`` in the form events name tables (``public."a.b"``). Otherwise it may name
    last parts too (``--exclude-tables orders``: the table in any schema), as the contract says."""
    try:
        if not exact or any(ch in pattern for ch in WILDCARDS):
            split_pattern(pattern, 2)
            return pattern
        return qualify_table(*split_table(pattern))
    except ContractError as e:
        raise ConfigError(f"{flag}: {e} (write schema.table; a name with a dot or quote in double quotes: public.\"a.b\")") from None


def table_name(text: str, flag: str) -> str:
    """One table, named exactly (the signal table): ``schema.table`` as events name it, ``*``,
    ``?`` and ``[`` being part of the name. As a pattern, ``public."sig*"`` stayed quoted, text
    no event's ``table`` (``public.sig*``) equals: the producer started and took no signal."""
    try:
        return qualify_table(*split_table(text))
    except ContractError as e:
        raise ConfigError(f"{flag}: {e} (write schema.table; a name with a dot or quote in double quotes: public.\"a.b\")") from None


def check_signal_table(conn: psycopg.Connection[tuple[object, ...]], table: TableName, *, via_root: bool) -> None:
    """A partitioned signal table's rows are decoded under their partitions' names (wal2json;
    pgoutput unless the publication has publish_via_partition_root), never the name signals
    are recognised by: the producer started and passed over every signal, without a word."""
    row = conn.execute(
        "SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        table,
    ).fetchone()
    if row is not None and str(row[0]) == "p" and not via_root:
        raise ConfigError(
            f"signal table {qualify_table(*table)} is partitioned: its rows are decoded under its partitions' names, so no "
            "signal would be seen. Use a plain table (or, with pgoutput, a publication WITH (publish_via_partition_root = true))"
        )


def table_patterns(patterns: Sequence[str], flag: str, *, exact: bool = True) -> tuple[str, ...]:
    return tuple(table_pattern(p, flag, exact=exact) for p in patterns)


def column_patterns(patterns: Sequence[str], flag: str) -> tuple[str, ...]:
    """``--exclude-columns``/``--mask-columns`` entries: ``schema.table.column`` or its last parts."""
    try:
        return tuple(p for p in patterns if split_pattern(p, 3))
    except ContractError as e:
        raise ConfigError(f"{flag}: {e}") from None




def key_column_rules(text: str | None, flag: str = "--key-columns") -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Debezium's ``message.key.columns``: ``table:col,col;table:col``. Tables are table patterns
    (docs/contract.md), columns exact names; a name holding ``.``, ``"``, ``,``, ``:`` or ``;`` is
    written in double quotes."""
    rules: list[tuple[str, tuple[str, ...]]] = []
    for entry in split_unquoted(text or "", ";"):
        if not entry.strip():
            continue
        table_cols = split_unquoted(entry, ":")
        if len(table_cols) != 2:
            raise ConfigError(f"{flag}: {entry.strip()!r} is not schema.table:column,column")
        table = table_pattern(table_cols[0].strip(), flag)
        try:
            cols = tuple(split_pattern(c.strip(), 1)[0] for c in split_unquoted(table_cols[1], ","))
        except ContractError as e:
            raise ConfigError(f"{flag}: {entry.strip()!r}: {e}") from None
        if len(set(cols)) != len(cols):
            raise ConfigError(f"{flag}: {entry.strip()!r} names a column twice")
        rules.append((table, cols))
    return tuple(rules)


def table_columns(conn: psycopg.Connection[tuple[object, ...]], table: TableName) -> list[str]:
    rows = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (sql_table(table),),
    ).fetchall()
    return [str(r[0]) for r in rows]


def identity_columns(conn: psycopg.Connection[tuple[object, ...]], table: TableName) -> list[str]:
    """The columns the table's replica identity sends as the old row (all of them under FULL)."""
    row = conn.execute(
        "SELECT c.relreplident::text, ARRAY(SELECT a.attname::text FROM pg_index i JOIN pg_attribute a "
        "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) WHERE i.indrelid = c.oid AND "
        "CASE c.relreplident WHEN 'd' THEN i.indisprimary AND i.indimmediate WHEN 'i' THEN i.indisreplident ELSE false END) "
        "FROM pg_class c WHERE c.oid = %s::regclass",
        (sql_table(table),),
    ).fetchone()
    if row is None:
        return []
    if row[0] == "f":
        return table_columns(conn, table)
    return [str(c) for c in row[1]]  # type: ignore[attr-defined]


def check_key_columns(conn: psycopg.Connection[tuple[object, ...]], capture: CaptureFilter, tables: list[TableName]) -> None:
    """Every captured table a ``--key-columns`` rule names has those columns, in its events
    (neither excluded nor masked); an exact table name that does not exist is only warned about."""
    for schema, name in tables:
        key = capture.key_for(schema, name)
        if key is None:
            check_primary_key_shown(conn, capture, (schema, name))
            continue
        columns = set(table_columns(conn, (schema, name)))
        qualified = qualify_table(schema, name)
        missing = [c for c in key if c not in columns]
        if missing:
            raise ConfigError(f"--key-columns: table {qualified} has no column {', '.join(repr(c) for c in missing)}")
        hidden = [c for c in key if capture.excluded_columns.matches(schema, name, c) or capture.masked_columns.matches(schema, name, c)]
        if hidden:
            raise ConfigError(f"--key-columns: key column(s) {hidden} of {qualified} are excluded or masked: a key must be in the event")
        # An identity of other columns is enough: the demux finds the old row's key by its values
        # (demux.rekey, REPLICA IDENTITY USING INDEX). Without any, nothing names the old row.
        if not identity_columns(conn, (schema, name)):
            log.warning(
                "a --key-columns table without a replica identity: updates that change the key "
                "leave the old key in per-table topics and deletes cannot be keyed; "
                f"ALTER TABLE {sql_table((schema, name))} REPLICA IDENTITY FULL (or USING INDEX on a unique index)",
                extra={"table": qualified, "key_columns": list(key)},
            )
    names = {qualify_table(*t) for t in tables}
    for pattern, _cols in capture.key_columns:
        if not any(ch in pattern for ch in WILDCARDS) and pattern not in names:
            log.warning("--key-columns names a table that is not captured (yet)", extra={"table": pattern})


def check_primary_key_shown(conn: psycopg.Connection[tuple[object, ...]], capture: CaptureFilter, table: TableName) -> None:
    """A primary-key column excluded or masked is a configuration error, as a --key-columns
    one is: masked, every row had the key "****" and the demux's compacted topic kept one row
    of the table; excluded, every event went to the demux's dead-letter topic (a fuzz)."""
    if not (capture.excluded_columns or capture.masked_columns):
        return
    schema, name = table
    rows = conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY a.attnum",
        (sql_table(table),),
    ).fetchall()
    hidden = [str(r[0]) for r in rows
              if capture.excluded_columns.matches(schema, name, str(r[0])) or capture.masked_columns.matches(schema, name, str(r[0]))]
    if hidden:
        raise ConfigError(
            f"--exclude-columns/--mask-columns: primary-key column(s) {hidden} of {qualify_table(schema, name)} are excluded "
            "or masked: a key must be in the event (narrow the rule, or give the table other --key-columns)"
        )


def tables_without_identity(conn: psycopg.Connection[tuple[object, ...]], tables: list[TableName]) -> list[TableName]:
    """Tables whose updates and deletes carry no old row: REPLICA IDENTITY NOTHING, or DEFAULT
    without a primary key PostgreSQL uses as the identity (a DEFERRABLE one it never uses)."""
    if not tables:
        return []
    rows = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = ANY(%s::regclass[]) AND (c.relreplident = 'n' OR (c.relreplident = 'd' AND NOT EXISTS "
        "(SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary AND i.indimmediate))) ORDER BY 1, 2",
        ([sql_table(t) for t in tables],),
    ).fetchall()
    return [(str(r[0]), str(r[1])) for r in rows]


def warn_lost_changes(conn: psycopg.Connection[tuple[object, ...]], plugin: str, tables: list[TableName]) -> None:
    """wal2json leaves out updates and deletes of a table without a replica identity (a WARNING
    in the server's log only); pgoutput makes PostgreSQL refuse them instead. Say so at start."""
    if plugin != "wal2json":
        return
    for table in tables_without_identity(conn, tables):
        log.warning(
            "wal2json does not decode updates and deletes of a table without a replica identity: they never reach the "
            f"topic. ALTER TABLE {sql_table(table)} REPLICA IDENTITY FULL (or add a primary key)",
            extra={"table": qualify_table(*table)},
        )


def list_tables(conn: psycopg.Connection[tuple[object, ...]], *, persistence: str = "p") -> list[TableName]:
    """The database's tables (plain and partitioned) of ``persistence``: by default permanent
    ones only. PostgreSQL neither publishes nor decodes UNLOGGED and TEMP tables: counted, one
    made the publication check refuse every restart (naming an ALTER PUBLICATION that cannot
    work), and a session's temp table did the same (a warehouse fuzz)."""
    rows = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
        "AND n.nspname NOT LIKE 'pg_toast%%' AND c.relpersistence = ANY(%s) ORDER BY 1, 2",
        (list(persistence),),
    ).fetchall()
    return [(str(r[0]), str(r[1])) for r in rows]


def resolve_tables(conn: psycopg.Connection[tuple[object, ...]], capture: CaptureFilter) -> list[TableName]:
    """The captured tables that exist now; an include-list name without wildcards must exist."""
    existing = list_tables(conn)
    names = {qualify_table(*t) for t in existing}
    for pattern in capture.tables:
        if not any(ch in pattern for ch in WILDCARDS) and pattern not in names:
            if pattern in {qualify_table(*t) for t in list_tables(conn, persistence="ut")}:
                raise ConfigError(
                    f"table {pattern!r} in --tables is UNLOGGED (or TEMP): PostgreSQL does not decode its changes; "
                    "ALTER TABLE … SET LOGGED to capture it"
                )
            raise ConfigError(f"table {pattern!r} in --tables does not exist in this database")
    return [t for t in existing if capture.captures(qualify_table(*t))]


def published_tables(conn: psycopg.Connection[tuple[object, ...]], publication: str) -> set[TableName]:
    """The tables pgoutput names the changes of: a partitioned table's leaves, or the table
    itself when the publication has publish_via_partition_root."""
    rows = conn.execute("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (publication,)).fetchall()
    return {(str(r[0]), str(r[1])) for r in rows}


def sql_table(table: TableName) -> str:
    return f"{quote_ident(table[0])}.{quote_ident(table[1])}"


def unpublished(conn: psycopg.Connection[tuple[object, ...]], name: str, tables: list[TableName]) -> list[TableName]:
    """Those of ``tables`` the publication streams no change of (see :func:`check_publication`)."""
    rows = conn.execute(
        "WITH pub AS (SELECT format('%%I.%%I', schemaname, tablename)::regclass AS rel "
        "FROM pg_publication_tables WHERE pubname = %s) "
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p') AND EXISTS (SELECT 1 FROM pub WHERE pub.rel = c.oid OR pub.rel IN "
        "(SELECT relid FROM pg_partition_ancestors(c.oid) UNION ALL SELECT relid FROM pg_partition_tree(c.oid)))",
        (name,),
    ).fetchall()
    published = {(str(r[0]), str(r[1])) for r in rows}
    return [t for t in tables if t not in published]


def publish_new_tables(conn: psycopg.Connection[tuple[object, ...]], name: str, capture: CaptureFilter) -> tuple[list[TableName], list[TableName]]:
    """Tables created since the start that the capture filter takes and the publication (a
    table list) does not publish: their changes are not streamed. Each is added to it when the
    role may (owner of the publication and the table). Returns (added, still unpublished)."""
    row = conn.execute("SELECT puballtables FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
    if row is None or row[0]:
        return [], []
    missing = unpublished(conn, name, [t for t in list_tables(conn) if capture.captures(qualify_table(*t))])
    added: list[TableName] = []
    left: list[TableName] = []
    for table in missing:
        try:
            conn.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(sql.Identifier(name), sql.Identifier(*table)))
            added.append(table)
        except psycopg.Error:
            left.append(table)
    return added, left


def check_publication(conn: psycopg.Connection[tuple[object, ...]], name: str, tables: list[TableName]) -> None:
    """An existing publication must publish every captured table: a table missing from it
    would be snapshotted and then get no changes. A partitioned table counts as published
    when it, a partition of it or a table it is a partition of is (as publish_via_partition_root
    decides, pgoutput streams one or the other)."""
    missing = unpublished(conn, name, tables)
    if missing:
        raise ConfigError(
            f"publication {name} does not publish {', '.join(qualify_table(*t) for t in missing)}: their changes would "
            f"not be streamed. ALTER PUBLICATION {quote_ident(name)} ADD TABLE {', '.join(sql_table(t) for t in missing)}"
        )


def check_publication_options(conn: psycopg.Connection[tuple[object, ...]], name: str, tables: list[TableName]) -> None:
    """An existing publication must publish every change of the captured tables, whole: one
    that leaves out deletes or truncates, or a row filter or column list on a captured table,
    streamed partial changes without a word (deleted rows stayed live downstream; rows outside
    a filter were snapshotted and then never changed; a column outside a list was read by the
    snapshot, then missing from changes; a fuzz found them)."""
    row = conn.execute(
        "SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = %s", (name,)
    ).fetchone()
    assert row is not None
    left_out = [action for action, on in zip(("insert", "update", "delete", "truncate"), row, strict=True) if not on]
    if left_out:
        raise ConfigError(
            f"publication {name} does not publish {', '.join(left_out)}: those changes would never reach the topic (a deleted "
            f"row would stay live downstream). ALTER PUBLICATION {quote_ident(name)} SET (publish = 'insert, update, delete, "
            "truncate'), or give walbus a publication of its own (--publication)"
        )
    captured = [sql_table(t) for t in tables]
    rows = conn.execute(
        "SELECT n.nspname, c.relname, pr.prqual IS NOT NULL, pr.prattrs IS NOT NULL "
        "FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid "
        "JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE p.pubname = %s AND (pr.prqual IS NOT NULL OR pr.prattrs IS NOT NULL) AND EXISTS ("
        "SELECT 1 FROM unnest(%s::text[]) t(name) WHERE pr.prrelid = t.name::regclass "
        "OR pr.prrelid IN (SELECT relid FROM pg_partition_ancestors(t.name::regclass)))",
        (name, captured),
    ).fetchall()
    if rows:
        what = "; ".join(
            f"{qualify_table(str(r[0]), str(r[1]))}: " + " and ".join(x for x, on in (("a row filter", r[2]), ("a column list", r[3])) if on)
            for r in rows
        )
        raise ConfigError(
            f"publication {name} publishes part of captured tables ({what}): the snapshot reads whole tables, the stream "
            f"would carry only part of their changes. Publish them whole (ALTER PUBLICATION {quote_ident(name)} SET TABLE …), "
            "use --exclude-columns / --tables to narrow what walbus captures, or give walbus a publication of its own (--publication)"
        )


def ensure_publication(
    conn: psycopg.Connection[tuple[object, ...]], name: str, capture: CaptureFilter, tables: list[TableName]
) -> None:
    if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone():
        # Tables created while the producer was down that the filter takes: added when the
        # role may, as while it runs (a restart after a migration stopped with exit 2; a fuzz).
        for table in publish_new_tables(conn, name, capture)[0]:
            log.warning(
                "a table created since the last start is captured: added to the publication. Its changes before now "
                "were not streamed: read it with an incremental snapshot (execute-snapshot) if it had any",
                extra={"table": qualify_table(*table), "publication": name},
            )
        check_publication(conn, name, tables)
        check_publication_options(conn, name, tables)
        log.info("using existing publication", extra={"publication": name})
        return
    filtered = bool(capture.tables or capture.exclude_tables)
    # FOR ALL TABLES when the role may (a superuser), filtered or not (Debezium's all_tables):
    # a table created later that the filter takes is then streamed from its first change. A
    # table list misses it until it is added (see publish_new_tables).
    superuser = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    all_tables = not filtered or bool(superuser and superuser[0])
    if not all_tables and not tables:
        raise ConfigError("--tables/--exclude-tables leave no table to capture (and a table list cannot be empty)")
    idents = [sql.Identifier(*t) for t in tables]
    statement = (
        sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(sql.Identifier(name)) if all_tables
        else sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(name), sql.SQL(", ").join(idents))
    )
    try:
        conn.execute(statement)
    except psycopg.errors.DuplicateObject:
        # Another producer of the database created it meanwhile (two started at once: one
        # stopped with a traceback; a re-fuzz): it exists now.
        return ensure_publication(conn, name, capture, tables)
    except psycopg.errors.InsufficientPrivilege as e:
        # FOR ALL TABLES needs a superuser: owning the tables is not enough.
        who = "a superuser" if all_tables else "the owner of every listed table (with CREATE on the database)"
        raise ConfigError(
            f"cannot create publication {name}: {str(e).strip()}. Have {who} run "
            f"{statement.as_string(conn)}" + (", or capture a table list (--tables) whose owner creates it" if all_tables else "")
        ) from None
    shown = "ALL" if all_tables else [qualify_table(*t) for t in tables]
    log.info("created publication", extra={"publication": name, "tables": shown})


def slot_state(conn: psycopg.Connection[tuple[object, ...]], slot: str) -> SlotState:
    row = conn.execute(
        "SELECT plugin, (confirmed_flush_lsn - '0/0')::int8, active_pid, wal_status FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()
    if row is None:
        return SlotState(False)
    pid = int(str(row[2])) if row[2] is not None else None
    return SlotState(True, str(row[0]), int(str(row[1] or 0)), pid, lost=row[3] == "lost")


def slot_lag_bytes(conn: psycopg.Connection[tuple[object, ...]], slot: str) -> int | None:
    """The server's WAL position minus the slot's confirmed one, as ``walbus status`` reads it;
    None without the slot, or on a standby (no current WAL position there)."""
    row = conn.execute(
        "SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8 END "
        "FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()
    return None if row is None or row[0] is None else max(0, int(str(row[0])))


def source_identity(conn: psycopg.Connection[tuple[object, ...]]) -> dict[str, Any]:
    """Which database this is, for the topic's progress records: the cluster's system
    identifier and the database's oid (a rename keeps it), with its name for messages."""
    row = conn.execute(
        "SELECT s.system_identifier::text, d.oid::int8, d.datname::text FROM pg_control_system() s, pg_database d "
        "WHERE d.datname = current_database()"
    ).fetchone()
    assert row is not None
    return {"system": str(row[0]), "database_oid": int(str(row[1])), "database": str(row[2])}


def same_source(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a.get("system"), a.get("database_oid")) == (b.get("system"), b.get("database_oid"))


def check_slot(conn: psycopg.Connection[tuple[object, ...]], slot: str, plugin: str, database: str) -> SlotState:
    state = slot_state(conn, slot)
    if not state.exists:
        return state
    row = conn.execute("SELECT database, slot_type FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    if row is not None and (row[1] != "logical" or row[0] != database):
        raise ConfigError(f"replication slot {slot} exists but is a {row[1]} slot of database {row[0]!r}: choose another --slot")
    if state.plugin != plugin:
        raise ConfigError(
            f"replication slot {slot} exists with plugin {state.plugin}, not {plugin}: use --plugin {state.plugin} or another --slot"
        )
    if state.active_pid is not None:
        raise ConfigError(f"replication slot {slot} is in use by another process (backend pid {state.active_pid})")
    return state


def drop_slot(dsn: str, slot: str) -> None:
    with connect(dsn) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s) WHERE EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = %s)", (slot, slot))
    log.info("dropped replication slot", extra={"slot": slot})
