"""`--catalog-database`: a load names its Delta tables in Spark's Hive catalog (an embedded
metastore under the warehouse); a new Spark session with that metastore reads them by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.warehouse import Txn, produce_events, table_paths
from walbus.contract import qualify_table
from warehouse.catalog import CATALOG_DIR, table_name

pytestmark = [pytest.mark.spark, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
ORDERS = "shop.orders"
ODD = qualify_table("Shop", "Order Items")
AUDIT = "shop.audit"  # no primary key: history only
PK = ["id"]


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """`walbus warehouse …` of this worktree, run in ``cwd`` (where Derby would leave its files)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TZ": "UTC"}
    return subprocess.run([sys.executable, "-m", "walbus.app.cli", "warehouse", *args],
                          cwd=cwd, env=env, capture_output=True, timeout=600)


def _load(
    cwd: Path, bootstrap: str, topic: str, warehouse: Path, *, catalog: bool = True
) -> subprocess.CompletedProcess[bytes]:
    return _cli(cwd, "load", "--kafka-bootstrap", bootstrap, "--topic", topic, "--warehouse", str(warehouse),
                "--master", "local[2]", "--shuffle-partitions", "2", *(("--catalog-database", "dw") if catalog else ()),
                "--spark-conf", "spark.ui.enabled=false")


def _loaded(done: subprocess.CompletedProcess[bytes]) -> None:
    assert done.returncode == 0, done.stderr.decode()[-3000:]


def _catalog_tables(warehouse: Path, topic: str) -> dict[str, str]:
    """Catalog name -> Delta path of every table the loads wrote."""
    names = {}
    for table, kinds in ((ORDERS, ("history", "current")), (ODD, ("history", "current")), (AUDIT, ("history",))):
        paths = table_paths(warehouse, topic, table)
        for kind in kinds:
            names[table_name(paths.schema, paths.table, kind)] = paths.history if kind == "history" else paths.current
    return names


def test_loaded_tables_read_by_name_in_a_new_session(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    cwd, warehouse = tmp_path / "cwd", tmp_path / "wh"
    cwd.mkdir()
    first = Txn(0x1000)
    for k in range(5):
        first.insert(ORDERS, PK, {"id": ("int4", k), "amount": ("numeric", f"{k}.5")})
        first.insert(ODD, PK, {"id": ("int4", k), "ö b": ("text", f"v{k}")})
        first.insert(AUDIT, [], {"what": ("text", f"a{k}")})
    produce_events(kafka_bootstrap, unique_name, first.events)
    # the catalog turned on from the second load on, which has no event of AUDIT: only the
    # slice's tables were named, so AUDIT's stayed without a name (a fuzz)
    _loaded(_load(cwd, kafka_bootstrap, unique_name, warehouse, catalog=False))
    # a second load: a new column shows through the catalog
    second = Txn(0x2000).update(ORDERS, PK, {"id": ("int4", 1), "amount": ("numeric", "9"), "note": ("text", "n")})
    produce_events(kafka_bootstrap, unique_name, second.delete(ODD, PK, {"id": ("int4", 2)}).events)
    _loaded(_load(cwd, kafka_bootstrap, unique_name, warehouse))
    # no metastore_db, derby.log or spark-warehouse here (Spark's own `artifacts` dir is not the catalog's)
    assert not {"metastore_db", "derby.log", "spark-warehouse"} & set(os.listdir(cwd))
    assert {"metastore_db", "derby.log"} <= set(os.listdir(warehouse / CATALOG_DIR))

    tables = _catalog_tables(warehouse, unique_name)
    # in the new session, each catalog table holds exactly its Delta path's rows
    checks = " UNION ALL ".join(
        f"SELECT '{name}' AS name, (SELECT count(*) FROM dw.{name}) AS n, "
        f"(SELECT count(*) FROM (SELECT * EXCEPT (pg_raw_values) FROM dw.{name} EXCEPT ALL "
        f"SELECT * EXCEPT (pg_raw_values) FROM delta.`{path}`)) AS extra, "
        f"(SELECT count(*) FROM (SELECT * EXCEPT (pg_raw_values) FROM delta.`{path}` EXCEPT ALL "
        f"SELECT * EXCEPT (pg_raw_values) FROM dw.{name})) AS missing"
        for name, path in tables.items()
    )
    # names resolve in the catalog database without qualification; the new column is there
    checks += (" UNION ALL SELECT 'unqualified', (SELECT count(*) FROM shop_orders_current "
               "WHERE id = 1 AND note = 'n' AND amount = 9 AND NOT _walbus_deleted), 0, 0")
    done = _cli(cwd, "sql", checks, "--warehouse", str(warehouse), "--catalog-database", "dw",
                "--master", "local[1]", "--format", "json", "--spark-conf", "spark.ui.enabled=false")
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    found = {r["name"]: r for r in map(orjson.loads, done.stdout.splitlines())}
    for name, path in tables.items():
        expected = spark.read.format("delta").load(path).count()
        assert (found[name]["n"], found[name]["extra"], found[name]["missing"]) == (expected, 0, 0), name
    assert found["shop_orders_history"]["n"] == 6 and found["shop_audit_history"]["n"] == 5

    assert found["unqualified"]["n"] == 1

    # another topic's table of the same name cannot take the name: the load says so
    other = f"{unique_name}-other"
    produce_events(kafka_bootstrap, other, Txn(0x1000).insert(ORDERS, PK, {"id": ("int4", 1)}).events)
    done = _load(cwd, kafka_bootstrap, other, warehouse)
    assert done.returncode == 1
    assert "catalog table `dw`.`shop_orders_history` is " in done.stderr.decode(), done.stderr.decode()[-3000:]
    assert "one --catalog-database per topic" in done.stderr.decode()
