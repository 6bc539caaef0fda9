"""The local stack's state directory: what walbus puts there, and removing only that.

A state directory may be one the user already had (``--state-dir .``): walbus never deletes,
nor changes the mode of, anything in it but its own entries.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

from walbus.app.dev.processes import StackError, stop_by_argument

RECORD = "stack.json"
# Every name walbus creates in a state directory; Kafka nodes are kafka (node 1) and kafka-<n>.
_FILES = (RECORD, "stack.tmp", "postgres.password")
_DIRS = ("pg",)
_KAFKA_HOME = re.compile(r"kafka(-[0-9]+)?\Z")


def make_state_dir(path: Path) -> None:
    """The state directory, closed to other users when walbus creates it (it holds the
    superuser's password); a file, or a directory walbus may not create, is a StackError."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:
        raise StackError(f"the state directory {path} is a file, not a directory: choose another --state-dir") from None
    except OSError as e:
        raise StackError(f"cannot create the state directory {path}: {e.strerror}") from None
    if not path.is_dir():  # a symlink to a file
        raise StackError(f"the state directory {path} is not a directory: choose another --state-dir")


def check_state_dir(path: Path) -> None:
    """Fail early, before anything is fetched or started, on a state directory that is a file."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise StackError(f"the state directory {path}: {p} is a file, not a directory; choose another --state-dir")
            return


def is_walbus_entry(path: Path) -> bool:
    if path.name in _FILES:
        return path.is_file() or path.is_symlink()
    return path.is_dir() and not path.is_symlink() and (path.name in _DIRS or _KAFKA_HOME.match(path.name) is not None)


def _made_by_walbus(path: Path) -> bool:
    """Whether a walbus-named directory holds what walbus puts there: a user's own pg/ or
    kafka/ (in a directory with a stray stack.json) is not deleted by a purge (a re-fuzz)."""
    if path.name in _DIRS:
        return any((path / p).exists() for p in ("data/PG_VERSION", "postgres.log", "run"))
    return (path / "server.properties").is_file()


def check_unclaimed(state_dir: Path) -> None:
    """Before walbus claims a state directory (writes its first stack.json): a pg/ or kafka/ it
    holds already is the user's, which a purge would delete with everything in it (a re-fuzz)."""
    if not state_dir.is_dir() or (state_dir / RECORD).exists():
        return
    taken = sorted(p.name for p in state_dir.iterdir() if p.name not in _FILES and is_walbus_entry(p))
    if taken:
        raise StackError(
            f"the state directory {state_dir} already holds {', '.join(taken)} but no {RECORD}: walbus did not make "
            "them. Choose another --state-dir (an empty or new directory)"
        )


def only_walbus_entries(state_dir: Path) -> bool:
    """True when everything in ``state_dir`` is walbus's: a directory walbus made itself."""
    return all(is_walbus_entry(p) for p in state_dir.iterdir())


def server_markers(state_dir: Path) -> list[tuple[str, int]]:
    """The argument each server of this state directory runs with, and its stop signal:
    PostgreSQL's data directory (SIGINT, a fast shutdown) and each Kafka node's
    server.properties (SIGTERM)."""
    markers: list[tuple[str, int]] = [(str(state_dir / "pg" / "data"), signal.SIGINT)]
    if state_dir.is_dir():
        markers += [(str(p / "server.properties"), signal.SIGTERM) for p in sorted(state_dir.iterdir()) if _KAFKA_HOME.match(p.name)]
    return markers


def stop_unrecorded(state_dir: Path) -> list[int]:
    """Stop the servers of ``state_dir`` found by their command lines, recorded or not (an
    interrupted `up` or a corrupt stack.json leaves no PID to go by). Kafka first, as `down`."""
    stopped = []
    for argument, sig in reversed(server_markers(state_dir)):
        stopped += stop_by_argument(argument, sig=sig, timeout=60)
    return stopped


def purge(state_dir: Path, *, remove_dir: bool = True) -> None:
    """Delete walbus's entries in ``state_dir`` (its servers stopped already), then the
    directory itself if it is left empty and ``remove_dir``. A directory without a stack.json
    is refused: walbus never used it, or cannot tell what in it is its own."""
    if not state_dir.exists():
        return
    if not state_dir.is_dir():
        raise StackError(f"{state_dir} is not a directory: nothing deleted")
    record = state_dir / RECORD
    if not record.is_file():
        raise StackError(f"{state_dir} holds no {RECORD}: not a walbus state directory; nothing deleted")
    for entry in sorted(state_dir.iterdir()):
        if entry.name != RECORD and is_walbus_entry(entry):
            if entry.is_dir() and not entry.is_symlink():
                if _made_by_walbus(entry):
                    shutil.rmtree(entry)
            else:
                entry.unlink()
    record.unlink()  # last: a purge cut short is retried by running it again
    if remove_dir and not any(state_dir.iterdir()):
        state_dir.rmdir()
