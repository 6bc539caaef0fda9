"""The local stack: one PostgreSQL and a Kafka cluster (1 or 3 nodes), recorded in ``<state>/stack.json``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from walbus.app.dev import state
from walbus.app.dev.kafka import (
    BROKER_COUNTS,
    KAFKA_3_VERSION,
    KAFKA_VERSION,
    KafkaCluster,
    KafkaInstance,
    check_version,
    ensure_jars,
)
from walbus.app.dev.postgres import PostgresInstance, wal2json_installed, write_private
from walbus.app.dev.processes import StackError, free_port, signals_deferred, stop_by_argument
from walbus.app.dev.state import make_state_dir
from walbus.logs import redact_dsn

DEFAULT_STATE_DIR = Path(".walbus")


def default_state_dir() -> Path:
    """``WALBUS_DEV_STATE_DIR``, else the deprecated ``WALBUS_STATE_DIR``, else ``./.walbus``."""
    own = os.environ.get("WALBUS_DEV_STATE_DIR")
    shared = os.environ.get("WALBUS_STATE_DIR")
    if not own and shared:
        logging.getLogger("walbus.dev").warning(
            "WALBUS_STATE_DIR is deprecated for `walbus dev`: set WALBUS_DEV_STATE_DIR (the demux reads "
            "WALBUS_DEMUX_STATE_DIR)", extra={"deprecated_env": "WALBUS_STATE_DIR", "use_env": "WALBUS_DEV_STATE_DIR"},
        )
    return Path(own or shared or str(DEFAULT_STATE_DIR)).resolve()


class CorruptState(StackError):
    """stack.json cannot be read: `walbus dev down --purge` still cleans up (by command lines)."""


@dataclass
class LocalStack:
    state_dir: Path
    postgres: PostgresInstance
    kafka: KafkaCluster

    @property
    def record(self) -> Path:
        return self.state_dir / "stack.json"

    @classmethod
    def load(cls, state_dir: Path | None = None, *, kafka_version: str | None = None, brokers: int | None = None) -> LocalStack:
        """The stack recorded in ``state_dir``, or a new one with free ports.

        ``kafka_version`` and ``brokers`` choose a new stack's Kafka; for a recorded stack
        they must match what it was created with (its data was formatted for that).
        """
        state_dir = (state_dir or default_state_dir()).resolve()
        record = state_dir / state.RECORD
        if kafka_version is not None:
            check_version(kafka_version)
        if not record.exists():
            n = brokers or 1
            if n not in BROKER_COUNTS:
                raise StackError(f"--brokers must be one of {', '.join(map(str, BROKER_COUNTS))}, got {n}")
            ports = [(free_port(), free_port()) for _ in range(n)]
            return cls(state_dir, PostgresInstance(state_dir, free_port()), KafkaCluster.create(state_dir, ports, kafka_version or KAFKA_VERSION))
        try:
            data: dict[str, Any] = json.loads(record.read_text())
            pg = data["postgres"]
            stack = cls(state_dir, PostgresInstance(state_dir, int(pg["port"]), pg.get("pid")), _load_kafka(state_dir, data["kafka"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptState(
                f"{record} is unreadable ({e}): the state directory looks corrupt; "
                f"`walbus dev down --purge --state-dir {state_dir}` and retry"
            ) from None
        kafka = stack.kafka
        if (kafka_version and kafka_version != kafka.version) or (brokers and brokers != len(kafka.nodes)):
            raise StackError(
                f"the stack in {state_dir} runs Kafka {kafka.version} on {len(kafka.nodes)} node(s); "
                f"to change that, `walbus dev down --purge` it first or use another --state-dir"
            )
        return stack

    def save(self) -> None:
        make_state_dir(self.state_dir)
        first = self.kafka.nodes[0]
        data = {
            "postgres": {"port": self.postgres.port, "pid": self.postgres.pid, "dsn": self.postgres.dsn},
            "kafka": {
                # Node 1 at the top level, as before multi-node stacks: older readers still work.
                "port": first.port,
                "controller_port": first.controller_port,
                "pid": first.pid,
                "bootstrap": self.kafka.bootstrap,
                "version": self.kafka.version,
                "nodes": [
                    {"node_id": n.node_id, "port": n.port, "controller_port": n.controller_port, "pid": n.pid}
                    for n in self.kafka.nodes
                ],
            },
        }
        tmp = self.record.with_suffix(".tmp")
        write_private(tmp, json.dumps(data, indent=2))  # it holds the DSN with the password
        tmp.replace(self.record)

    def up(self) -> None:
        """Start whatever is not running yet (idempotent).

        Failed or interrupted (Ctrl-C, SIGTERM as SystemExit), it stops the servers it launched:
        each PID is recorded as soon as it is known, and the servers are also found by their
        command lines, so none is left running unrecorded.
        """
        state.check_state_dir(self.state_dir)
        if not self.kafka.running():
            # Before any state: a version Maven does not know leaves nothing behind.
            ensure_jars(self.kafka.version)
        make_state_dir(self.state_dir)
        state.check_unclaimed(self.state_dir)
        self._reassign_ports_if_taken()
        launch_pg = not self.postgres.running()
        launch_kafka = [n for n in self.kafka.nodes if not n.running()]
        self.save()  # first: whatever walbus puts here next, stack.json marks the directory as its own
        try:
            self.postgres.init()
            self.postgres.start(on_spawn=self.save)
            self.save()
            self.kafka.start(on_spawn=self.save)
            self.save()
        except BaseException:
            with signals_deferred(redeliver=False):
                self._stop_launched(launch_pg, launch_kafka)
            raise

    def _stop_launched(self, postgres: bool, kafka: list[KafkaInstance]) -> None:
        for node in kafka:
            node.signal_stop()
        for node in kafka:
            node.stop()
            stop_by_argument(node.marker, timeout=60)  # spawned, but interrupted before its PID was kept
            node.pid = None
        if postgres:
            self.postgres.stop()
            stop_by_argument(str(self.postgres.datadir), sig=signal.SIGINT)
            self.postgres.pid = None
        with contextlib.suppress(OSError):
            self.save()

    def _reassign_ports_if_taken(self) -> None:
        # A stopped stack whose recorded port was taken meanwhile may move: nothing else points at it.
        from walbus.app.dev.processes import port_in_use

        if not self.postgres.running() and port_in_use(self.postgres.port):
            self.postgres.port = free_port()
        if not any(n.running() for n in self.kafka.nodes):
            # All nodes at once: the quorum's voters name every node's controller port.
            ports = [(n.port, n.controller_port) for n in self.kafka.nodes]
            if any(port_in_use(p) for pair in ports for p in pair):
                ports = [(free_port(), free_port()) for _ in ports]
                fresh = KafkaCluster.create(self.state_dir, ports, self.kafka.version)
                self.kafka = fresh

    def down(self, *, purge: bool = False, remove_dir: bool = True) -> list[str]:
        """Stop both; ``purge``: also delete walbus's files in the state directory (and the
        directory, when ``remove_dir`` and nothing else is left in it)."""
        if purge and self.state_dir.exists() and not self.record.is_file():
            state.purge(self.state_dir)  # refuses: checked before anything is stopped
        stopped = []
        pids = self.kafka.stop()
        if pids:
            stopped.append(f"kafka (pid {', '.join(map(str, pids))})")
        if self.postgres.stop():
            stopped.append(f"postgres (pid {self.postgres.pid})")
        for node in self.kafka.nodes:
            node.pid = None
        self.postgres.pid = None
        if purge:
            others = state.stop_unrecorded(self.state_dir)
            if others:
                stopped.append(f"unrecorded servers (pid {', '.join(map(str, others))})")
            state.purge(self.state_dir, remove_dir=remove_dir)
        elif self.record.is_file():  # never a stack.json in a directory walbus did not set up
            self.save()
        return stopped

    def status(self) -> dict[str, Any]:
        return {
            "state_dir": str(self.state_dir),
            "postgres": {
                "running": self.postgres.running(),
                "pid": self.postgres.pid,
                "dsn": redact_dsn(self.postgres.dsn),  # `walbus dev env` alone prints the password
                "socket_dsn": self.postgres.socket_dsn,
                "wal2json": wal2json_installed(),
                "log": str(self.postgres.logfile),
            },
            "kafka": {
                "running": self.kafka.running(),
                "pid": self.kafka.pid,
                "bootstrap": self.kafka.bootstrap,
                "version": self.kafka.version,
                "log": str(self.kafka.logfile),
                "nodes": [
                    {"node_id": n.node_id, "running": n.running(), "pid": n.pid, "bootstrap": n.bootstrap, "log": str(n.logfile)}
                    for n in self.kafka.nodes
                ],
            },
        }

    def env(self) -> dict[str, str]:
        """The running stack's endpoints as env vars; a StackError when it does not run (printed
        endpoints of a stopped stack would send every command to a dead port)."""
        if not (self.postgres.running() and self.kafka.running()):
            raise StackError(f"no local stack runs in {self.state_dir}: `walbus dev up` first")
        return {"WALBUS_PG_DSN": self.postgres.dsn, "WALBUS_KAFKA_BOOTSTRAP": self.kafka.bootstrap}


def purge_unreadable(state_dir: Path) -> list[int]:
    """`down --purge` of a state directory whose stack.json cannot be read: its servers are
    found by their command lines. The PIDs stopped."""
    if state_dir.is_dir() and not (state_dir / state.RECORD).is_file():
        state.purge(state_dir)  # refuses
    stopped = state.stop_unrecorded(state_dir)
    state.purge(state_dir)
    return stopped


def _load_kafka(state_dir: Path, kf: dict[str, Any]) -> KafkaCluster:
    # A record without a version is from before 4.x: its data was formatted by 3.9.1.
    version = str(kf.get("version") or KAFKA_3_VERSION)
    nodes = kf.get("nodes") or [{"node_id": 1, "port": kf["port"], "controller_port": kf["controller_port"], "pid": kf.get("pid")}]
    cluster = KafkaCluster.create(state_dir, [(int(n["port"]), int(n["controller_port"])) for n in nodes], version)
    for node, recorded in zip(cluster.nodes, nodes, strict=True):
        if int(recorded["node_id"]) != node.node_id:
            raise ValueError(f"kafka node ids out of order: {[n['node_id'] for n in nodes]}")
        node.pid = recorded.get("pid")
    return cluster
