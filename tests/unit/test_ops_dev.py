"""`walbus dev` and `walbus demo`: state dir flags and env, safe PostgreSQL set-up, cleanup (no services)."""

from __future__ import annotations

import logging
import os
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


class Recorder:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.calls: list[bool] = []

    def down(self, *, purge: bool = False) -> list[str]:
        self.calls.append(purge)
        return []


def test_the_demo_removes_the_stack_it_created_and_only_that(tmp_path: Path) -> None:
    own, stopped, running = Recorder(tmp_path), Recorder(tmp_path), Recorder(tmp_path)
    release(own, was_running=False, created=True)
    release(stopped, was_running=False, created=False)
    release(running, was_running=True, created=False)
    assert (own.calls, stopped.calls, running.calls) == ([True], [False], [])
