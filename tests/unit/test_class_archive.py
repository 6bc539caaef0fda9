"""The driver JVM's class-data archive: where it lives, what names it, how its option is added."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from warehouse import class_archive as ca


def _java(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "java").write_text("#!/bin/sh\n")
    return {"JAVA_HOME": str(home), "HOME": str(tmp_path / "home")}


def test_archives_live_in_walbus_cache_directory_unless_the_environment_says_otherwise(tmp_path: Path) -> None:
    env = _java(tmp_path)
    assert ca.archive_dir(env) == tmp_path / "home" / ".cache" / "walbus" / "jvm"
    assert ca.archive_dir({**env, "XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "walbus" / "jvm"
    assert ca.archive_dir({**env, ca.ARCHIVE_ENV: str(tmp_path / "mine")}) == tmp_path / "mine"
    for off in ("off", "OFF", "none", "0"):
        assert ca.archive_dir({**env, ca.ARCHIVE_ENV: off}) is None
        assert ca.archive_path({}, {**env, ca.ARCHIVE_ENV: off}) is None


def test_without_a_java_there_is_no_archive(tmp_path: Path) -> None:
    env = {"JAVA_HOME": str(tmp_path / "missing"), "HOME": str(tmp_path)}
    assert ca.java_binary(env) is None
    assert ca.archive_path({}, env) is None


def test_an_archive_is_named_after_the_java_the_packages_and_the_driver_class_path(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    env = _java(tmp_path)
    base = {"spark.jars.packages": "io.delta:delta-spark_4.2_2.13:4.4.0"}
    first = ca.archive_path(base, env)
    assert first is not None and first.parent == tmp_path / "home" / ".cache" / "walbus" / "jvm"
    assert first.name.startswith("spark-driver-") and first.suffix == ".jsa"
    assert ca.archive_path(base, env) == first  # the same inputs: the same archive
    # settings that do not change the JVM's classes do not change the name
    assert ca.archive_path({**base, "spark.driver.memory": "8g"}, env) == first
    others = {
        ca.archive_path({"spark.jars.packages": "io.delta:delta-spark_4.2_2.13:4.4.1"}, env),
        ca.archive_path({**base, "spark.driver.extraClassPath": "/opt/x.jar"}, env),
    }
    java = Path(env["JAVA_HOME"]) / "bin" / "java"
    java.write_text("#!/bin/sh\n# another build\n")  # an upgraded JDK at the same path
    others.add(ca.archive_path(base, env))
    assert first not in others and len(others) == 3


def test_the_archive_option_comes_after_the_users_own_java_options() -> None:
    archive = Path("/cache/a b.jsa")
    assert ca.with_java_option({}, ca.map_option(archive)) == {ca.JAVA_OPTIONS: "-XX:SharedArchiveFile=/cache/a b.jsa"}
    mine = {ca.JAVA_OPTIONS: "-XX:+UseG1GC -Dx=1", "spark.driver.memory": "2g"}
    out = ca.with_java_option(mine, ca.write_option(archive))
    assert out == {ca.JAVA_OPTIONS: "-XX:+UseG1GC -Dx=1 -XX:ArchiveClassesAtExit=/cache/a b.jsa", "spark.driver.memory": "2g"}
    assert mine[ca.JAVA_OPTIONS] == "-XX:+UseG1GC -Dx=1"  # the caller's settings are left alone


def test_the_archive_directory_is_private(tmp_path: Path) -> None:
    where = tmp_path / "a" / "jvm"
    where.parent.mkdir()
    where.mkdir(mode=0o755)
    ca.private_dir(where)
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700
