"""The whole-pipeline fault soak, short (issue 14, part 6): `python -m bench.soak` exits 0 with zeros.

It runs on its own one-node `walbus dev` stack (the WALBUS_* services of the test session are
not passed on): the soak kills and restarts its broker and PostgreSQL, which a shared stack
must not suffer. One node rather than three keeps CI's time and CPU in bounds: the broker kill
is then a kill -9 of the only broker (every client waits for it), the 3-node failover being
tests/integration/test_failover.py's subject and the default soak's (`--brokers 3`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.spark]

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_has_no_violation() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WALBUS_PG_DSN", "WALBUS_KAFKA_BOOTSTRAP")}
    res = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--minutes", "3", "--faults", "10", "--brokers", "1", "--seed", "7",
         "--warehouse-every", "60", "--large-rows", "5000"],
        cwd=ROOT, env=env, capture_output=True, timeout=1800,
    )
    lines = [orjson.loads(line) for line in res.stdout.splitlines() if line.startswith(b"{")]
    summary = next((line for line in lines if line.get("summary") == "soak"), None)
    assert summary is not None, res.stderr.decode(errors="replace")[-3000:]
    assert res.returncode == 0, summary["violations"]
    faults = [line for line in lines if "fault" in line]
    assert len(faults) == summary["faults"] >= 10
    # Every kind of fault happened (each kind once per seeded round of all kinds).
    assert set(summary["faults_by_kind"]) == {
        "producer_kill", "demux_kill", "feed_kill", "warehouse_kill", "sigstop", "broker_kill", "pg_restart",
        "walsender_terminate",
    }
    assert summary["events"] > 1000
    for field in ("lost", "duplicated", "unexpected", "invalid", "rows_missing", "rows_extra", "rows_differ"):
        assert summary[field] == 0, field
    assert summary["violations"] == []
    assert summary["milestones"] == ["ADD COLUMN accounts.tier", "large transaction: 5000 rows", "TRUNCATE scratch"]
    assert summary["warehouse_loads"]["ok"] >= 1
