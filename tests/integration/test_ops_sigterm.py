"""SIGTERM (and SIGHUP) stops a demux that is still waiting for Kafka (no broker needed: none
answers), and a SIGHUP a streaming producer as SIGTERM does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pipeline import walbus_process
from walbus.app.dev.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_ends_the_demux_while_it_retries_kafka(tmp_path: Path, sig: signal.Signals) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with subprocess.Popen(
        [sys.executable, "-m", "walbus.app.cli", "demux", "--kafka-bootstrap", dead, "--source-topic", "walbus.x",
         "--state-dir", str(tmp_path / "state")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    ) as proc:
        stop_checked(proc, sig)


def stop_checked(proc: subprocess.Popen[str], sig: signal.Signals = signal.SIGTERM) -> None:
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the first retry: it is inside the backoff loop now
            if "retrying" in line:
                break
        else:
            raise AssertionError(f"the demux exited before retrying: {proc.wait()}")
        time.sleep(0.5)  # into the backoff sleep
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.integration
def test_sighup_stops_a_streaming_producer_gracefully(pg_dsn: str, kafka_bootstrap: str, unique_name: str,
                                                      tmp_path: Path) -> None:
    # A closed terminal or ssh session killed the producer at once (-1): no log line, no flush.
    log = tmp_path / "producer.log"
    proc = walbus_process(["produce", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name],
                          log=log)
    try:
        deadline = time.monotonic() + 120
        while "replication started" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert '"producer stopped"' in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stopped_while_connecting(args: list[str], hole: socket.socket, sig: signal.Signals, *,
                              sigint_ignored: bool = False) -> tuple[int, float, str]:
    """Start ``walbus <args>``, wait until it connects to ``hole`` (a listener that never
    answers: a broker or server that hangs), send ``sig``: (exit code, seconds to exit, stderr)."""
    def child_setup() -> None:
        if sigint_ignored:  # as `walbus produce … &` in a non-interactive shell
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    env = {k: v for k, v in os.environ.items() if not k.startswith("WALBUS_")}
    with subprocess.Popen([sys.executable, "-m", "walbus.app.cli", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, preexec_fn=child_setup) as proc:
        try:
            hole.settimeout(60)
            conn, _ = hole.accept()  # it is inside its first attempt now
            time.sleep(0.5)  # (nothing to await: the attempt waits for an answer that never comes)
            proc.send_signal(sig)
            sent = time.monotonic()
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                code = -999
            took = time.monotonic() - sent
            conn.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.stderr is not None
        return code, took, proc.stderr.read()


@pytest.fixture
def hole() -> Iterator[socket.socket]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener


@pytest.mark.parametrize(("sig", "sigint_ignored"), [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["SIGTERM", "SIGINT", "SIGTERM-SIGINT-ignored"])
@pytest.mark.parametrize("command", ["produce", "demux"])
def test_a_stop_while_kafka_does_not_answer_at_start_is_prompt(
    tmp_path: Path, hole: socket.socket, command: str, sig: signal.Signals, sigint_ignored: bool,
) -> None:
    # The producer did not look at SIGTERM/SIGINT before its stream loop: with a broker that
    # accepted connections and never answered it went on retrying (no exit 30 s after the
    # signal), and the demux waited out the attempt's 20 s request timeout (exit 18 s after).
    kafka = f"127.0.0.1:{hole.getsockname()[1]}"
    args = {"produce": ["produce", "--pg-dsn", "postgresql://u:pw@127.0.0.1:1/x"],
            "demux": ["demux", "--source-topic", "walbus.x", "--state-dir", str(tmp_path / "state")]}[command]
    code, took, err = _stopped_while_connecting([*args, "--kafka-bootstrap", kafka], hole, sig, sigint_ignored=sigint_ignored)
    assert (code, "Traceback" in err) == (0, False), err[-3000:]
    assert took < 5, (took, err[-3000:])


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_postgresql_does_not_answer_at_start_is_prompt(kafka_bootstrap: str, hole: socket.socket,
                                                                   sig: signal.Signals) -> None:
    # SIGTERM while connecting to PostgreSQL (10 s connect timeout) was answered when the timeout
    # expired: exit 2 'cannot connect to PostgreSQL … connection timeout expired', 8 s after it.
    dsn = f"postgresql://u:pw@127.0.0.1:{hole.getsockname()[1]}/x"
    code, took, err = _stopped_while_connecting(["produce", "--pg-dsn", dsn, "--kafka-bootstrap", kafka_bootstrap], hole, sig)
    assert (code, "Traceback" in err) == (0, False), err[-3000:]
    assert took < 5, (took, err[-3000:])
