"""Checks and set-up before streaming: server settings, privileges, tables, publication, slot.

Everything here is a configuration matter: failures raise ConfigError with what to fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg
from psycopg import sql

from producer.codec import CaptureFilter, table_matches
from walbus.config import ConfigError
from walbus.logs import redact_dsn

log = logging.getLogger("walbus.producer.setup")


@dataclass(frozen=True)
class SlotState:
    exists: bool
    plugin: str | None = None
    confirmed_flush_lsn: int = 0
    active_pid: int | None = None


def connect(dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10, application_name="walbus-setup")
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


def list_tables(conn: psycopg.Connection[tuple[object, ...]]) -> list[str]:
    rows = conn.execute(
        "SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
        "AND n.nspname NOT LIKE 'pg_toast%' ORDER BY 1"
    ).fetchall()
    return [str(r[0]) for r in rows]


def resolve_tables(conn: psycopg.Connection[tuple[object, ...]], capture: CaptureFilter) -> list[str]:
    """The captured tables that exist now; an include-list name without wildcards must exist."""
    existing = list_tables(conn)
    for pattern in capture.tables:
        if not any(ch in pattern for ch in "*?[") and pattern not in existing:
            raise ConfigError(f"table {pattern!r} in --tables does not exist in this database")
    return [t for t in existing if capture.captures(t)]


def ensure_publication(
    conn: psycopg.Connection[tuple[object, ...]], name: str, capture: CaptureFilter, tables: list[str]
) -> None:
    if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone():
        log.info("using existing publication", extra={"publication": name})
        return
    try:
        if not capture.tables and not capture.exclude_tables:
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(sql.Identifier(name)))
        else:
            if not tables:
                raise ConfigError("--tables/--exclude-tables leave no table to capture")
            idents = [sql.Identifier(*t.split(".", 1)) for t in tables]
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(name), sql.SQL(", ").join(idents)))
    except psycopg.errors.InsufficientPrivilege as e:
        raise ConfigError(f"cannot create publication {name}: {e}; create it as the tables' owner") from None
    log.info("created publication", extra={"publication": name, "tables": "ALL" if not (capture.tables or capture.exclude_tables) else tables})


def slot_state(conn: psycopg.Connection[tuple[object, ...]], slot: str) -> SlotState:
    row = conn.execute(
        "SELECT plugin, (confirmed_flush_lsn - '0/0')::int8, active_pid, database FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()
    if row is None:
        return SlotState(False)
    return SlotState(True, str(row[0]), int(str(row[1] or 0)), int(str(row[2])) if row[2] is not None else None)


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


def captured_table_list(capture: CaptureFilter, tables: list[str]) -> list[str]:
    return [t for t in tables if table_matches(t, capture.tables)] if capture.tables else tables
