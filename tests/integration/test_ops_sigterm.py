"""SIGTERM (and SIGHUP) stops a demux that is still waiting for Kafka (no broker needed: none
answers), and a SIGHUP a streaming producer as SIGTERM does."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
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
