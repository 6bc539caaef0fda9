"""SIGTERM stops a demux that is still waiting for Kafka (no broker needed: none answers)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from walbus.app.dev.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_ends_the_demux_while_it_retries_kafka(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with subprocess.Popen(
        [sys.executable, "-m", "walbus.app.cli", "demux", "--kafka-bootstrap", dead, "--source-topic", "walbus.x",
         "--state-dir", str(tmp_path / "state")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    ) as proc:
        stop_checked(proc)


def stop_checked(proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the first retry: it is inside the backoff loop now
            if "retrying" in line:
                break
        else:
            raise AssertionError(f"the demux exited before retrying: {proc.wait()}")
        time.sleep(0.5)  # into the backoff sleep
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
