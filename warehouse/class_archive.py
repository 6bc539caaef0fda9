"""The driver JVM's class-data archive: Spark's classes read, parsed and verified once.

A new driver JVM loads many thousands of Spark, Scala and Hadoop classes from pyspark's jars
as its session starts and its first load plans and runs; HotSpot's application class-data
sharing (AppCDS, JDK 13 and later: ``-XX:ArchiveClassesAtExit`` writes an archive as a JVM
exits, ``-XX:SharedArchiveFile`` maps it) lets a later JVM map them from an archive instead.
Measured on the 2-core machine (JDK 17, local[2], a new JVM each run, docs/warehouse.md
"Stop 45"): the session 5.9-6.2 -> 4.5-4.7 s, its first 100,000-event load 14.7-15.0 ->
12.8-13.9 s: what a nightly ``warehouse load`` pays every night.

``walbus warehouse prepare`` (:mod:`warehouse.prepare`, run by scripts/setup.sh) writes the
archive; every driver JVM that walbus starts maps it from then on. Its file is named after
what it was made from (the java binary, pyspark's jars, the connector packages, the driver's
class path), so an upgrade of any of them looks for a new one, and the JVM starts without
until ``prepare`` runs again. HotSpot checks an archive against the JVM and its class path
and runs without it when they differ (a line in the Spark log): a stale archive costs its
gain, never a load. The Delta and Kafka connector jars come from Ivy's cache through Spark's
own class loader, whose classes HotSpot does not archive.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Final

ARCHIVE_ENV: Final = "WALBUS_SPARK_CLASS_ARCHIVE"  # the archives' directory, or "off"
OFF: Final = frozenset({"off", "none", "false", "0"})
JAVA_OPTIONS: Final = "spark.driver.extraJavaOptions"
SUFFIX: Final = ".jsa"


def archive_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the archives live: ``$WALBUS_SPARK_CLASS_ARCHIVE``, else walbus' cache directory
    (``$XDG_CACHE_HOME/walbus/jvm``, ``~/.cache/walbus/jvm``); None when turned off."""
    env = os.environ if env is None else env
    chosen = env.get(ARCHIVE_ENV, "").strip()
    if chosen.lower() in OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(cache) / "walbus" / "jvm"


def java_binary(env: Mapping[str, str] | None = None) -> str | None:
    """The java that Spark's launcher runs: ``$JAVA_HOME/bin/java``, else the PATH's."""
    env = os.environ if env is None else env
    home = env.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java", path=env.get("PATH"))
    return os.path.realpath(found) if found and os.path.exists(found) else None


def _stat_line(path: str) -> str:
    st = os.stat(path)
    return f"{path}\0{st.st_size}\0{st.st_mtime_ns}"


def archive_key(java: str, settings: Mapping[str, str]) -> str:
    """A digest of what an archive is made from: the java binary, pyspark's jars, the
    connector packages and the driver's extra class path (each as names, sizes, times)."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    parts = [
        _stat_line(java),
        f"pyspark {pyspark.__version__}",
        f"delta-spark {importlib.metadata.version('delta-spark')}",
        f"packages {settings.get('spark.jars.packages', '')}",
        f"classpath {settings.get('spark.driver.extraClassPath', '')}",
        *(_stat_line(str(j)) for j in sorted(jars.glob("*.jar"))),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def archive_path(settings: Mapping[str, str], env: Mapping[str, str] | None = None) -> Path | None:
    """The archive for a driver JVM started with ``settings`` (it may not exist yet); None
    when archives are off or no java is found."""
    where = archive_dir(env)
    java = java_binary(env)
    if where is None or java is None:
        return None
    return where / f"spark-driver-{archive_key(java, settings)}{SUFFIX}"


def with_java_option(settings: Mapping[str, str], option: str) -> dict[str, str]:
    """``settings`` with ``option`` after the driver's own Java options (the user's kept)."""
    out = dict(settings)
    out[JAVA_OPTIONS] = f"{out[JAVA_OPTIONS]} {option}".strip() if out.get(JAVA_OPTIONS) else option
    return out


def map_option(archive: Path) -> str:
    return f"-XX:SharedArchiveFile={archive}"


def write_option(archive: Path) -> str:
    return f"-XX:ArchiveClassesAtExit={archive}"


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) readable by this user only."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
