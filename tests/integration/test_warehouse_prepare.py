"""`walbus warehouse prepare`: the connector jars' list and the driver JVM's class archive,
kept once and used by every later driver JVM that walbus starts (warehouse.driver_cache)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.warehouse import Txn, produce_events

pytestmark = [pytest.mark.spark, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
IVY = ":: resolving dependencies ::"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "walbus.app.cli", "warehouse", *args]


def _load(
    env: dict[str, str], bootstrap: str, topic: str, warehouse: Path, classes: Path, cwd: Path | None = None
) -> tuple[str, str]:
    """A load in a new driver JVM; where it took its classes from (its class-load log), and
    what it printed on stderr."""
    done = subprocess.run(
        _cli("load", "--kafka-bootstrap", bootstrap, "--topic", topic, "--warehouse", str(warehouse),
             "--master", "local[1]", "--spark-conf", "spark.ui.enabled=false",
             "--spark-conf", f"spark.driver.extraJavaOptions=-Xlog:class+load=info:file={classes}"),
        env=env, capture_output=True, text=True, timeout=600, cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("shop.a: 2 events, history +2,"), done.stdout
    return classes.read_text(), done.stderr


def _source(classes: str, name: str) -> str:
    (line,) = [line for line in classes.splitlines() if f"] {name} source: " in line]
    return line.split(" source: ", 1)[1]


def test_prepare_keeps_the_jars_and_the_class_archive_once_and_later_loads_use_them(
    tmp_path: Path, kafka_bootstrap: str, unique_name: str
) -> None:
    # paths with a blank and quotes, as a home directory may have (each option is quoted)
    cache, log = tmp_path / "driver cache 'q\"", tmp_path / "spark log" / "spark.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WALBUS_SPARK_DRIVER_CACHE": str(cache), "WALBUS_SPARK_LOG": str(log)}
    done = subprocess.run(_cli("prepare"), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "io.delta:delta-spark" in done.stdout and "(written)" in done.stdout, done.stdout
    # the two alone: no temporary file left beside them
    (jars,) = cache.glob("jars-*.txt")
    (archive,) = cache.glob("spark-driver-*.jsa")
    assert sorted(cache.iterdir()) == sorted([jars, archive])
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and archive.stat().st_size > 1 << 20
    kept = jars.read_text().splitlines()
    assert any("delta-spark" in j for j in kept) and any("spark-sql-kafka" in j for j in kept)
    assert all(os.path.isfile(j) for j in kept)

    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert("shop.a", ["id"], {"id": ("int4", 1)})
                   .insert("shop.a", ["id"], {"id": ("int4", 2)}).events)
    # a load in a new JVM: no Ivy resolution; Spark's, Delta's and the Kafka source's classes
    # mapped from the archive (it holds only classes of the class path: the kept jars were on
    # it); the user's own Java options kept (the class-load log)
    log.unlink()
    classes, _ = _load(env, kafka_bootstrap, unique_name, tmp_path / "wh1", tmp_path / "mapped.txt")
    assert IVY not in log.read_text(errors="replace")
    assert _source(classes, "org.apache.spark.sql.SparkSession").startswith("shared objects file")
    assert _source(classes, "io.delta.sql.DeltaSparkSessionExtension").startswith("shared objects file")
    assert _source(classes, "org.apache.spark.sql.kafka010.KafkaSourceProvider").startswith("shared objects file")
    # with the cache off: Ivy resolves, and the same classes come from the jars
    off = {**env, "WALBUS_SPARK_DRIVER_CACHE": "off"}
    classes, _ = _load(off, kafka_bootstrap, unique_name, tmp_path / "wh2", tmp_path / "off.txt")
    assert IVY in log.read_text(errors="replace")
    assert _source(classes, "org.apache.spark.sql.SparkSession").endswith(".jar")
    assert _source(classes, "io.delta.sql.DeltaSparkSessionExtension").endswith(".jar")
    assert "spark-sql-kafka" in _source(classes, "org.apache.spark.sql.kafka010.KafkaSourceProvider")
    # an archive cut short under a name of its new size (no crash: HotSpot 17 dies of SIGBUS
    # mapping it): the driver JVM is started again without the cache, and the load runs
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    shutil.copy(jars, damaged / jars.name)
    stem = archive.name[: archive.name.rindex("-")]
    cut = archive.stat().st_size // 2
    with open(archive, "rb") as src, open(damaged / f"{stem}-{cut}.jsa", "wb") as dst:
        dst.write(src.read(cut))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    classes, stderr = _load({**env, "WALBUS_SPARK_DRIVER_CACHE": str(damaged)}, kafka_bootstrap, unique_name,
                            tmp_path / "wh3", tmp_path / "damaged.txt", cwd)
    assert "did not start with walbus' driver cache" in stderr, stderr
    # the dead JVM's crash report went beside the Spark log, not into the working directory
    assert os.listdir(cwd) == [] and list(log.parent.glob("walbus-spark-crash-*.log"))
    assert _source(classes, "io.delta.sql.DeltaSparkSessionExtension").endswith(".jar")
    # once there, prepare starts no JVM and keeps them
    again = subprocess.run(_cli("prepare"), env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "(already there)" in again.stdout, again.stdout + again.stderr[-3000:]
    assert sorted(cache.iterdir()) == sorted([jars, archive])
