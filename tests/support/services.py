"""Session-scoped real services: PostgreSQL and Kafka.

Where they come from, in order:
1. ``WALBUS_PG_DSN`` and ``WALBUS_KAFKA_BOOTSTRAP`` when both are set;
2. testcontainers when a Docker engine answers;
3. otherwise walbus' own local stack (``walbus dev``), in a temporary state
   directory, stopped at the end of the session.

Every test gets its own database (``pg_dsn``) and its own topic names (``unique_name``).
Databases are dropped after each test; on services given by the environment (a
long-lived ``walbus dev`` stack, say) the session also deletes, at its end, the
topics whose names contain one of its unique names, so that the stack does not
fill its disk with test topics run after run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

# Every unique name handed out in this session (topic names contain them).
_UNIQUE_NAMES: list[str] = []


def _delete_session_topics(bootstrap: str) -> None:
    from walbus.kafka import KafkaAdmin

    async def run() -> int:
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
            ours = sorted(t for t in await admin.list_topics() if any(n in t for n in _UNIQUE_NAMES))
            await admin.delete_topics(ours)
            return len(ours)

    try:
        asyncio.run(run())
    except Exception as e:  # cleanup only: the tests' outcome stands
        print(f"\nwalbus tests: could not delete this session's topics: {e!r}", file=sys.stderr)


@dataclass(frozen=True)
class Services:
    pg_dsn: str  # a superuser DSN on the maintenance database
    kafka_bootstrap: str
    source: str  # env | testcontainers | local


def _docker_answers() -> bool:
    if not (os.path.exists("/var/run/docker.sock") or os.environ.get("DOCKER_HOST")):
        return False
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def _testcontainers() -> Iterator[Services]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    pg = PostgresContainer("postgres:15").with_command(
        "postgres -c wal_level=logical -c max_replication_slots=20 -c max_wal_senders=20"
    )
    kafka = KafkaContainer("confluentinc/cp-kafka:7.7.1").with_kraft()
    with pg, kafka:
        dsn = pg.get_connection_url().replace("postgresql+psycopg2://", "postgresql://")
        yield Services(dsn, kafka.get_bootstrap_server(), "testcontainers")


@contextlib.contextmanager
def _local_stack() -> Iterator[Services]:
    from walbus.app.dev import LocalStack

    state = Path(tempfile.mkdtemp(prefix="walbus-test-"))
    stack = LocalStack.load(state)
    try:
        stack.up()
        yield Services(stack.postgres.dsn, stack.kafka.bootstrap, "local")
    finally:
        stack.down()
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    dsn, bootstrap = os.environ.get("WALBUS_PG_DSN"), os.environ.get("WALBUS_KAFKA_BOOTSTRAP")
    if dsn and bootstrap:
        yield Services(dsn, bootstrap, "env")
        _delete_session_topics(bootstrap)
    elif _docker_answers():
        with _testcontainers() as s:
            yield s
    else:
        with _local_stack() as s:
            yield s


@pytest.fixture()
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short name unique to this test, usable as a database, slot or topic name."""
    base = "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:30].strip("_")
    name = f"t_{base}_{uuid.uuid4().hex[:8]}"
    _UNIQUE_NAMES.append(name)
    return name


@pytest.fixture()
def pg_dsn(services: Services, unique_name: str) -> Iterator[str]:
    """A DSN to a fresh database of this test's own; slots on it are dropped afterwards."""
    with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(unique_name)))
    yield make_conninfo(services.pg_dsn, dbname=unique_name)
    with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
        for (slot,) in conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (unique_name,)
        ).fetchall():
            with contextlib.suppress(psycopg.Error):
                conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                    "WHERE slot_name = %s AND active_pid IS NOT NULL",
                    (slot,),
                )
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        with contextlib.suppress(psycopg.Error):
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(unique_name)))


@pytest.fixture()
def kafka_bootstrap(services: Services) -> str:
    return services.kafka_bootstrap
