"""What walbus keeps to start a driver JVM faster: the connector jars' list and a class archive.

A new driver JVM first has Ivy resolve the Delta and Kafka connector packages
(``spark.jars.packages``: ~1 s even when every jar is in Ivy's cache, and its classes'
start-up), then loads many thousands of Spark, Scala, Hadoop, Delta and Kafka classes as its
session starts and its first load plans and runs; a nightly ``warehouse load`` pays all of it
every night. ``walbus warehouse prepare`` (:mod:`warehouse.prepare`, run by scripts/setup.sh)
keeps two things in ``$WALBUS_SPARK_DRIVER_CACHE`` (a directory; default
``~/.cache/walbus/jvm``, 0700):

* **the resolved jars** of the packages (``jars-<digest>.txt``, one path a line): a driver
  with a ``local[…]`` master then puts them on its class path after Spark's own jars
  (``SPARK_DIST_CLASSPATH``, which Spark's launcher appends last, so a class Spark ships
  itself still comes from Spark's jar, as Spark's class loader gave parent-first before) and
  skips Ivy. Any other master keeps ``spark.jars.packages``: its executors get the jars from
  the driver that way;
* **a class-data archive** (``spark-driver-<digest>.jsa``): HotSpot's application class-data
  sharing (AppCDS, JDK 13 and later: ``-XX:ArchiveClassesAtExit`` writes the classes a JVM
  loaded from its class path as it exits, ``-XX:SharedArchiveFile`` maps them in a later
  one). Its name digests what it was made from (the java binary, pyspark's jars, the class
  path, the packages), so after an upgrade a JVM starts without one until ``prepare`` runs
  again; HotSpot checks an archive against the JVM and its class path as well and runs
  without it when they differ (a line in the Spark log): a stale archive costs its gain,
  never a load.

Measured on the 2-core machine (docs/warehouse.md, "Stop 45"), a whole ``walbus warehouse
load`` command in a new JVM: see there. ``WALBUS_SPARK_DRIVER_CACHE=off`` turns both off. A
driver that spark-submit started is left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import re
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

SUFFIX: Final = ".jsa"
CACHE_ENV: Final = "WALBUS_SPARK_DRIVER_CACHE"  # the cache's directory, or "off"
OFF: Final = frozenset({"off", "none", "false", "0"})
JAVA_OPTIONS: Final = "spark.driver.extraJavaOptions"
PACKAGES: Final = "spark.jars.packages"
# Spark's launcher appends this to the driver's class path, after Spark's own jars
DIST_CLASSPATH: Final = "SPARK_DIST_CLASSPATH"
# settings that change what Ivy resolves for the same packages: part of the jar list's name
_RESOLUTION_SETTINGS: Final = ("spark.jars.repositories", "spark.jars.excludes", "spark.jars.ivySettings")
_LOCAL_MASTER: Final = re.compile(r"local(\[[^\]]*\])?")


def cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the cache lives: ``$WALBUS_SPARK_DRIVER_CACHE``, else walbus' cache directory
    (``$XDG_CACHE_HOME/walbus/jvm``, ``~/.cache/walbus/jvm``); None when turned off."""
    env = os.environ if env is None else env
    chosen = env.get(CACHE_ENV, "").strip()
    if chosen.lower() in OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(cache) / "walbus" / "jvm"


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) readable by this user only. One that exists keeps its
    mode: it may be a directory the user chose (``WALBUS_SPARK_DRIVER_CACHE=/tmp`` made /tmp
    0700, for every user of the machine); but one that other users may write to is refused:
    what is kept there (the jar list, the class archive) is loaded by the driver JVM."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        if not path.is_dir():
            raise
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o022:
            from walbus.config import ConfigError

            raise ConfigError(
                f"the Spark driver cache {path} may be written by other users (mode {mode:o}), and the driver JVM "
                f"loads what is kept there: chmod go-w it, or set {CACHE_ENV} to a directory of your own"
            ) from None
        return path
    os.chmod(path, 0o700)  # mkdir's mode is cut by the umask
    return path


def remove_leftovers(where: Path) -> list[Path]:
    """Remove the temporary files of writers that died before renaming them (``<name>.<pid>.tmp``
    whose process is gone); the files removed."""
    removed = []
    for path in where.glob("*.tmp"):
        pid = path.suffixes[-2].lstrip(".") if len(path.suffixes) >= 2 else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def java_binary(env: Mapping[str, str] | None = None) -> str | None:
    """The java that Spark's launcher runs: ``$JAVA_HOME/bin/java``, else the PATH's."""
    env = os.environ if env is None else env
    home = env.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java", path=env.get("PATH"))
    return os.path.realpath(found) if found and os.path.exists(found) else None


def is_local(master: str | None) -> bool:
    """Whether ``master`` runs the executors inside the driver JVM."""
    return master is not None and _LOCAL_MASTER.fullmatch(master.strip()) is not None


def _digest(parts: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _stat_line(path: str) -> str:
    st = os.stat(path)
    return f"{path}\0{st.st_size}\0{st.st_mtime_ns}"


# --- the resolved jars ----------------------------------------------------------------------


def jars_path(settings: Mapping[str, str], env: Mapping[str, str] | None = None) -> Path | None:
    """The file that lists the jars Ivy resolved for ``settings``' packages (it may not exist)."""
    where = cache_dir(env)
    packages = settings.get(PACKAGES, "")
    if where is None or not packages:
        return None
    resolution = [packages, *(f"{k}={settings.get(k, '')}" for k in _RESOLUTION_SETTINGS)]
    return where / f"jars-{_digest(resolution)}.txt"


def resolved_jars(settings: Mapping[str, str], env: Mapping[str, str] | None = None) -> list[str] | None:
    """The jars a resolution of ``settings``' packages gave, when ``prepare`` kept them and
    every one is still there; else None (Ivy resolves them again)."""
    path = jars_path(settings, env)
    if path is None or not path.is_file():
        return None
    jars = [line for line in path.read_text().splitlines() if line]
    # a path with the class path's separator in it cannot be on a class path: Ivy, as before
    return jars if jars and all(os.path.isfile(j) and os.pathsep not in j for j in jars) else None


def save_jars(settings: Mapping[str, str], jars: Sequence[str], env: Mapping[str, str] | None = None) -> Path | None:
    """Keep the jars a resolution of ``settings``' packages gave (written whole, then renamed)."""
    path = jars_path(settings, env)
    if path is None:
        return None
    private_dir(path.parent)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text("".join(f"{j}\n" for j in jars))
    os.replace(temporary, path)
    return path


def jar_files(spark_jars: str) -> list[str]:
    """The local files of a ``spark.jars`` value (``file:`` URIs or paths, comma-separated)."""
    out = []
    for item in spark_jars.split(","):
        item = item.strip()
        if item.startswith("file:"):
            item = re.sub(r"^file:(//)?", "", item)
        if item:
            out.append(item)
    return out


# --- the class archive ----------------------------------------------------------------------


def archive_stem(settings: Mapping[str, str], classpath: str = "", env: Mapping[str, str] | None = None) -> Path | None:
    """The class archive of a driver JVM started with ``settings`` and ``classpath`` appended,
    without its size (:func:`archive_file`); None when the cache is off or no java is found."""
    import pyspark

    where = cache_dir(env)
    java = java_binary(env)
    if where is None or java is None:
        return None
    entries = [e for e in (settings.get("spark.driver.extraClassPath", "") + ":" + classpath).split(":") if e]
    jars = sorted((Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    parts = [
        _stat_line(java),
        f"pyspark {pyspark.__version__}",
        f"delta-spark {importlib.metadata.version('delta-spark')}",
        f"packages {settings.get(PACKAGES, '')}",
        *(_stat_line(e) if os.path.isfile(e) else e for e in entries),
        *(_stat_line(str(j)) for j in jars),
    ]
    return where / f"spark-driver-{_digest(parts)}"


def archive_file(stem: Path, size: int) -> Path:
    """An archive's file: its stem and its size in bytes. A JVM that maps an archive shorter
    than its header says dies of SIGBUS (HotSpot 17 reads past the end), so only a file
    whose size is the one it was written with is ever mapped."""
    return stem.with_name(f"{stem.name}-{size}{SUFFIX}")


def find_archive(stem: Path | None) -> Path | None:
    """The archive written for ``stem`` whose size is still the one it was written with."""
    if stem is None or not stem.parent.is_dir():
        return None
    for path in stem.parent.glob(f"{stem.name}-*{SUFFIX}"):
        size = path.name[len(stem.name) + 1:-len(SUFFIX)]
        with contextlib.suppress(OSError):
            if size.isdigit() and path.is_file() and path.stat().st_size == int(size):
                return path
    return None


def java_option_word(option: str) -> str:
    """``option`` as one word of Spark's Java options string: quoted when it holds blanks,
    quotes or backslashes (a cache or log path under a home directory with a space), as
    Spark's launcher splits that string."""
    if not re.search(r"[\s'\"\\]", option):
        return option
    return '"' + option.replace("\\", "\\\\").replace('"', '\\"') + '"'


def with_java_option(settings: Mapping[str, str], option: str) -> dict[str, str]:
    """``settings`` with ``option`` (one JVM option, quoted as needed) after the driver's own
    Java options (the user's kept)."""
    out = dict(settings)
    word = java_option_word(option)
    out[JAVA_OPTIONS] = f"{out[JAVA_OPTIONS]} {word}".strip() if out.get(JAVA_OPTIONS) else word
    return out


# --- a launch -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """How walbus starts a driver JVM: its settings, the class path appended after Spark's
    jars (``SPARK_DIST_CLASSPATH``; empty: none) and the class archive it maps or writes."""

    settings: dict[str, str]
    classpath: str = ""
    archive: Path | None = None

    @property
    def cached(self) -> bool:
        return bool(self.classpath) or self.archive is not None


def _without_ivy(settings: Mapping[str, str], master: str | None, env: Mapping[str, str] | None) -> Launch:
    jars = resolved_jars(settings, env) if is_local(master) else None
    if jars is None:
        return Launch(dict(settings))
    return Launch({k: v for k, v in settings.items() if k != PACKAGES}, ":".join(jars))


def archive_for(settings: Mapping[str, str], master: str | None, env: Mapping[str, str] | None = None) -> Path | None:
    """The stem of the class archive a driver JVM started with ``settings`` and ``master``
    would map (:func:`find_archive` finds it)."""
    launch = _without_ivy(settings, master, env)
    return archive_stem(launch.settings, launch.classpath, env)


def plan_launch(
    settings: Mapping[str, str], master: str | None, *, archive_output: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Launch:
    """The launch of a driver JVM with ``settings``: Ivy skipped where the jars are known, the
    class archive mapped when there is one (or, with ``archive_output``, written there as the
    JVM exits). A mapped archive's checksums are verified (``-XX:+VerifySharedSpaces``: a
    damaged one is not used, ~0.1 s)."""
    launch = _without_ivy(settings, master, env)
    if archive_output is not None:
        return Launch(with_java_option(launch.settings, f"-XX:ArchiveClassesAtExit={archive_output}"),
                      launch.classpath, archive_output)
    archive = find_archive(archive_stem(launch.settings, launch.classpath, env))
    if archive is None:
        return launch
    mapped = with_java_option(with_java_option(launch.settings, "-XX:+VerifySharedSpaces"), f"-XX:SharedArchiveFile={archive}")
    return Launch(mapped, launch.classpath, archive)
