"""A local Apache Kafka cluster (KRaft) from Maven Central jars.

One node by default (broker and controller in one process); ``--brokers 3`` runs three
nodes that are each broker and controller: a controller quorum of 3 next to 3 replicas,
so that losing any one process (kill -9 of a partition leader, a rolling restart) keeps
both the metadata quorum and every partition's in-sync majority. One controller beside
3 brokers would make that controller a single point of failure for leader elections.

The default is the newest Kafka 4.x on Maven Central. 3.9.x still works
(``--kafka-version 3.9.1``): aiokafka's transaction requests, idempotent batches and
read_committed fetches are served by both (KIP-896 removed none of the versions it
sends). Kafka 4 logs through log4j2; 3.x through reload4j: each gets its binding and
its logging config.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from walbus.app.dev.processes import (
    StackError,
    pid_alive,
    port_in_use,
    signals_deferred,
    spawn,
    stop_pid,
    tail,
)

if TYPE_CHECKING:
    from collections.abc import Callable

KAFKA_VERSION = "4.4.0"
# The last 3.x line: what the local stack ran before 4.x, kept working and tested.
KAFKA_3_VERSION = "3.9.1"
SCALA_VERSION = "2.13"
MAIN_CLASS = "kafka.Kafka"
# Broker counts `walbus dev up --brokers` accepts: a single node, or a quorum of 3.
BROKER_COUNTS = (1, 3)

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.walbus</groupId><artifactId>kafka-runtime</artifactId><version>1</version>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_{scala}</artifactId><version>{version}</version></dependency>
    {binding}
  </dependencies>
</project>
"""

# Kafka 3.x logs through slf4j 1.7 + reload4j (log4j 1 syntax) ...
_BINDING_3 = "<dependency><groupId>org.slf4j</groupId><artifactId>slf4j-reload4j</artifactId><version>1.7.36</version></dependency>"
_LOG4J = """log4j.rootLogger=INFO, file
log4j.appender.file=org.apache.log4j.FileAppender
log4j.appender.file.File={logfile}
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
log4j.logger.org.apache.kafka.controller=WARN
"""
# ... Kafka 4.x through slf4j 1.7 + log4j2 (its distribution ships log4j-slf4j-impl).
_BINDING_4 = (
    "<dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId>"
    "<version>2.24.3</version></dependency>"
)
_LOG4J2 = """status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {logfile}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
logger.controller.name = org.apache.kafka.controller
logger.controller.level = WARN
"""


def major(version: str) -> int:
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        raise StackError(f"Kafka version {version!r} is not a version number like {KAFKA_VERSION}") from None


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_VERSION = re.compile(r"[0-9]+(\.[0-9]+){1,3}\Z")


def check_version(version: str) -> str:
    """A plain dotted version (it names a cache directory: nothing like ``../x`` may get there)."""
    if not _VERSION.match(version):
        raise StackError(f"Kafka version {version!r} is not a version number like {KAFKA_VERSION}")
    return version


def cache_dir(version: str = KAFKA_VERSION) -> Path:
    check_version(version)
    base = os.environ.get("WALBUS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "walbus"
    )
    return Path(base) / f"kafka-{version}"


def ensure_jars(version: str = KAFKA_VERSION) -> Path:
    """Fetch the broker's jars once with Maven into the cache directory; return the libs dir."""
    libs = cache_dir(version) / "libs"
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if shutil.which("java") is None:
        raise StackError("`java` not found: install a Java 17+ runtime (e.g. `apt-get install openjdk-17-jre-headless`)")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("`mvn` not found: install Maven to fetch Kafka's jars (e.g. `apt-get install maven`)")
    work = cache_dir(version)
    work.mkdir(parents=True, exist_ok=True)
    binding = _BINDING_4 if major(version) >= 4 else _BINDING_3
    (work / "pom.xml").write_text(_POM.format(scala=SCALA_VERSION, version=version, binding=binding))
    tmp = work / "libs.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    res = subprocess.run(
        [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(work / "pom.xml"), "dependency:copy-dependencies",
         f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)  # a version that does not exist leaves no cache entry
        # Maven 3.8 sends colour codes even with style.color=never (a reset before each line).
        text = _ANSI.sub("", res.stdout + res.stderr)
        raise StackError(f"Maven could not fetch Apache Kafka {version}:\n{text[-2000:]}")
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    marker.write_text(version)
    return libs


@dataclass
class KafkaInstance:
    """One KRaft node, broker and controller, in ``<state>/kafka`` (node 1) or ``<state>/kafka-<n>``.

    ``voters`` is the controller quorum (``id@host:port,...``); empty: this node alone.
    ``cluster_size`` sets the replication of Kafka's internal topics (offsets, transactions).
    """

    state_dir: Path
    port: int
    controller_port: int
    pid: int | None = None
    version: str = KAFKA_VERSION
    node_id: int = 1
    voters: str = ""
    cluster_size: int = 1
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def home(self) -> Path:
        return self.state_dir / ("kafka" if self.node_id == 1 else f"kafka-{self.node_id}")

    @property
    def datadir(self) -> Path:
        return self.home / "data"

    @property
    def logfile(self) -> Path:
        return self.home / "server.log"

    @property
    def stdout_log(self) -> Path:
        return self.home / "stdout.log"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def marker(self) -> str:
        """What this node's command line holds (guards PID checks against PID reuse)."""
        return str(self.home / "server.properties")

    def running(self) -> bool:
        return self.pid is not None and pid_alive(self.pid, self.marker)

    def _java(self) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise StackError("`java` not found: install a Java 17+ runtime (e.g. `apt-get install openjdk-17-jre-headless`)")
        libs = ensure_jars(self.version)
        if major(self.version) >= 4:
            logging = f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}"
        else:
            logging = f"-Dlog4j.configuration=file:{self.home / 'log4j.properties'}"
        return [java, "-cp", f"{libs}/*", logging]

    def write_config(self) -> None:
        # Its data is every CDC record: no other user's (the state dir is 0711 when PostgreSQL
        # runs as another user, and the segments are 0644). A home an older walbus made is closed too.
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.home.chmod(0o700)
        # Kafka's internal topics (group offsets, transaction state) replicated like walbus's own.
        internal_rf = "3" if self.cluster_size >= 3 else "1"
        internal_min_isr = "2" if self.cluster_size >= 3 else "1"
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters or f"{self.node_id}@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.datadir),
            "num.partitions": "1",
            "offsets.topic.replication.factor": internal_rf,
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": internal_rf,
            "transaction.state.log.min.isr": internal_min_isr,
            "transaction.state.log.num.partitions": "4",
            "auto.create.topics.enable": "false",
            "log.cleaner.enable": "true",
            "log.cleaner.backoff.ms": "1000",
            "group.initial.rebalance.delay.ms": "0",
            "message.max.bytes": "16777216",
            "replica.fetch.max.bytes": "16777216",
            "transaction.max.timeout.ms": "900000",
        }
        (self.home / "server.properties").write_text("".join(f"{k}={properties_value(v)}\n" for k, v in props.items()), "ascii")
        logfile = properties_value(str(self.logfile))
        (self.home / "log4j.properties").write_text(_LOG4J.format(logfile=logfile), "ascii")
        (self.home / "log4j2.properties").write_text(_LOG4J2.format(logfile=logfile), "ascii")

    def formatted(self) -> bool:
        return (self.datadir / "meta.properties").exists()

    def cluster_id(self) -> str | None:
        """The cluster id this node's storage was formatted with, if it was."""
        try:
            lines = (self.datadir / "meta.properties").read_text().splitlines()
        except FileNotFoundError:
            return None
        for line in lines:
            if line.startswith("cluster.id="):
                return line.split("=", 1)[1].strip()
        return None

    def format_storage(self, cluster_id: str | None = None) -> None:
        if self.formatted():
            return
        if self.datadir.exists() and any(self.datadir.iterdir()):
            raise StackError(
                f"Kafka data directory {self.datadir} exists but was never formatted (no meta.properties): "
                f"it looks corrupt; remove {self.state_dir} (or run `walbus dev down --purge`) and retry"
            )
        cluster_id = cluster_id or new_cluster_id()
        res = subprocess.run(
            [*self._java(), "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", self.marker],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise StackError(f"formatting Kafka storage failed: {(res.stdout + res.stderr).strip()[-1500:]}")

    def launch(self, cluster_id: str | None = None, on_spawn: Callable[[], None] | None = None) -> None:
        """Start the process (without waiting for it to answer); a running node is left alone.
        ``on_spawn`` runs once its PID is known."""
        if self.running():
            return
        for p in (self.port, self.controller_port):
            if port_in_use(p):
                raise StackError(f"port {p} on 127.0.0.1 is already in use; Kafka cannot listen there")
        self.write_config()
        self.format_storage(cluster_id)
        heap = os.environ.get("WALBUS_KAFKA_HEAP", "-Xms256m -Xmx1g").split()
        java = self._java()
        with signals_deferred():  # a Ctrl-C waits until the new PID is known (and recorded)
            self._proc = spawn(
                [java[0], *heap, "-XX:+UseG1GC", *java[1:], MAIN_CLASS, self.marker],
                logfile=self.stdout_log,
            )
            self.pid = self._proc.pid
            if on_spawn is not None:
                on_spawn()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                # The JVM's own start errors (a bad heap option, a missing class) go to stdout.log.
                raise StackError(
                    f"Kafka exited at start ({self._proc.returncode}); log {self.logfile}:\n{tail(self.logfile)}\n"
                    f"its output {self.stdout_log}:\n{tail(self.stdout_log)}"
                )
            if asyncio.run(broker_answers(self.bootstrap)):
                return
            time.sleep(0.3)
        raise StackError(f"Kafka did not answer metadata requests within {timeout:.0f}s; log {self.logfile}:\n{tail(self.logfile)}")

    def start(self, timeout: float = 90.0) -> None:
        if self.running():
            return
        self.launch()
        self.wait_ready(timeout)

    def stop(self) -> bool:
        if self.pid is None:
            return False
        return stop_pid(self.pid, self.marker, timeout=60)

    def signal_stop(self) -> None:
        """SIGTERM without waiting (the start of a shutdown; :meth:`stop` waits for it)."""
        if self.pid is not None and self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)


def properties_value(value: str) -> str:
    """``value`` for a Java .properties file, which Java reads as ISO-8859-1: each character
    outside printable ASCII as a \\uXXXX escape (a state directory named "ü" sent Kafka's
    data to "Ã¼"), backslashes doubled."""
    out = []
    for ch in value.replace("\\", "\\\\"):
        if " " <= ch < "\x7f":
            out.append(ch)
        else:  # UTF-16 code units, as Java's own \\u escapes
            units = ch.encode("utf-16-be")
            out += [f"\\u{int.from_bytes(units[i:i + 2], 'big'):04x}" for i in range(0, len(units), 2)]
    return "".join(out)


def new_cluster_id() -> str:
    """A random KRaft cluster id. Never one that starts with '-': the storage tool would take
    it for an option and refuse to format (as Kafka's own Uuid.randomUuid, it draws again)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


@dataclass
class KafkaCluster:
    """The stack's Kafka: one node, or three that are each broker and controller (see the module doc)."""

    nodes: list[KafkaInstance]

    @classmethod
    def create(cls, state_dir: Path, ports: list[tuple[int, int]], version: str = KAFKA_VERSION) -> KafkaCluster:
        """Nodes 1..N on the given (port, controller_port) pairs, all voters of one quorum."""
        voters = ",".join(f"{i}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports, start=1)) if len(ports) > 1 else ""
        return cls([
            KafkaInstance(state_dir, p, c, version=version, node_id=i, voters=voters, cluster_size=len(ports))
            for i, (p, c) in enumerate(ports, start=1)
        ])

    @property
    def version(self) -> str:
        return self.nodes[0].version

    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def pid(self) -> int | None:
        return self.nodes[0].pid

    @property
    def logfile(self) -> Path:
        return self.nodes[0].logfile

    def running(self) -> bool:
        return all(n.running() for n in self.nodes)

    def start(self, timeout: float = 120.0, on_spawn: Callable[[], None] | None = None) -> None:
        """Launch every node first: a node of a quorum answers only once a majority runs.
        ``on_spawn`` runs as each node's PID is known."""
        if self.running():
            return
        ids = {cid for n in self.nodes if (cid := n.cluster_id()) is not None}
        if len(ids) > 1:
            raise StackError(
                f"the Kafka nodes in {self.nodes[0].state_dir} were formatted for different clusters {sorted(ids)}: "
                f"remove {self.nodes[0].state_dir} (or run `walbus dev down --purge`) and retry"
            )
        cluster_id = ids.pop() if ids else new_cluster_id()
        for node in self.nodes:
            node.launch(cluster_id, on_spawn)
        for node in self.nodes:
            node.wait_ready(timeout)

    def stop(self) -> list[int]:
        """Stop every node; the PIDs of those that were running.

        All nodes are signalled before any is waited for: stopped one after the other, the
        last one's controlled shutdown waits for a controller quorum that is already gone
        (until SIGKILL, a minute later).
        """
        running = [n for n in self.nodes if n.pid is not None and n.running()]
        for node in running:
            node.signal_stop()
        for node in running:
            node.stop()
        return [n.pid for n in running if n.pid is not None]


async def broker_answers(bootstrap: str, timeout: float = 3.0) -> bool:
    """True when the broker answers a metadata request."""
    import logging

    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError

    # While the broker boots, aiokafka logs every refused connection: that is expected here.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout)
        await asyncio.wait_for(admin.list_topics(), timeout)
        return True
    except (KafkaError, OSError, TimeoutError):
        return False
    finally:
        await admin.close()
