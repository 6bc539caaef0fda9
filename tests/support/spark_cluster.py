"""A Spark standalone cluster on this host's loopback: a master and workers started with
``spark-class`` from PySpark's own install (its jars; no separate Spark download)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from walbus.app.dev.processes import free_port

LOOPBACK = "127.0.0.1"


def spark_home() -> Path:
    """PySpark's package directory: it holds bin/spark-class and jars/ like a Spark release."""
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass
class StandaloneCluster:
    """A running master and its workers (their process groups, killed by :meth:`stop`)."""

    master_url: str
    ui_port: int
    worker_ui_ports: list[int]
    logs: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def state(self, port: int | None = None) -> dict[str, Any]:
        """The master's (or a worker's, by UI port) JSON status page."""
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port or self.ui_port}/json/", timeout=5) as r:
            state: dict[str, Any] = json.load(r)
        return state

    def finished_app(self, name: str, timeout: float = 120) -> tuple[dict[str, Any], list[int]]:
        """The completed application ``name`` and each worker's count of its finished executors,
        once the master lists it and every worker has one (the driver's exit reaches the master
        and then the workers asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            apps = [a for a in self.state().get("completedapps", []) if a.get("name") == name]
            executors = [
                sum(e.get("appid") == a.get("id") for a in apps for e in self.state(port).get("finishedexecutors", []))
                for port in self.worker_ui_ports
            ]
            if (len(apps) == 1 and all(executors)) or time.monotonic() > deadline:
                return (apps[0] if len(apps) == 1 else {"found": apps}), executors
            time.sleep(0.5)

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        for proc in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the JVM and its executors' JVMs
            proc.wait()


def _daemon_env() -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": LOOPBACK,
        "SPARK_DAEMON_MEMORY": "256m",
    }


def _start(cluster: StandaloneCluster, name: str, args: list[str]) -> None:
    with open(cluster.logs / f"{name}.log", "ab") as out:
        cluster.processes.append(
            subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args],
                stdout=out, stderr=subprocess.STDOUT, env=_daemon_env(), start_new_session=True,
            )
        )


def _alive_workers(cluster: StandaloneCluster) -> int:
    try:
        return sum(w.get("state") == "ALIVE" for w in cluster.state().get("workers", []))
    except OSError:  # the master's UI is not up yet
        return 0


@contextlib.contextmanager
def standalone_cluster(workdir: Path, *, workers: int = 2, cores: int = 1, memory: str = "1g",
                       timeout: float = 180) -> Iterator[StandaloneCluster]:
    """A master and ``workers`` workers of ``cores`` cores and ``memory`` each, all bound to
    loopback; yields once every worker has registered with the master."""
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cluster = StandaloneCluster(
        master_url=f"spark://{LOOPBACK}:{port}", ui_port=free_port(),
        worker_ui_ports=[free_port() for _ in range(workers)], logs=logs,
    )
    try:
        _start(cluster, "master", [
            "org.apache.spark.deploy.master.Master",
            "--host", LOOPBACK, "--port", str(port), "--webui-port", str(cluster.ui_port),
        ])
        for n, ui_port in enumerate(cluster.worker_ui_ports):
            _start(cluster, f"worker-{n}", [
                "org.apache.spark.deploy.worker.Worker",
                "--host", LOOPBACK, "--cores", str(cores), "--memory", memory,
                "--webui-port", str(ui_port), "--work-dir", str(workdir / f"worker-{n}"),
                cluster.master_url,
            ])
        deadline = time.monotonic() + timeout
        while _alive_workers(cluster) < workers:
            exited = [p.args for p in cluster.processes if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                raise RuntimeError(f"the Spark cluster did not come up (exited: {exited})\n{cluster.log_tail()}")
            time.sleep(0.5)
        yield cluster
    finally:
        cluster.stop()
