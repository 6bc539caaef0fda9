"""walbus.process: a service stopped before its event loop runs exits cleanly."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

CHILD = """
import os, signal
from walbus.process import exit_on_sigterm
exit_on_sigterm()
os.kill(os.getpid(), signal.SIGTERM)
import time; time.sleep(5)
raise SystemExit(3)
"""


def test_sigterm_before_the_event_loop_exits_0() -> None:
    # A SIGTERM in a service's first moments killed it (-15; an orchestrator sees a crash).
    assert subprocess.run([sys.executable, "-c", CHILD], timeout=30).returncode == 0


def test_sighup_is_a_sigterm_unless_ignored() -> None:
    # A SIGHUP (a closed terminal or ssh session) killed a service at once (-1).
    hup = CHILD.replace("signal.SIGTERM)", "signal.SIGHUP)")
    assert subprocess.run([sys.executable, "-c", hup], timeout=30).returncode == 0
    # under nohup it stays ignored: the service runs on
    nohup = hup.replace("exit_on_sigterm()", "signal.signal(signal.SIGHUP, signal.SIG_IGN); exit_on_sigterm()").replace("sleep(5)", "sleep(0.5)")
    assert subprocess.run([sys.executable, "-c", nohup], timeout=30).returncode == 3


def test_ctrl_c_while_the_cli_sets_up_is_exit_130(monkeypatch: pytest.MonkeyPatch) -> None:
    # A SIGINT in a command's first moments (its imports ran outside the try) printed a
    # KeyboardInterrupt traceback and exited -2.
    from walbus.app import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "exit_on_sigterm", interrupted)
    try:
        code = cli.main(["produce"])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped main(): a traceback and exit -2")
    assert code == 130


@pytest.mark.parametrize("service", ["producer.service", "demux.service"])
def test_both_services_exit_cleanly_until_their_loop_runs(service: str) -> None:
    main = inspect.getsource(importlib.import_module(service).main)
    assert main.index("exit_on_sigterm()") < main.index("asyncio.run(")


@pytest.mark.parametrize("command", ["produce", "demux"])
def test_the_cli_takes_sigterm_over_before_it_imports_a_service(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing a service takes ~0.2 s (longer on a loaded machine): a SIGTERM then still
    # killed `walbus produce` (-15), though the service's main takes it over (a fuzz found it).
    import signal

    from walbus.app import cli

    seen: list[object] = []

    def load(name: str) -> object:
        seen.append(signal.getsignal(signal.SIGTERM))
        raise KeyboardInterrupt  # stop here: only the order matters

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli.importlib, "import_module", load)
    try:
        assert cli.main([command]) == 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen and seen[0] not in (signal.SIG_DFL, previous)
