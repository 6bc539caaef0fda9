"""What walbus keeps to start a driver JVM faster: where, under which names, and how a launch
uses it (warehouse.driver_cache)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from warehouse import driver_cache as dc

PACKAGES = {dc.PACKAGES: "io.delta:delta-spark_4.2_2.13:4.4.0,org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0"}


def _env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "java").write_text("#!/bin/sh\n")
    return {"JAVA_HOME": str(home), "HOME": str(tmp_path / "home")}


def _jars(tmp_path: Path, n: int = 2) -> list[str]:
    out = []
    for i in range(n):
        jar = tmp_path / "ivy" / f"j{i}.jar"
        jar.parent.mkdir(exist_ok=True)
        jar.write_bytes(b"PK" + bytes([i]))
        out.append(str(jar))
    return out


def test_the_cache_lives_in_walbus_cache_directory_unless_the_environment_says_otherwise(tmp_path: Path) -> None:
    env = _env(tmp_path)
    assert dc.cache_dir(env) == tmp_path / "home" / ".cache" / "walbus" / "jvm"
    assert dc.cache_dir({**env, "XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "walbus" / "jvm"
    assert dc.cache_dir({**env, dc.CACHE_ENV: str(tmp_path / "mine")}) == tmp_path / "mine"
    for off in ("off", "OFF", "none", "0"):
        off_env = {**env, dc.CACHE_ENV: off}
        assert dc.cache_dir(off_env) is None
        assert dc.archive_stem({}, "", off_env) is None and dc.jars_path(PACKAGES, off_env) is None
        assert dc.plan_launch(PACKAGES, "local[2]", env=off_env) == dc.Launch(dict(PACKAGES))


def test_without_a_java_there_is_no_archive(tmp_path: Path) -> None:
    env = {"JAVA_HOME": str(tmp_path / "missing"), "HOME": str(tmp_path)}
    assert dc.java_binary(env) is None
    assert dc.archive_stem({}, "", env) is None


def test_an_archive_is_named_after_the_java_the_packages_and_the_class_path(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    env = _env(tmp_path)
    jars = _jars(tmp_path)
    first = dc.archive_stem(PACKAGES, "", env)
    assert first is not None and first.parent == tmp_path / "home" / ".cache" / "walbus" / "jvm"
    assert first.name.startswith("spark-driver-") and first.suffix == ""
    assert dc.archive_stem(PACKAGES, "", env) == first  # the same inputs: the same archive
    # settings that do not change the JVM's classes do not change the name
    assert dc.archive_stem({**PACKAGES, "spark.driver.memory": "8g"}, "", env) == first
    with_jars = dc.archive_stem({}, ":".join(jars), env)
    others = {
        dc.archive_stem({dc.PACKAGES: "io.delta:delta-spark_4.2_2.13:4.4.1"}, "", env),
        dc.archive_stem({**PACKAGES, "spark.driver.extraClassPath": "/opt/x.jar"}, "", env),
        with_jars,
    }
    Path(jars[1]).write_bytes(b"PK another build")  # a jar of the class path replaced
    others.add(dc.archive_stem({}, ":".join(jars), env))
    java = Path(env["JAVA_HOME"]) / "bin" / "java"
    java.write_text("#!/bin/sh\n# another build\n")  # an upgraded JDK at the same path
    others.add(dc.archive_stem(PACKAGES, "", env))
    assert first not in others and len(others) == 5


def test_a_local_driver_skips_ivy_with_the_kept_jars_after_sparks_own(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    env = _env(tmp_path)
    settings = {**PACKAGES, "spark.driver.memory": "2g"}
    assert dc.plan_launch(settings, "local[2]", env=env) == dc.Launch(settings)  # nothing kept yet
    jars = _jars(tmp_path)
    kept = dc.save_jars(settings, jars, env)
    assert kept is not None and kept.read_text().splitlines() == jars
    assert stat.S_IMODE(os.stat(kept.parent).st_mode) == 0o700
    launch = dc.plan_launch(settings, "local[2]", env=env)
    assert launch == dc.Launch({"spark.driver.memory": "2g"}, ":".join(jars))
    for master in ("local", "local[*]", "local[2,3]"):
        assert dc.plan_launch(settings, master, env=env).classpath == ":".join(jars)
    # another master's executors need the packages; other repositories resolve other jars
    for master in (None, "spark://127.0.0.1:7077", "yarn", "k8s://https://k:443"):
        assert dc.plan_launch(settings, master, env=env) == dc.Launch(settings)
    other = {**settings, "spark.jars.repositories": "https://repo.example/maven"}
    assert dc.plan_launch(other, "local[2]", env=env) == dc.Launch(other)
    # a kept jar gone from Ivy's cache: Ivy resolves again
    os.unlink(jars[0])
    assert dc.plan_launch(settings, "local[2]", env=env) == dc.Launch(settings)


def test_a_launch_maps_the_archive_made_for_it_or_writes_one(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    env = _env(tmp_path)
    jars = _jars(tmp_path)
    dc.save_jars(PACKAGES, jars, env)
    stem = dc.archive_for(PACKAGES, "local[1]", env)
    assert stem is not None and stem == dc.archive_stem({}, ":".join(jars), env)
    assert dc.plan_launch(PACKAGES, "local[1]", env=env).archive is None  # not written yet
    archive = dc.archive_file(stem, 7)
    assert archive.name == f"{stem.name}-7.jsa"
    archive.write_bytes(b"archive")
    mine = {**PACKAGES, dc.JAVA_OPTIONS: "-XX:+UseG1GC -Dx=1"}
    launch = dc.plan_launch(mine, "local[1]", env=env)
    assert launch.archive == archive and launch.cached
    # the archive's options after the user's own Java options, its checksums verified
    assert launch.settings == {
        dc.JAVA_OPTIONS: f"-XX:+UseG1GC -Dx=1 -XX:+VerifySharedSpaces -XX:SharedArchiveFile={archive}"
    }
    assert mine[dc.JAVA_OPTIONS] == "-XX:+UseG1GC -Dx=1"  # the caller's settings are left alone
    out = tmp_path / "new.jsa"
    writing = dc.plan_launch(PACKAGES, "local[1]", archive_output=out, env=env)
    assert writing.settings == {dc.JAVA_OPTIONS: f"-XX:ArchiveClassesAtExit={out}"} and writing.archive == out


def test_an_archive_cut_short_is_never_mapped(tmp_path: Path) -> None:
    """A JVM that maps an archive shorter than its header says dies of SIGBUS (measured: a
    200 MB archive cut to 100 MB, JDK 17): only a file of the size it was written with is used."""
    pytest.importorskip("pyspark")
    env = _env(tmp_path)
    stem = dc.archive_for({}, "local[1]", env)
    assert stem is not None
    stem.parent.mkdir(parents=True)
    archive = dc.archive_file(stem, 1000)
    archive.write_bytes(b"x" * 600)  # cut short
    stem.with_name(f"{stem.name}-junk.jsa").write_bytes(b"x")
    assert dc.find_archive(stem) is None
    launch = dc.plan_launch({}, "local[1]", env=env)
    assert launch.archive is None and dc.JAVA_OPTIONS not in launch.settings and not launch.cached
    archive.write_bytes(b"x" * 1000)
    assert dc.find_archive(stem) == archive


def test_spark_jars_values_as_files() -> None:
    assert dc.jar_files("file:///a/b.jar, file:/c/d.jar,/e/f.jar,,") == ["/a/b.jar", "/c/d.jar", "/e/f.jar"]
    assert dc.jar_files("") == []


def test_a_dead_writers_temporary_files_are_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead = tmp_path / f"spark-driver-x.jsa.{done.stdout.strip()}.tmp"
    live = tmp_path / f"spark-driver-x.jsa.{os.getpid()}.tmp"
    other = tmp_path / "notes.tmp"
    for path in (dead, live, other):
        path.write_text("x")
    assert dc.remove_leftovers(tmp_path) == [dead]
    assert sorted(tmp_path.iterdir()) == sorted([live, other])


def test_a_java_option_with_blanks_quotes_or_backslashes_is_one_quoted_word() -> None:
    assert dc.java_option_word("-XX:SharedArchiveFile=/c/a.jsa") == "-XX:SharedArchiveFile=/c/a.jsa"
    assert dc.java_option_word("-XX:ErrorFile=/my home/x") == '"-XX:ErrorFile=/my home/x"'
    assert dc.java_option_word("-Da=it's") == '"-Da=it\'s"'
    assert dc.java_option_word('-Da="b"\\c') == '"-Da=\\"b\\"\\\\c"'
    out = dc.with_java_option({dc.JAVA_OPTIONS: "-Dx=1"}, "-XX:SharedArchiveFile=/a b/c.jsa")
    assert out[dc.JAVA_OPTIONS] == '-Dx=1 "-XX:SharedArchiveFile=/a b/c.jsa"'


def test_jars_with_the_class_path_separator_in_their_path_bring_ivy_back(tmp_path: Path) -> None:
    env = _env(tmp_path)
    odd = tmp_path / "a:b"
    odd.mkdir()
    (odd / "x.jar").write_bytes(b"PK")
    dc.save_jars(PACKAGES, [str(odd / "x.jar")], env)
    assert dc.resolved_jars(PACKAGES, env) is None
    assert dc.plan_launch(PACKAGES, "local[2]", env=env) == dc.Launch(dict(PACKAGES))


def test_a_cache_directory_that_exists_keeps_its_mode_and_one_others_may_write_is_refused(tmp_path: Path) -> None:
    # WALBUS_SPARK_DRIVER_CACHE=/tmp (or a shared directory): `walbus warehouse prepare` made it
    # 0700, for every user of the machine (when run as root), or failed on one it did not own.
    from walbus.config import ConfigError

    env = {**_env(tmp_path), dc.CACHE_ENV: str(tmp_path / "shared")}
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    assert dc.save_jars(PACKAGES, _jars(tmp_path), env) is not None
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755
    for mode in (0o777, 0o1777, 0o775):
        os.chmod(shared, mode)
        with pytest.raises(ConfigError, match=f"may be written by other users \\(mode {mode:o}\\)"):
            dc.save_jars(PACKAGES, _jars(tmp_path), env)
        assert stat.S_IMODE(os.stat(shared).st_mode) == mode
    fresh = tmp_path / "fresh" / "cache"
    kept = dc.save_jars(PACKAGES, _jars(tmp_path), {**env, dc.CACHE_ENV: str(fresh)})
    assert kept is not None and stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
