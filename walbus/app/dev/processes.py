"""Small process helpers for the local stack: free ports, PID checks, stopping by PID."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

# Popen objects of the processes this interpreter started: kept so that they are not
# garbage-collected while running (ResourceWarning) and can be reaped when stopped.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def as_user(user: str | None) -> dict[str, Any]:
    """subprocess keyword arguments that run a command as ``user`` with that user's own group
    only: ``user=`` alone keeps the caller's groups, root's among them."""
    if user is None:
        return {}
    import pwd

    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


def spawn(cmd: list[str], *, logfile: Path, user: str | None = None) -> subprocess.Popen[bytes]:
    """Start a long-lived server process in its own session, output appended to ``logfile``."""
    with logfile.open("ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, **as_user(user)
        )
    _CHILDREN[proc.pid] = proc
    return proc


class StackError(Exception):
    """A problem with the local stack, told in words the user can act on."""


# Ports handed out by this process: a port is given once, even before its user binds it.
_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.

    A port taken from the ephemeral range (bind to 0) can be handed by the kernel to any
    outgoing connection (a Kafka client's, say) before the service meant to listen on it binds
    it: "Address already in use". Ports below the range are never used that way.
    """
    low, _ = _ephemeral_range()
    floor = 10000 if low > 12000 else 1024
    for _ in range(200):
        port = random.randint(floor, low - 1)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded machine: any port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pid_cmdline(pid: int) -> str | None:
    """The command line of a live process, or None if it is gone (or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if "\nState:\tZ" in status:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace")


def pid_alive(pid: int, marker: str) -> bool:
    """True when ``pid`` runs and its command line holds ``marker`` (guards against PID reuse)."""
    cmd = pid_cmdline(pid)
    return cmd is not None and marker in cmd


def stop_pid(pid: int, marker: str, *, sig: int = signal.SIGTERM, timeout: float = 30.0) -> bool:
    """Stop a process we started, by its recorded PID. Returns True if it was running."""
    if not pid_alive(pid, marker):
        _reap(pid, gone=True)  # a child that exited on its own (or on an earlier signal) is a zombie until then
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid, marker):
            _reap(pid, gone=True)
            return True
        _reap(pid)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(50):
        if not pid_alive(pid, marker):
            break
        time.sleep(0.1)
    _reap(pid, gone=True)
    return True


def _reap(pid: int, *, gone: bool = False) -> None:
    # A child of this very process would otherwise linger as a zombie. ``gone``: it was seen
    # exiting (its command line empties a moment before it turns zombie), so wait for that.
    proc = _CHILDREN.get(pid)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5 if gone else 0)
        if proc.returncode is not None:
            del _CHILDREN[pid]
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
