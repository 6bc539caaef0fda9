"""Small process helpers for the local stack: free ports, PID checks, stopping by PID."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
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


def pids_with_argument(argument: str) -> list[int]:
    """Live processes one of whose arguments is exactly ``argument`` (a path only walbus's
    servers of one state directory take): found when no PID was recorded for them."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if os.fsencode(argument) in args and pid_cmdline(int(entry.name)) is not None:
            found.append(int(entry.name))
    return found


def stop_by_argument(argument: str, *, sig: int = signal.SIGTERM, timeout: float = 30.0) -> list[int]:
    """Stop every process found by :func:`pids_with_argument`; their PIDs."""
    pids = pids_with_argument(argument)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    for pid in pids:
        # waits (and escalates): one that died of the signal above already was stopped all the
        # same (it was reported as "stopped nothing": a flaky test)
        stop_pid(pid, argument, sig=sig, timeout=timeout)
    return pids


@contextlib.contextmanager
def signals_deferred(*, redeliver: bool = True) -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then take effect (``redeliver``) or are
    dropped: a process being spawned gets its PID recorded, a cleanup is not cut short.

    Python-level handlers, not a blocked mask or SIG_IGN: a child inherits those across exec
    (a JVM started with SIGTERM ignored never shuts down on it).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    kinds = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in kinds}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if redeliver and caught:
            signal.raise_signal(caught[0])


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, so that cleanups (``finally``) run:
    Python's default ends the process at once, leaving what a command started running."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


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
