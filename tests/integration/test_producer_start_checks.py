"""The producer's start against the real stack: refusals leave nothing behind (no topic for a
database that does not exist, no slot for a snapshot that cannot run), the initial snapshot
retries what streaming retries, and the idle producer's metrics say what the server says."""

from __future__ import annotations

import asyncio

import pytest
from psycopg.conninfo import make_conninfo

from tests.integration.test_ops_least_privilege import produce_once
from tests.support.kafka import list_topics

pytestmark = pytest.mark.integration


def test_a_database_that_does_not_exist_leaves_no_topic(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """A mistyped database name: walbus.<typo> and its heartbeat topic were created before the
    exit-2 "does not exist"."""
    typo = f"{unique_name}_typo"
    done = produce_once(make_conninfo(pg_dsn, dbname=typo), kafka_bootstrap)
    assert done.returncode == 2 and "does not exist" in done.stderr, done.stderr
    assert not [t for t in asyncio.run(list_topics(kafka_bootstrap)) if typo in t]
