"""The services are real: PostgreSQL with logical decoding, a durable Kafka broker, log compaction."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from aiokafka import AIOKafkaProducer

from tests.support.kafka import read_topic
from tests.support.services import Services
from walbus.app.dev.kafka import KafkaInstance
from walbus.app.dev.processes import free_port, pid_alive
from walbus.kafka import KafkaAdmin, TopicSpec

pytestmark = pytest.mark.integration


def test_postgres_logical_replication_connection(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        conn.execute("CREATE TABLE t (id int primary key, v text)")
        conn.execute("INSERT INTO t VALUES (1, 'één')")
        assert conn.execute("SELECT v FROM t WHERE id = 1").fetchone() == ("één",)
    with psycopg.connect(pg_dsn, autocommit=True, replication="database") as repl:
        row = repl.execute("IDENTIFY_SYSTEM").fetchone()
        assert row is not None and "/" in row[2]  # xlogpos


async def test_kafka_produce_and_consume(services: Services, unique_name: str) -> None:
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": services.kafka_bootstrap}) as admin:
        assert await admin.ensure_topic(TopicSpec(unique_name)) is True
        assert await admin.ensure_topic(TopicSpec(unique_name)) is False
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for i in range(100):
            await producer.send(unique_name, key=b"k%d" % i, value=b"v%d" % i)
        await producer.flush()
    finally:
        await producer.stop()
    records = await read_topic(services.kafka_bootstrap, unique_name, min_count=100)
    assert records == [(b"k%d" % i, b"v%d" % i) for i in range(100)]


async def test_ensure_topic_returns_once_the_topic_is_described(services: Services, unique_name: str) -> None:
    """Callers ask a new topic's partitions at once; right after CreateTopics the metadata may lag."""
    names = [f"{unique_name}.{i}" for i in range(30)]
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": services.kafka_bootstrap}) as admin:
        for name in names:
            assert await admin.ensure_topic(TopicSpec(name, partitions=3)) is True
            assert await admin.partitions(name) == 3
        await admin.delete_topics(names)


def test_kafka_restart_keeps_data() -> None:
    """A dedicated broker (not the session's): stop it, start it again, read the data back."""
    state = Path(tempfile.mkdtemp(prefix="walbus-durable-"))
    broker = KafkaInstance(state, free_port(), free_port())
    try:
        broker.start()

        async def write() -> None:
            async with KafkaAdmin(client_kwargs={"bootstrap_servers": broker.bootstrap}) as admin:
                await admin.ensure_topic(TopicSpec("durable"))
            producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
            await producer.start()
            try:
                for i in range(50):
                    await producer.send_and_wait("durable", key=b"%d" % i, value=b"x" * i)
            finally:
                await producer.stop()

        asyncio.run(write())
        pid = broker.pid
        assert pid is not None and broker.stop()
        assert not pid_alive(pid, str(broker.home))
        broker.start()
        assert broker.pid != pid
        records = asyncio.run(read_topic(broker.bootstrap, "durable", min_count=50))
        assert records == [(b"%d" % i, b"x" * i) for i in range(50)]
    finally:
        broker.stop()
        shutil.rmtree(state, ignore_errors=True)


def test_a_brokers_files_are_closed_to_other_users() -> None:
    """Kafka's home was 0755 and its segments 0644 under a 0711 state directory: any local
    user read every CDC record by path. A home an older walbus made (0755) is closed at start."""
    state = Path(tempfile.mkdtemp(prefix="walbus-private-"))
    state.chmod(0o711)  # as when PostgreSQL runs as another user
    broker = KafkaInstance(state, free_port(), free_port())
    broker.home.mkdir(mode=0o755)
    broker.home.chmod(0o755)
    umask = os.umask(0o022)
    try:
        broker.start()
        assert broker.home.stat().st_mode & 0o777 == 0o700
        assert sorted(p.name for p in state.iterdir()) == [broker.home.name]  # nothing of Kafka's beside it
    finally:
        os.umask(umask)
        broker.stop()
        shutil.rmtree(state, ignore_errors=True)


async def test_log_compaction_keeps_latest_value_per_key(services: Services, unique_name: str) -> None:
    configs = (
        ("cleanup.policy", "compact"),
        ("segment.ms", "100"),
        ("min.cleanable.dirty.ratio", "0.01"),
        ("delete.retention.ms", "100"),
        ("min.compaction.lag.ms", "0"),
    )
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": services.kafka_bootstrap}) as admin:
        await admin.ensure_topic(TopicSpec(unique_name, configs=configs))
        assert (await admin.topic_config(unique_name, ["cleanup.policy"]))["cleanup.policy"] == "compact"
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for round_ in range(5):
            for k in range(10):
                await producer.send(unique_name, key=b"key-%d" % k, value=b"round-%d" % round_)
            await producer.flush()
            await asyncio.sleep(0.15)  # let segments roll, so that older ones become cleanable
        for k in range(3):  # tombstones
            await producer.send(unique_name, key=b"key-%d" % k, value=None)
        await producer.flush()
        deadline = time.monotonic() + 120
        expected = {b"key-%d" % k: b"round-4" for k in range(3, 10)}
        while True:
            # Rolling the active segment needs a new record after segment.ms.
            await asyncio.sleep(0.3)
            await producer.send_and_wait(unique_name, key=b"filler", value=b"f")
            records = await read_topic(services.kafka_bootstrap, unique_name)
            live = [(k, v) for k, v in records if k != b"filler"]
            if len(live) == len(expected) and dict(live) == expected:
                break
            assert time.monotonic() < deadline, f"compaction did not converge: {len(live)} records left"
    finally:
        await producer.stop()
    assert sorted(k for k, _ in live) == sorted(expected)


def test_dev_cli_up_status_down_twice() -> None:
    state = Path(tempfile.mkdtemp(prefix="walbus-cli-"))
    walbus = [sys.executable, "-m", "walbus.app.cli", "dev", "--state-dir", str(state)]
    pids: list[str] = []
    try:
        for _ in range(2):
            up = subprocess.run([*walbus, "up"], capture_output=True, text=True, timeout=180)
            assert up.returncode == 0, up.stderr
            again = subprocess.run([*walbus, "up"], capture_output=True, text=True, timeout=60)
            assert again.returncode == 0 and "reusing" in again.stdout
            status = subprocess.run([*walbus, "status"], capture_output=True, text=True, timeout=60)
            assert status.returncode == 0 and '"running": true' in status.stdout
            import json

            info = json.loads(status.stdout)
            pids += [str(info["postgres"]["pid"]), str(info["kafka"]["pid"])]
            env = subprocess.run([*walbus, "env"], capture_output=True, text=True, timeout=60)
            assert env.stdout.startswith("export WALBUS_PG_DSN=") and "WALBUS_KAFKA_BOOTSTRAP=127.0.0.1:" in env.stdout
            # `up` and `status` show where PostgreSQL is, not its password (only `env` hands that out)
            password = env.stdout.split("WALBUS_PG_DSN=")[1].split("@")[0].rpartition(":")[2]
            assert len(password) >= 16
            assert password not in up.stdout + again.stdout + status.stdout and ":***@" in up.stdout
            down = subprocess.run([*walbus, "down"], capture_output=True, text=True, timeout=120)
            assert down.returncode == 0 and "postgres" in down.stdout and "kafka" in down.stdout
            status = subprocess.run([*walbus, "status"], capture_output=True, text=True, timeout=60)
            assert status.returncode == 3
    finally:  # a failed assertion leaves no stack running
        subprocess.run([*walbus, "down", "--purge"], capture_output=True, timeout=180)
    shutil.rmtree(state, ignore_errors=True)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or not pid_alive(int(pid), str(state))


def test_dev_cli_corrupt_state_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text("{not json")
    res = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "dev", "--state-dir", str(tmp_path), "up"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2
    assert "corrupt" in res.stderr and "Traceback" not in res.stderr


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp that PostgreSQL, run as `postgres` under root, may enter
    (pytest's tmp_path is below a 0700 directory)."""
    base = Path(tempfile.mkdtemp(prefix="walbus-dev-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _running_in(state: Path) -> list[str]:
    """Command lines of the live processes that name ``state`` (the stack's servers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if os.fsencode(str(state)) in cmd and pid_alive(int(proc.name), str(state)):
                found.append(f"{proc.name}: {cmd[:150]!r}")
    return found


def _env_without_stack() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("WALBUS_PG_DSN", "WALBUS_KAFKA_BOOTSTRAP", "WALBUS_DEV_STATE_DIR")}


@pytest.mark.parametrize(("sig", "spawned"), [(signal.SIGINT, "kafka/stdout.log"), (signal.SIGTERM, "pg/postgres.log")])
def test_an_interrupted_up_leaves_no_server_running(open_dir: Path, sig: int, spawned: str) -> None:
    """Ctrl-C or SIGTERM while `walbus dev up` waited for a server left it running with no
    recorded PID: `down` (even --purge) did not stop it, the next `up` found its port taken."""
    state = open_dir / "state"
    up = subprocess.Popen([sys.executable, "-m", "walbus.app.cli", "dev", "up", "--state-dir", str(state)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (state / spawned).exists():  # the server is being started
            assert up.poll() is None and time.monotonic() < deadline, up.communicate()
            time.sleep(0.05)
        up.send_signal(sig)
        out, err = up.communicate(timeout=120)
        assert up.returncode == 128 + sig if sig == signal.SIGTERM else up.returncode == 130, out + err
        assert _running_in(state) == []
    finally:
        subprocess.run([sys.executable, "-m", "walbus.app.cli", "dev", "down", "--purge", "--state-dir", str(state)], timeout=180)
        for line in _running_in(state):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def test_a_demo_whose_stack_fails_to_start_stops_and_removes_it(open_dir: Path) -> None:
    """Kafka failing at start (an unusable heap option): the demo exited 2 but left the
    PostgreSQL it had started running and the state directory it had made; the error showed
    Kafka's server.log, not stdout.log where the JVM said what was wrong."""
    state = open_dir / "new"
    res = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "demo", "--no-warehouse", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=300, env={**_env_without_stack(), "WALBUS_KAFKA_HEAP": "-Xmx1k"},
    )
    try:
        assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
        assert "stdout.log" in res.stderr and "heap" in res.stderr.lower()
        assert not state.exists() and _running_in(state) == []
    finally:
        for line in _running_in(state):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def test_a_stack_in_an_unusual_directory_survives_restarts_and_a_kill_9(open_dir: Path) -> None:
    """A non-ASCII state directory sent Kafka's data to a mojibake sibling (Java reads .properties
    as ISO-8859-1): the second `up` failed. `up` right after a kill -9 of PostgreSQL failed on the
    socket lock naming the zombie. The socket_dsn was not percent-encoded; up's hint dropped
    --state-dir."""
    state = open_dir / "stäte & 100%"
    walbus = [sys.executable, "-m", "walbus.app.cli", "dev"]
    where = ["--state-dir", str(state)]
    try:
        up = subprocess.run([*walbus, "up", *where], capture_output=True, text=True, timeout=240)
        assert up.returncode == 0, up.stderr
        assert f'walbus dev env --state-dir {shlex.quote(str(state))}' in up.stdout
        info = json.loads(subprocess.run([*walbus, "status", *where], capture_output=True, text=True, timeout=60).stdout)
        with psycopg.connect(info["postgres"]["socket_dsn"]) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        os.kill(info["postgres"]["pid"], signal.SIGKILL)
        again = subprocess.run([*walbus, "up", *where], capture_output=True, text=True, timeout=240)
        assert again.returncode == 0, again.stderr
        assert subprocess.run([*walbus, "down", *where], timeout=180).returncode == 0
        third = subprocess.run([*walbus, "up", *where], capture_output=True, text=True, timeout=240)
        assert third.returncode == 0, third.stderr
        assert sorted(p.name for p in open_dir.iterdir()) == [state.name]  # no mojibake sibling
    finally:
        subprocess.run([*walbus, "down", "--purge", *where], timeout=180)
    assert not state.exists() and _running_in(state) == []
