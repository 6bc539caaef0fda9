"""One SparkSession for the whole test session (local[2], Delta + Kafka connector)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# PySpark's collect() (pyspark.util._load_from_socket) leaves its loopback socket to the
# garbage collector, which CPython reports as an unraisable ResourceWarning. Third-party
# noise, ignored on the Spark tests only and only for sockets of this host.
_PYSPARK_SOCKET_LEAK = (
    r"ignore:Exception ignored in. <socket.socket .*raddr=\('127.0.0.1'"
    ":pytest.PytestUnraisableExceptionWarning"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("spark") is not None:
            item.add_marker(pytest.mark.filterwarnings(_PYSPARK_SOCKET_LEAK))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from warehouse.spark import build_session

    # Python-side datetimes of collected rows are built in the driver's local zone: make it
    # UTC like the session, so expected values are written plainly.
    os.environ["TZ"] = "UTC"
    import time

    time.tzset()
    session = build_session(
        master="local[2]",
        app_name="walbus-tests",
        shuffle_partitions=2,
        conf={
            "spark.driver.memory": "1g",
            "spark.ui.enabled": "false",
            # tiny loads: adaptive execution only adds jobs (one per shuffle stage) here
            "spark.sql.adaptive.enabled": "false",
        },
    )
    yield session
    session.stop()
