"""Spark is the `warehouse` extra (issue 19): without it the commands that need it say so
(exit 2), instead of an ImportError trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# sys.modules[name] = None: this interpreter finds no such package, as without the extra
WITHOUT_SPARK = "import sys; sys.modules['pyspark'] = None; sys.modules['delta'] = None; from walbus.app.cli import main; sys.exit(main(sys.argv[1:]))"


def _walbus_without_spark(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_SPARK, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "args",
    [
        ("warehouse", "load", "--topic", "walbus.x", "--warehouse", "/nonexistent/wh"),
        ("warehouse", "sql", "SELECT 1", "--warehouse", "/nonexistent/wh"),
        ("demo", "--rows", "1"),
    ],
)
def test_a_command_that_needs_spark_says_how_to_install_it(args: tuple[str, ...]) -> None:
    done = _walbus_without_spark(*args)
    assert done.returncode == 2, done.stderr
    assert "pip install 'walbus[warehouse]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_warehouse_help_needs_no_spark() -> None:
    done = _walbus_without_spark("warehouse", "load", "--help")
    assert done.returncode == 0, done.stderr
    assert "--parallel-tables" in done.stdout
