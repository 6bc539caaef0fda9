"""`walbus warehouse load` on a Spark standalone cluster (a master and two workers on this
host) writes the same history and current tables as the same load on local[2]."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.spark_cluster import StandaloneCluster, standalone_cluster
from tests.support.warehouse import Txn, kafka_options, produce_events, table_paths
from walbus.contract import qualify_table
from warehouse.job import LoadSpec, run_load

pytestmark = [pytest.mark.spark, pytest.mark.integration]

ORDERS = "shop.orders"
ODD = qualify_table("shop", "Order Items")
AUDIT = "shop.audit"  # no primary key: history only
PK = ["id"]


def _order(key: int, amount: str, note: str = "n") -> dict[str, tuple[str, Any]]:
    return {"id": ("int8", key), "amount": ("numeric", amount), "at": ("timestamptz", "2024-03-04 05:06:07.5+02"),
            "note": ("text", note)}


def _events() -> list[bytes]:
    first = Txn(0x1000, xid=10)
    for k in range(60):
        first.insert(ORDERS, PK, _order(k, f"{k}.25", f"ö-{k}"))
        first.insert(ODD, PK, {"id": ("int4", k), "a.b": ("text", f"x{k}")})
        first.insert(AUDIT, [], {"what": ("text", f"order {k}")})
    second = Txn(0x2000, xid=11)
    for k in range(0, 60, 3):
        second.update(ORDERS, PK, {k2: v for k2, v in _order(k, "1000").items() if k2 != "note"}, unchanged=["note"])
    for k in range(0, 60, 7):
        second.delete(ORDERS, PK, {"id": ("int8", k)})
    second.update(ODD, PK, {"id": ("int4", 100), "a.b": ("text", "moved")}, identity={"id": ("int4", 1)})
    third = Txn(0x3000, xid=12).truncate(ODD, PK).insert(ODD, PK, {"id": ("int4", 7), "a.b": ("text", "after")})
    return first.events + second.events + third.events


def _rows(spark: Any, path: str, order: tuple[str, ...] = ("pg_commit_lsn", "pg_seq")) -> list[dict[str, Any]]:
    frame = spark.read.format("delta").load(path).orderBy(*order)
    return [r.asDict(recursive=True) for r in frame.collect()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as running:
        yield running


def test_cluster_load_equals_local_load(
    spark: Any, cluster: StandaloneCluster, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    produce_events(kafka_bootstrap, unique_name, _events())
    on_cluster, local = tmp_path / "cluster", tmp_path / "local"
    done = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "warehouse", "load", "--kafka-bootstrap", kafka_bootstrap,
         "--topic", unique_name, "--warehouse", str(on_cluster), "--master", cluster.master_url,
         "--shuffle-partitions", "2",
         "--spark-conf", "spark.executor.memory=512m,spark.executor.cores=1,spark.ui.enabled=false"],
        capture_output=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:] + cluster.log_tail()
    # the load ran on the cluster: an executor on each worker
    app, executors = cluster.finished_app("walbus-warehouse")
    assert app.get("state") == "FINISHED" and all(n >= 1 for n in executors), (app, executors)

    run_load(spark, LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(local)))
    for table, current in ((ORDERS, True), (ODD, True), (AUDIT, False)):
        there, here = table_paths(on_cluster, unique_name, table), table_paths(local, unique_name, table)
        history = _rows(spark, here.history)
        assert _rows(spark, there.history) == history, table
        assert len(history) > 10
        if current:
            assert _rows(spark, there.current, ("id",)) == _rows(spark, here.current, ("id",)), table
    live = {r["id"]: r for r in _rows(spark, table_paths(local, unique_name, ORDERS).current, ("id",)) if not r["_walbus_deleted"]}
    assert len(live) == 60 - len(range(0, 60, 7))
    assert live[3]["note"] == "ö-3" and str(live[3]["amount"]) == "1000.0000000000"
    odd = {r["id"]: r["a.b"] for r in _rows(spark, table_paths(local, unique_name, ODD).current, ("id",)) if not r["_walbus_deleted"]}
    assert odd == {7: "after"}
