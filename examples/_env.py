"""Where the examples find the bus: the same WALBUS_* variables as `walbus dev env` exports."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict


def bootstrap() -> str:
    value = os.environ.get("WALBUS_KAFKA_BOOTSTRAP")
    if not value:
        raise SystemExit("set WALBUS_KAFKA_BOOTSTRAP (eval \"$(walbus dev env)\" after `walbus dev up`)")
    return value


def database_topic() -> str:
    """``walbus.<database>``: WALBUS_TOPIC, else named after WALBUS_PG_DSN's database."""
    topic = os.environ.get("WALBUS_TOPIC")
    if topic:
        return topic
    dsn = os.environ.get("WALBUS_PG_DSN")
    if not dsn:
        raise SystemExit("set WALBUS_TOPIC or WALBUS_PG_DSN (eval \"$(walbus dev env)\" after `walbus dev up`)")
    database = conninfo_to_dict(dsn).get("dbname") or "postgres"
    return f"walbus.{database}"
