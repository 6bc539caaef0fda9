"""A local PostgreSQL for development and tests: initdb, start, stop (logical decoding on)."""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import psycopg

if TYPE_CHECKING:
    from collections.abc import Callable

from walbus.app.dev.processes import (
    StackError,
    as_user,
    pid_alive,
    port_in_use,
    signals_deferred,
    spawn,
    stop_pid,
    tail,
)
from walbus.app.dev.state import only_walbus_entries

SUPERUSER = "postgres"
INSTALL_HINT = "install PostgreSQL's server, e.g. `apt-get install postgresql-15 postgresql-15-wal2json`"


def find_bindir() -> Path:
    """Where initdb/postgres live: ``pg_config --bindir`` or /usr/lib/postgresql/*/bin."""
    candidates: list[Path] = []
    env = os.environ.get("WALBUS_PG_BINDIR")
    if env:
        candidates.append(Path(env))
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True)
            candidates.append(Path(out.stdout.strip()))
        except subprocess.CalledProcessError:
            pass
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for c in candidates:
        if (c / "initdb").exists() and (c / "postgres").exists():
            return c
    raise StackError(f"no PostgreSQL server binaries (initdb, postgres) found: {INSTALL_HINT}")


def _run_as() -> str | None:
    """initdb and postgres refuse to run as root: run them as the 'postgres' system user then."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise StackError("running as root and no 'postgres' system user exists to run PostgreSQL as") from None
    return "postgres"


def _chown_tree(path: Path, user: str | None) -> None:
    if user is None:
        return
    pw = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        os.chown(root, pw.pw_uid, pw.pw_gid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), pw.pw_uid, pw.pw_gid)


# TCP needs the generated password; the socket (in a directory only the server user and root
# may enter) trusts whoever can reach it.
HBA = (
    "local all all trust\n"
    "local replication all trust\n"
    "host all all 127.0.0.1/32 scram-sha-256\n"
    "host replication all 127.0.0.1/32 scram-sha-256\n"
)


def initdb_command(bindir: Path, datadir: Path, pwfile: Path) -> list[str]:
    return [
        str(bindir / "initdb"), "-D", str(datadir), "-U", SUPERUSER, "--auth-local=trust",
        "--auth-host=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C.UTF-8",
    ]


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (created 0600, never readable in between)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


@dataclass
class PostgresInstance:
    """A PostgreSQL server in ``<state>/pg``; ``pid`` and ``port`` once started."""

    state_dir: Path
    port: int
    pid: int | None = None

    @property
    def datadir(self) -> Path:
        return self.state_dir / "pg" / "data"

    @property
    def socket_dir(self) -> Path:
        return self.state_dir / "pg" / "run"

    @property
    def logfile(self) -> Path:
        return self.state_dir / "pg" / "postgres.log"

    @property
    def password_file(self) -> Path:
        """The superuser's generated password (0600; stacks created before it have none)."""
        return self.state_dir / "postgres.password"

    @property
    def dsn(self) -> str:
        password = self.password_file.read_text().strip() if self.password_file.exists() else ""
        credentials = f"{SUPERUSER}:{password}" if password else SUPERUSER  # hex: no URI escaping needed
        return f"postgresql://{credentials}@127.0.0.1:{self.port}/postgres"

    @property
    def socket_dsn(self) -> str:
        # Percent-encoded: a space, '&' or '%' in the state directory's path would break the URI.
        return f"postgresql://{SUPERUSER}@/postgres?host={quote(str(self.socket_dir), safe='/')}&port={self.port}"

    def running(self) -> bool:
        return self.pid is not None and pid_alive(self.pid, str(self.datadir))

    def init(self) -> None:
        bindir = find_bindir()
        user = _run_as()
        if (self.datadir / "PG_VERSION").exists():
            return
        if self.datadir.exists() and any(self.datadir.iterdir()):
            raise StackError(
                f"state directory {self.datadir} exists but holds no PostgreSQL cluster (no PG_VERSION): "
                f"it looks corrupt; remove {self.state_dir} (or run `walbus dev down --purge`) and retry"
            )
        if user is not None:
            # The server user may enter the state dir (not list it). Its mode is changed only when
            # walbus made it: a directory of the user's (`--state-dir .`) is never touched.
            if not self.state_dir.stat().st_mode & 0o001 and only_walbus_entries(self.state_dir):
                self.state_dir.chmod(0o711)
            for parent in [self.state_dir.resolve(), *self.state_dir.resolve().parents]:
                if not parent.stat().st_mode & 0o001:
                    raise StackError(
                        f"PostgreSQL runs as the '{user}' user (walbus runs as root), which cannot enter "
                        f"{parent} (mode {oct(parent.stat().st_mode & 0o777)}): choose a state directory "
                        f"below a world-traversable path (e.g. under /tmp or the project)"
                    )
        self.datadir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        # pg/ belongs to the server user, closed to others.
        (self.state_dir / "pg").chmod(0o700)
        _chown_tree(self.state_dir / "pg", user)
        self.datadir.chmod(0o700)
        self.socket_dir.chmod(0o700)
        write_private(self.password_file, secrets.token_hex(16))
        pwfile = self.state_dir / "pg" / ".initdb.pw"
        write_private(pwfile, self.password_file.read_text())
        if user is not None:
            os.chown(pwfile, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
        try:
            res = subprocess.run(initdb_command(bindir, self.datadir, pwfile), capture_output=True, text=True, **as_user(user))
        finally:
            pwfile.unlink(missing_ok=True)
        if res.returncode != 0:
            raise StackError(f"initdb failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
        conf = self.datadir / "postgresql.conf"
        with conf.open("a") as fh:
            fh.write(
                "\n# walbus local stack\n"
                "wal_level = logical\n"
                "max_replication_slots = 20\n"
                "max_wal_senders = 20\n"
                "listen_addresses = '127.0.0.1'\n"
                "fsync = off\n"
                "full_page_writes = off\n"
                "max_connections = 200\n"
                "shared_buffers = 256MB\n"
                "wal_sender_timeout = 60s\n"
                "logical_decoding_work_mem = 64MB\n"
                "log_min_messages = warning\n"
            )
        (self.datadir / "pg_hba.conf").write_text(HBA)
        _chown_tree(self.state_dir / "pg", user)

    def start(self, timeout: float = 60.0, on_spawn: Callable[[], None] | None = None) -> None:
        """Start the server and wait until it accepts connections; ``on_spawn`` runs as soon as
        its PID is known (to record it before the wait, which Ctrl-C may end)."""
        if self.running():
            return
        if port_in_use(self.port):
            raise StackError(f"port {self.port} on 127.0.0.1 is already in use; PostgreSQL cannot listen there")
        bindir = find_bindir()
        user = _run_as()
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        stale_pid = self.datadir / "postmaster.pid"
        if stale_pid.exists():
            # Left by a server that died with its stack (e.g. kill -9): safe to remove once no process runs it.
            first = stale_pid.read_text().splitlines()[:1]
            if not (first and first[0].isdigit() and pid_alive(int(first[0]), str(self.datadir))):
                stale_pid.unlink()
        self.clear_stale_socket_locks()
        self.logfile.touch()
        if user:
            _chown_tree(self.logfile.parent, user)
        with signals_deferred():  # a Ctrl-C waits until the new PID is known (and recorded)
            proc = spawn(
                [str(bindir / "postgres"), "-D", str(self.datadir), "-p", str(self.port), "-k", str(self.socket_dir)],
                logfile=self.logfile,
                user=user,
            )
            self.pid = proc.pid
            if on_spawn is not None:
                on_spawn()
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"PostgreSQL exited at start ({proc.returncode}); log {self.logfile}:\n{tail(self.logfile)}")
            try:
                with psycopg.connect(self.dsn, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as e:
                last = e
                time.sleep(0.2)
        raise StackError(f"PostgreSQL did not accept connections within {timeout:.0f}s: {last}")

    def clear_stale_socket_locks(self) -> None:
        """The socket's lock file of a dead server names it as well, and PostgreSQL refuses to
        start while that PID exists, even as a zombie not reaped yet (right after a kill -9)."""
        for lock in self.socket_dir.glob(".s.PGSQL.*.lock"):
            first = lock.read_text(errors="replace").splitlines()[:1]
            if not (first and first[0].strip().isdigit() and pid_alive(int(first[0]), str(self.datadir))):
                lock.unlink(missing_ok=True)

    def stop(self) -> bool:
        if self.pid is None:
            return False
        import signal

        # SIGINT = PostgreSQL's "fast" shutdown: disconnect clients, checkpoint, exit.
        return stop_pid(self.pid, str(self.datadir), sig=signal.SIGINT)


def wal2json_installed() -> bool:
    try:
        bindir = find_bindir()
    except StackError:
        return False
    pkglibdir = bindir.parent / "lib"
    return (pkglibdir / "wal2json.so").exists()
