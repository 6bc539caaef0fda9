"""The producer as a least-privilege role (REPLICATION + SELECT) on the real PostgreSQL: the
publication hint names who may create it; deploy/postgres-init's role streams changes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.integration.test_ops_prometheus import wait_http
from tests.support.kafka import read_topic
from tests.support.pipeline import ROOT, walbus_process
from walbus.app.dev.processes import free_port

pytestmark = pytest.mark.integration
INIT = ROOT / "deploy" / "postgres-init" / "10-walbus-producer-role.sh"


@pytest.fixture()
def role(pg_dsn: str, unique_name: str) -> Iterator[str]:
    """A role name of this test's own, dropped with what it was granted afterwards."""
    name = f"{unique_name}_r"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with contextlib.suppress(psycopg.Error):
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with contextlib.suppress(psycopg.Error):
            conn.execute(sql.SQL("REVOKE ALL ON DATABASE {} FROM {}").format(
                sql.Identifier(conn.info.dbname), sql.Identifier(name)))
    admin = make_conninfo(pg_dsn, dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as conn, contextlib.suppress(psycopg.Error):
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


ROLE_PASSWORD = "a-test-role-password"


def run_init_script(pg_dsn: str, role: str) -> None:
    params = conninfo_to_dict(pg_dsn)
    env = {**os.environ, "POSTGRES_USER": str(params.get("user", "postgres")), "POSTGRES_DB": str(params["dbname"]),
           "PGHOST": str(params.get("host", "127.0.0.1")), "PGPORT": str(params.get("port", 5432)),
           "WALBUS_PRODUCER_PASSWORD": "0123456789abcdef", "WALBUS_PRODUCER_ROLE": role}
    if params.get("password"):
        env["PGPASSWORD"] = str(params["password"])
    done = subprocess.run(["sh", str(INIT)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def produce_once(dsn: str, bootstrap: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "produce", "--pg-dsn", dsn, "--kafka-bootstrap", bootstrap, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


def test_the_hint_for_all_tables_names_a_superuser(pg_dsn: str, kafka_bootstrap: str, role: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
        # with a password of its own: the dev stack's PostgreSQL asks for one over TCP (scram)
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(ROLE_PASSWORD)))
        conn.execute(sql.SQL("GRANT SELECT ON t TO {}").format(sql.Identifier(role)))
    as_role = make_conninfo(pg_dsn, user=role, password=ROLE_PASSWORD)
    done = produce_once(as_role, kafka_bootstrap)
    assert done.returncode == 2, done.stderr
    assert "a superuser" in done.stderr and "FOR ALL TABLES" in done.stderr
    assert "the tables' owner" not in done.stderr  # the old, misleading hint
    done = produce_once(as_role, kafka_bootstrap, "--tables", "public.t")
    assert done.returncode == 2 and "the owner of every listed table" in done.stderr, done.stderr


def test_the_init_scripts_role_streams_changes(pg_dsn: str, kafka_bootstrap: str, role: str, tmp_path: Path) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t VALUES (1, 'snapshotted')")
        database = conn.info.dbname
        run_init_script(pg_dsn, role)
        super_user = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        assert super_user == (False,)
    port = free_port()
    log = tmp_path / "producer.log"
    producer = walbus_process(
        ["produce", "--pg-dsn", make_conninfo(pg_dsn, user=role, password="0123456789abcdef"),
         "--kafka-bootstrap", kafka_bootstrap, "--metrics-port", str(port)], log=log,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", producer, log)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (2, 'streamed')")
        records = asyncio.run(read_topic(kafka_bootstrap, f"walbus.{database}", min_count=2))
        assert b"snapshotted" in records[0][1] and b"streamed" in records[-1][1]  # type: ignore[operator]
    finally:
        producer.terminate()
        producer.wait(60)
