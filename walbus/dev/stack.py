"""The local stack: one PostgreSQL and one Kafka broker, recorded in ``<state>/stack.json``."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from walbus.dev.kafka import KafkaInstance
from walbus.dev.postgres import PostgresInstance, wal2json_installed
from walbus.dev.processes import StackError, free_port

DEFAULT_STATE_DIR = Path(".walbus")


def default_state_dir() -> Path:
    return Path(os.environ.get("WALBUS_STATE_DIR", str(DEFAULT_STATE_DIR))).resolve()


@dataclass
class LocalStack:
    state_dir: Path
    postgres: PostgresInstance
    kafka: KafkaInstance

    @property
    def record(self) -> Path:
        return self.state_dir / "stack.json"

    @classmethod
    def load(cls, state_dir: Path | None = None) -> LocalStack:
        """The stack recorded in ``state_dir``, or a new one with free ports."""
        state_dir = (state_dir or default_state_dir()).resolve()
        record = state_dir / "stack.json"
        if record.exists():
            try:
                data: dict[str, Any] = json.loads(record.read_text())
                pg, kf = data["postgres"], data["kafka"]
                return cls(
                    state_dir,
                    PostgresInstance(state_dir, int(pg["port"]), pg.get("pid")),
                    KafkaInstance(state_dir, int(kf["port"]), int(kf["controller_port"]), kf.get("pid")),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise StackError(
                    f"{record} is unreadable ({e}): the state directory looks corrupt; "
                    f"remove {state_dir} (or run `walbus dev down --purge`) and retry"
                ) from None
        return cls(
            state_dir,
            PostgresInstance(state_dir, free_port()),
            KafkaInstance(state_dir, free_port(), free_port()),
        )

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "postgres": {"port": self.postgres.port, "pid": self.postgres.pid, "dsn": self.postgres.dsn},
            "kafka": {
                "port": self.kafka.port,
                "controller_port": self.kafka.controller_port,
                "pid": self.kafka.pid,
                "bootstrap": self.kafka.bootstrap,
            },
        }
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.record)

    def up(self) -> None:
        """Start whatever is not running yet (idempotent)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._reassign_ports_if_taken()
        self.postgres.init()
        self.postgres.start()
        self.save()
        self.kafka.start()
        self.save()

    def _reassign_ports_if_taken(self) -> None:
        # A stopped stack whose recorded port was taken meanwhile may move: nothing else points at it.
        from walbus.dev.processes import port_in_use

        if not self.postgres.running() and port_in_use(self.postgres.port):
            self.postgres.port = free_port()
        if not self.kafka.running():
            if port_in_use(self.kafka.port):
                self.kafka.port = free_port()
            if port_in_use(self.kafka.controller_port):
                self.kafka.controller_port = free_port()

    def down(self, *, purge: bool = False) -> list[str]:
        stopped = []
        if self.kafka.stop():
            stopped.append(f"kafka (pid {self.kafka.pid})")
        if self.postgres.stop():
            stopped.append(f"postgres (pid {self.postgres.pid})")
        self.kafka.pid = None
        self.postgres.pid = None
        if purge:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        elif self.state_dir.exists():
            self.save()
        return stopped

    def status(self) -> dict[str, Any]:
        return {
            "state_dir": str(self.state_dir),
            "postgres": {
                "running": self.postgres.running(),
                "pid": self.postgres.pid,
                "dsn": self.postgres.dsn,
                "socket_dsn": self.postgres.socket_dsn,
                "wal2json": wal2json_installed(),
                "log": str(self.postgres.logfile),
            },
            "kafka": {
                "running": self.kafka.running(),
                "pid": self.kafka.pid,
                "bootstrap": self.kafka.bootstrap,
                "log": str(self.kafka.logfile),
            },
        }

    def env(self) -> dict[str, str]:
        return {"WALBUS_PG_DSN": self.postgres.dsn, "WALBUS_KAFKA_BOOTSTRAP": self.kafka.bootstrap}
