"""Process-wide settings every service sets at start."""

from __future__ import annotations

import os
import signal


def _exit_now(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _hang_up(signum: int, frame: object) -> None:
    # Whatever takes SIGTERM at this moment stops the service: exit 0 before its event loop
    # runs, the service's own graceful stop (flush, last heartbeat, log) once the loop runs.
    os.kill(os.getpid(), signal.SIGTERM)


def exit_on_sigterm() -> None:
    """Until a service's event loop takes SIGTERM over, stopping is exiting, cleanly (exit 0):
    nothing is open yet. Without it, a SIGTERM in the first moments killed the process
    (-15), as an orchestrator stopping a starting pod sees a crash.

    A SIGHUP (a closed terminal or ssh session, ``kill -HUP``; no service reloads its
    configuration) is a SIGTERM from now on: it killed the producer and the demux at once,
    without a log line or a flush. Under ``nohup`` (ignored) it stays ignored."""
    signal.signal(signal.SIGTERM, _exit_now)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _hang_up)
