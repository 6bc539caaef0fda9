"""`walbus warehouse prepare`: the driver JVM's class archive, written once, mapped by every
later driver JVM that walbus starts (warehouse.class_archive)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark]

ROOT = Path(__file__).resolve().parents[2]
_SESSION = """
import sys
from warehouse.spark import build_session
spark = build_session(master="local[1]", conf={
    "spark.ui.enabled": "false", "spark.driver.extraJavaOptions": "-Xlog:class+load=info:file=" + sys.argv[1]})
print(spark.range(5).count())
spark.stop()
"""


def _classes_source(env: dict[str, str], log: Path, name: str) -> str:
    """Where a new driver JVM took class ``name`` from (its class-load log)."""
    done = subprocess.run([sys.executable, "-c", _SESSION, str(log)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "5", done.stderr[-3000:]
    (line,) = [line for line in log.read_text().splitlines() if f"] {name} source: " in line]
    return line.split(" source: ", 1)[1]


def test_prepare_writes_the_class_archive_once_and_later_driver_jvms_map_it(tmp_path: Path) -> None:
    archives = tmp_path / "jvm"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WALBUS_SPARK_CLASS_ARCHIVE": str(archives),
           "WALBUS_SPARK_LOG": str(tmp_path / "spark.log")}
    cli = [sys.executable, "-m", "walbus.app.cli", "warehouse", "prepare"]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "io.delta:delta-spark" in done.stdout and "(written)" in done.stdout, done.stdout
    (archive,) = archives.iterdir()  # the archive alone: no temporary file left beside it
    assert archive.name.startswith("spark-driver-") and archive.suffix == ".jsa" and archive.stat().st_size > 1 << 20
    assert stat.S_IMODE(archives.stat().st_mode) == 0o700
    # a new driver JVM maps it, and the user's own Java options still apply (the log)
    assert _classes_source(env, tmp_path / "mapped.txt", "org.apache.spark.sql.SparkSession").startswith("shared objects file")
    # without it, the same class comes from pyspark's jar
    off = {**env, "WALBUS_SPARK_CLASS_ARCHIVE": "off"}
    assert _classes_source(off, tmp_path / "off.txt", "org.apache.spark.sql.SparkSession").endswith(".jar")
    again = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "(already there)" in again.stdout, again.stdout + again.stderr[-3000:]
    assert list(archives.iterdir()) == [archive]
