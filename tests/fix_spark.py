"""One SparkSession for the whole test session (local[2], Delta + Kafka connector)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


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
