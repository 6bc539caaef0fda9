"""Process-wide settings every service sets at start."""

from __future__ import annotations

import signal


def _exit_now(signum: int, frame: object) -> None:
    raise SystemExit(0)


def exit_on_sigterm() -> None:
    """Until a service's event loop takes SIGTERM over, stopping is exiting, cleanly (exit 0):
    nothing is open yet. Without it, a SIGTERM in the first moments killed the process
    (-15), as an orchestrator stopping a starting pod sees a crash."""
    signal.signal(signal.SIGTERM, _exit_now)
