"""`walbus demo` end to end: PostgreSQL -> producer -> demux -> KTable, then a warehouse load."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.pipeline import ROOT
from tests.support.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def test_demo_runs_the_whole_pipeline(services: Services) -> None:
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "PYTHONPATH": str(ROOT), "HOME": str(__import__("pathlib").Path.home()),
           "WALBUS_PG_DSN": services.pg_dsn, "WALBUS_KAFKA_BOOTSTRAP": services.kafka_bootstrap}
    res = subprocess.run([sys.executable, "-m", "walbus.app.cli", "demo", "--rows", "20"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    assert "insert public.transactions  {'transaction_id': 54441, 'user_id': 36036, 'amount': 2000}" in out
    assert "update public.transactions  {'transaction_id': 54441, 'user_id': 36036, 'amount': 2500}" in out
    assert "delete public.transactions  {'transaction_id': 54441}" in out
    assert "… 32 events in all" in out  # pgkafka's 3 + 20 inserts + 20//3 updates + 20//6 deletes
    assert "54441 deleted (tombstone): True" in out
    assert "KTable == SELECT * FROM transactions: True" in out
    assert "public.transactions: 32 events, history +32" in out
    history = out[out.index("history (every change"):out.index("current (live rows only)")]
    assert "| insert       | 54441" in history and "| delete       | 54441" in history
    current = out[out.index("current (live rows only)"):]
    assert "54441" not in current and "(10 rows)" in current
    assert "walbus demo: done" in out
