"""`walbus dev` and `walbus demo`: state dir flags and env, safe PostgreSQL set-up, cleanup (no services)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from walbus.app.cli import main as walbus
from walbus.app.demo import release
from walbus.app.dev.postgres import HBA, PostgresInstance, initdb_command, write_private
from walbus.app.dev.processes import StackError, as_user
from walbus.app.dev.stack import LocalStack, default_state_dir, make_state_dir


def test_state_dir_is_accepted_after_the_action_as_the_readme_writes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `walbus dev status --state-dir DIR`: a stack that is not running -> exit 3, the dir in the JSON
    assert walbus(["dev", "status", "--state-dir", str(tmp_path / "s")]) == 3
    assert str(tmp_path / "s") in capsys.readouterr().out
    assert walbus(["dev", "--state-dir", str(tmp_path / "t"), "status"]) == 3
    assert str(tmp_path / "t") in capsys.readouterr().out


def test_dev_env_without_a_running_stack_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert walbus(["dev", "env", "--state-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "export" not in captured.out and "walbus dev up" in captured.err
    with pytest.raises(StackError):
        LocalStack.load(tmp_path).env()


def test_the_dev_state_dir_env_var(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("WALBUS_DEV_STATE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("WALBUS_STATE_DIR", str(tmp_path / "shared"))
    assert default_state_dir() == tmp_path / "own"
    monkeypatch.delenv("WALBUS_DEV_STATE_DIR")
    with caplog.at_level(logging.WARNING, "walbus.dev"):
        assert default_state_dir() == tmp_path / "shared"
    assert "WALBUS_DEV_STATE_DIR" in caplog.text


def test_state_directories_and_secrets_are_private(tmp_path: Path) -> None:
    make_state_dir(tmp_path / "state")
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    write_private(tmp_path / "state" / "secret", "x")
    assert stat.S_IMODE((tmp_path / "state" / "secret").stat().st_mode) == 0o600
    stack = LocalStack.load(tmp_path / "stack")
    stack.save()
    assert stat.S_IMODE(stack.record.stat().st_mode) == 0o600
    assert stat.S_IMODE(stack.state_dir.stat().st_mode) == 0o700


def test_the_dev_postgres_needs_a_password_over_tcp(tmp_path: Path) -> None:
    assert "trust" not in "".join(line for line in HBA.splitlines() if line.startswith("host"))
    cmd = initdb_command(Path("/pg/bin"), tmp_path / "data", tmp_path / "pw")
    assert "--auth-host=scram-sha-256" in cmd and f"--pwfile={tmp_path / 'pw'}" in cmd
    assert not any(arg == "--auth=trust" for arg in cmd)
    pg = PostgresInstance(tmp_path, 5555)
    assert pg.dsn == "postgresql://postgres@127.0.0.1:5555/postgres"  # a stack from before passwords
    write_private(pg.password_file, "0123abcd\n")
    assert pg.dsn == "postgresql://postgres:0123abcd@127.0.0.1:5555/postgres"


def test_servers_run_without_the_callers_groups() -> None:
    assert as_user(None) == {}
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name
    kw = as_user(me)
    assert kw["group"] == pwd.getpwnam(me).pw_gid and kw["extra_groups"] == []


def _wait_for_command_line(pid: int, marker: str) -> None:
    """Until a child just spawned runs its own program: before its exec, /proc shows the parent's
    command line, and a sweep by command line missed it (the tests were flaky)."""
    import time

    for _ in range(200):
        if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never showed {marker!r} in its command line")


def _used_state_dir(path: Path) -> LocalStack:
    """A state directory as `walbus dev up` leaves it (no server runs)."""
    stack = LocalStack.load(path)
    stack.save()
    for d in ("pg/data", "pg/run", "kafka/data", "kafka-2/data"):
        (stack.state_dir / d).mkdir(parents=True)
    for node in ("kafka", "kafka-2"):
        (stack.state_dir / node / "server.properties").write_text("node.id=1\n")
    write_private(stack.postgres.password_file, "0123abcd")
    return stack


def test_the_demo_removes_the_stack_it_created_and_only_that(tmp_path: Path) -> None:
    own, found = _used_state_dir(tmp_path / "own"), _used_state_dir(tmp_path / "found")
    release(own, was_running=False, created=True, new_dir=True)
    assert not own.state_dir.exists()
    release(found, was_running=False, created=False)
    assert found.record.exists() and (found.state_dir / "pg" / "data").is_dir()
    running = _used_state_dir(tmp_path / "running")
    release(running, was_running=True, created=True, new_dir=True)
    assert running.record.exists()


def test_a_purge_deletes_walbus_files_only_and_refuses_a_directory_walbus_never_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`walbus dev down --purge --state-dir DIR` and `walbus demo --state-dir .` deleted DIR and
    everything in it, walbus's or not (a tester's project directory)."""
    foreign = tmp_path / "project"
    (foreign / "src").mkdir(parents=True)
    (foreign / "src" / "important.txt").write_text("precious")
    assert walbus(["dev", "down", "--purge", "--state-dir", str(foreign)]) == 2
    assert "no stack.json" in capsys.readouterr().err
    assert (foreign / "src" / "important.txt").read_text() == "precious"
    # `walbus demo --state-dir .` in a project: walbus's entries go, the project stays.
    stack = _used_state_dir(foreign)
    (foreign / "kafka.txt").write_text("mine")  # a name like walbus's, but a file
    release(stack, was_running=False, created=True, new_dir=False)
    assert sorted(p.name for p in foreign.iterdir()) == ["kafka.txt", "src"]
    assert (foreign / "src" / "important.txt").read_text() == "precious"
    # An empty directory of the user's stays too; one walbus made is removed with its stack.
    empty = tmp_path / "empty"
    empty.mkdir()
    release(_used_state_dir(empty), was_running=False, created=True, new_dir=False)
    assert empty.is_dir() and not any(empty.iterdir())
    own = _used_state_dir(tmp_path / "own")
    assert walbus(["dev", "down", "--purge", "--state-dir", str(own.state_dir)]) == 0
    assert not own.state_dir.exists()
    assert walbus(["dev", "down", "--purge", "--state-dir", str(tmp_path / "never")]) == 0


def test_a_users_own_pg_or_kafka_folder_is_neither_taken_nor_purged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dev up` used a pg/ or kafka/ folder the user already had, and `down --purge` (or the
    demo) deleted it with the user's files; a stray stack.json was enough for a purge (a re-fuzz)."""
    project = tmp_path / "project"
    for name in ("pg", "kafka"):
        (project / name).mkdir(parents=True)
        (project / name / "notes.txt").write_text("mine")
    assert walbus(["dev", "up", "--state-dir", str(project)]) == 2
    err = capsys.readouterr().err
    assert "already holds kafka, pg but no stack.json" in err
    assert not (project / "stack.json").exists()
    (project / "stack.json").write_text("garbage")
    assert walbus(["dev", "down", "--purge", "--state-dir", str(project)]) == 0
    assert (project / "pg" / "notes.txt").read_text() == (project / "kafka" / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(os.geteuid() != 0, reason="the mode matters when PostgreSQL runs as the postgres user")
def test_postgres_does_not_change_the_mode_of_a_directory_walbus_did_not_make(tmp_path: Path) -> None:
    """initdb as root chmod-ed the state directory 0711, a directory of the user's too."""
    from walbus.app.dev.postgres import find_bindir
    from walbus.app.dev.state import only_walbus_entries

    try:
        find_bindir()
    except StackError:
        pytest.skip("no PostgreSQL server binaries")
    tmp_path.chmod(0o755)
    stack = _used_state_dir(tmp_path / "project")
    assert only_walbus_entries(stack.state_dir)
    (stack.state_dir / "notes.txt").write_text("mine")
    assert not only_walbus_entries(stack.state_dir)
    shutil.rmtree(stack.state_dir / "pg")
    stack.state_dir.chmod(0o700)
    with pytest.raises(StackError, match="cannot enter"):
        stack.postgres.init()
    assert stat.S_IMODE(stack.state_dir.stat().st_mode) == 0o700


def test_status_hides_the_password_and_its_socket_dsn_survives_any_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dev status` printed the superuser's password (only `dev env` may); its socket_dsn was not
    percent-encoded (a space, '&' or '%' in the path: psycopg refused it)."""
    import json

    from psycopg.conninfo import conninfo_to_dict

    stack = _used_state_dir(tmp_path / "sp ace&a%20b")
    assert walbus(["dev", "status", "--state-dir", str(stack.state_dir)]) == 3
    info = json.loads(capsys.readouterr().out)
    assert "0123abcd" not in json.dumps(info) and ":***@" in info["postgres"]["dsn"]
    socket = conninfo_to_dict(info["postgres"]["socket_dsn"])
    assert socket["host"] == str(stack.postgres.socket_dir) and socket["port"] == str(stack.postgres.port)
    # A directory with no stack: no made-up ports, it says there is none.
    assert walbus(["dev", "status", "--state-dir", str(tmp_path / "none")]) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"state_dir": str(tmp_path / "none"), "stack": None}
    assert "no stack" in captured.err


def test_a_corrupt_stack_json_is_purged_and_its_servers_found_by_their_command_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The error about a corrupt stack.json advised `walbus dev down --purge`, which failed the same way."""
    import subprocess
    import sys

    state = tmp_path / "corrupt"
    (state / "pg" / "data").mkdir(parents=True)
    (state / "pg" / "data" / "PG_VERSION").write_text("15\n")
    (state / "stack.json").write_text("garbage")
    # Stands in for the postmaster (`postgres -D <state>/pg/data`): the sweep finds it by that argument.
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(state / "pg" / "data")])
    try:
        _wait_for_command_line(server.pid, str(state / "pg" / "data"))
        assert walbus(["dev", "up", "--state-dir", str(state)]) == 2
        assert "down --purge" in capsys.readouterr().err
        assert walbus(["dev", "down", "--purge", "--state-dir", str(state)]) == 0
        assert str(server.pid) in capsys.readouterr().out
        assert server.wait(10) is not None and not state.exists()
    finally:
        server.kill()
        server.wait()


def test_a_state_dir_that_is_a_file_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    for state in (tmp_path / "afile", tmp_path / "afile" / "below"):
        assert walbus(["dev", "up", "--state-dir", str(state)]) == 2
        err = capsys.readouterr().err
        assert "is a file" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_socket_lock_of_a_dead_or_zombie_server_is_cleared(tmp_path: Path) -> None:
    """Right after a kill -9, the postmaster is a zombie that PID 1 has not reaped: PostgreSQL
    refused to start over the socket's lock file naming it (walbus cleared postmaster.pid only)."""
    import subprocess
    import sys
    import time

    pg = PostgresInstance(tmp_path, 5432)
    pg.socket_dir.mkdir(parents=True)
    zombie = subprocess.Popen(["true"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-D", str(pg.datadir)])
    try:
        for _ in range(100):  # until `true` has exited (not reaped: a zombie)
            if "\nState:\tZ" in Path(f"/proc/{zombie.pid}/status").read_text():
                break
            time.sleep(0.05)
        _wait_for_command_line(live.pid, str(pg.datadir))
        (pg.socket_dir / ".s.PGSQL.5432.lock").write_text(f"{zombie.pid}\n{pg.datadir}\n")
        (pg.socket_dir / ".s.PGSQL.5433.lock").write_text(f"{live.pid}\n{pg.datadir}\n")
        pg.clear_stale_socket_locks()
        assert sorted(p.name for p in pg.socket_dir.iterdir()) == [".s.PGSQL.5433.lock"]
    finally:
        live.kill()
        live.wait()
        zombie.wait()
