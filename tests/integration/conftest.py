"""Fixtures of the tests that run against the real services: PostgreSQL, Kafka, Spark."""

from tests.support.cluster import kafka_cluster
from tests.support.services import kafka_bootstrap, pg_dsn, services, unique_name
from tests.support.spark import pytest_collection_modifyitems, spark

__all__ = ["kafka_bootstrap", "kafka_cluster", "pg_dsn", "pytest_collection_modifyitems", "services", "spark", "unique_name"]
