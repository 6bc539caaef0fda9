#!/usr/bin/env bash
# Installs what walbus needs on a fresh Debian/Ubuntu machine: PostgreSQL's server and the
# wal2json plugin, a JDK and Maven, Prometheus (promtool) (for the local Kafka broker and Spark), and the Python
# package with its test extras. Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
need=()
command -v java >/dev/null || need+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null || need+=(maven)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql-15)
ls /usr/lib/postgresql/*/lib/wal2json.so >/dev/null 2>&1 || need+=(postgresql-15-wal2json)
command -v pg_recvlogical >/dev/null || need+=(postgresql-client-15)
# promtool checks and unit-tests deploy/walbus-alerts.yml; a real Prometheus scrapes the services in tests
command -v promtool >/dev/null || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: apt-get install ${need[*]}"
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -e '.[test,warehouse]'
# The producer's compiled hot path (native/, Rust: pyo3 + maturin, release profile) when a
# Rust toolchain is here (it also holds the consumers' event decoder); without one walbus runs
# its pure-Python paths, same results.
if command -v cargo >/dev/null; then
  python3 -m pip install -q --disable-pip-version-check ./native
  echo "setup: native hot path built (walbus_native)"
else
  echo "setup: no cargo: the producer falls back to its pure-Python path (install Rust, then pip install ./native)"
fi
# Spark's Delta and Kafka connector jars (spark.jars.packages, the versions that match the
# installed pyspark and delta-spark) once, into Ivy's cache, and what makes a later driver JVM
# start faster: the jars' list and the JVM's class archive, in ~/.cache/walbus/jvm
# (docs/warehouse.md); the JVMs' output goes to the Spark log file, not here.
walbus warehouse prepare | sed 's/^/setup: /'
# Fetch the Kafka broker's jars from Maven Central once (cached in ~/.cache/walbus): the
# default 4.x, and 3.9 for the tests that check it still works (tests/integration/test_kafka39.py).
python3 -c '
from walbus.app.dev.kafka import KAFKA_3_VERSION, KAFKA_VERSION, ensure_jars
for version in (KAFKA_VERSION, KAFKA_3_VERSION):
    print("setup: kafka", version, "jars in", ensure_jars(version))
'
echo "setup: done"
