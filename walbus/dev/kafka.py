"""A local Apache Kafka broker (KRaft, one node as broker and controller) from Maven Central jars.

Why 3.9.x and not 4.x: the demux relies on aiokafka's transactional producer, whose
transaction requests (AddOffsetsToTxn/TxnOffsetCommit) still use protocol versions
that Kafka 4.0 removed (KIP-896); 3.9 is the newest line that serves every request
aiokafka sends, and it runs on Java 17.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from walbus.dev.processes import StackError, pid_alive, port_in_use, spawn, stop_pid, tail

KAFKA_VERSION = "3.9.1"
SCALA_VERSION = "2.13"
MAIN_CLASS = "kafka.Kafka"

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.walbus</groupId><artifactId>kafka-runtime</artifactId><version>1</version>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_{scala}</artifactId><version>{version}</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-reload4j</artifactId><version>1.7.36</version></dependency>
  </dependencies>
</project>
"""

_LOG4J = """log4j.rootLogger=INFO, file
log4j.appender.file=org.apache.log4j.FileAppender
log4j.appender.file.File={logfile}
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
log4j.logger.org.apache.kafka.controller=WARN
"""


def cache_dir() -> Path:
    base = os.environ.get("WALBUS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "walbus"
    )
    return Path(base) / f"kafka-{KAFKA_VERSION}"


def ensure_jars() -> Path:
    """Fetch the broker's jars once with Maven into the cache directory; return the libs dir."""
    libs = cache_dir() / "libs"
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if shutil.which("java") is None:
        raise StackError("`java` not found: install a Java 17+ runtime (e.g. `apt-get install openjdk-17-jre-headless`)")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("`mvn` not found: install Maven to fetch Kafka's jars (e.g. `apt-get install maven`)")
    work = cache_dir()
    work.mkdir(parents=True, exist_ok=True)
    (work / "pom.xml").write_text(_POM.format(scala=SCALA_VERSION, version=KAFKA_VERSION))
    tmp = work / "libs.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    res = subprocess.run(
        [mvn, "-q", "-B", "-f", str(work / "pom.xml"), "dependency:copy-dependencies",
         f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise StackError(f"Maven could not fetch Apache Kafka {KAFKA_VERSION}:\n{(res.stdout + res.stderr)[-2000:]}")
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    marker.write_text(KAFKA_VERSION)
    return libs


@dataclass
class KafkaInstance:
    """A KRaft broker+controller in ``<state>/kafka``."""

    state_dir: Path
    port: int
    controller_port: int
    pid: int | None = None

    @property
    def home(self) -> Path:
        return self.state_dir / "kafka"

    @property
    def datadir(self) -> Path:
        return self.home / "data"

    @property
    def logfile(self) -> Path:
        return self.home / "server.log"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def running(self) -> bool:
        return self.pid is not None and pid_alive(self.pid, str(self.home / "server.properties"))

    def _java(self) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise StackError("`java` not found: install a Java 17+ runtime (e.g. `apt-get install openjdk-17-jre-headless`)")
        libs = ensure_jars()
        return [java, "-cp", f"{libs}/*", f"-Dlog4j.configuration=file:{self.home / 'log4j.properties'}"]

    def write_config(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.datadir),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "auto.create.topics.enable": "false",
            "log.cleaner.enable": "true",
            "log.cleaner.backoff.ms": "1000",
            "group.initial.rebalance.delay.ms": "0",
            "message.max.bytes": "16777216",
            "transaction.max.timeout.ms": "900000",
        }
        (self.home / "server.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.home / "log4j.properties").write_text(_LOG4J.format(logfile=self.logfile))

    def format_storage(self) -> None:
        if (self.datadir / "meta.properties").exists():
            return
        if self.datadir.exists() and any(self.datadir.iterdir()):
            raise StackError(
                f"Kafka data directory {self.datadir} exists but was never formatted (no meta.properties): "
                f"it looks corrupt; remove {self.state_dir} (or run `walbus dev down --purge`) and retry"
            )
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        res = subprocess.run(
            [*self._java(), "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(self.home / "server.properties")],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise StackError(f"formatting Kafka storage failed: {(res.stdout + res.stderr).strip()[-1500:]}")

    def start(self, timeout: float = 90.0) -> None:
        if self.running():
            return
        for p in (self.port, self.controller_port):
            if port_in_use(p):
                raise StackError(f"port {p} on 127.0.0.1 is already in use; Kafka cannot listen there")
        self.write_config()
        self.format_storage()
        heap = os.environ.get("WALBUS_KAFKA_HEAP", "-Xms256m -Xmx1g").split()
        java = self._java()
        proc = spawn(
            [java[0], *heap, "-XX:+UseG1GC", *java[1:], MAIN_CLASS, str(self.home / "server.properties")],
            logfile=self.home / "stdout.log",
        )
        self.pid = proc.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"Kafka exited at start ({proc.returncode}); log {self.logfile}:\n{tail(self.logfile)}")
            if asyncio.run(broker_answers(self.bootstrap)):
                return
            time.sleep(0.3)
        raise StackError(f"Kafka did not answer metadata requests within {timeout:.0f}s; log {self.logfile}:\n{tail(self.logfile)}")

    def stop(self) -> bool:
        if self.pid is None:
            return False
        return stop_pid(self.pid, str(self.home / "server.properties"), timeout=60)


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
