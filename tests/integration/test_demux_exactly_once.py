"""Exactly once through kill -9, rebalances and a zombie (a paused process that lost its partitions)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.demux import (
    DemuxProc,
    Feeder,
    Workload,
    _reap_demux_processes,  # noqa: F401
    assert_exactly_once,
    demux_args,
    wait_for_log,
    wait_open_transaction,
)
from tests.support.kafka import create_topic, read_ktable, wait_caught_up

pytestmark = pytest.mark.integration

OPENED = "partition opened"

# Every fault test runs with dynamic group membership and with static membership
# (--group-instance-id, KIP-345): a restarted static member takes its partitions over at
# once, and the fencing must hold all the same.
MEMBERSHIPS = pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])


def _instance(static: bool, name: str) -> tuple[str, ...]:
    return ("--group-instance-id", name) if static else ()


async def _assert_tables(bootstrap: str, source: str, workload: Workload) -> None:
    """KTable of each per-table topic == the workload's final tables."""
    for table, rows in workload.expected_tables().items():
        got = await read_ktable(client_kwargs={"bootstrap_servers": bootstrap}, topic=f"{source}.{table}")
        stripped = {k: {c: v for c, v in row.items() if not c.startswith("__")} for k, row in got.items()}
        assert stripped == rows, f"{table}: {len(stripped)} rows in the KTable, {len(rows)} expected"


@MEMBERSHIPS
async def test_kill9_restart_exactly_once(kafka_bootstrap: str, unique_name: str, tmp_path: Path, static: bool) -> None:
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    workload = Workload(seed=4)
    feeder = Feeder(kafka_bootstrap, source, workload)
    # Long transactions (1 s) while the feed goes on; each kill waits for one with records on the broker.
    args = demux_args(kafka_bootstrap, source, tmp_path / "state", "--txn-max-ms", "1000",
                      "--txn-max-records", "3000", *_instance(static, "demux-1"))
    proc = DemuxProc(args, tmp_path / "demux.log").start()
    feeder.start(180, max_size=150, pause=0.05, big=5000)
    kills = 3
    for n in range(kills):
        await wait_for_log(proc, OPENED, count=n + 1)
        await wait_open_transaction(proc)
        proc.kill9()
        proc.start()  # same log file: the restarted process appends
    # The last restart must be up before "caught up" means anything: the killed process
    # may have committed everything already (and a SIGTERM during start-up kills outright).
    await wait_for_log(proc, OPENED, count=kills + 1)
    await feeder.wait()
    await wait_caught_up(kafka_bootstrap, f"walbus-demux.{source}", source, procs=[proc], within=120)
    assert proc.stop() == 0, proc.log_tail()
    aborted = await assert_exactly_once(kafka_bootstrap, source, feeder.values)
    assert sum(aborted.values()) > 0, "no kill hit an open transaction"
    await _assert_tables(kafka_bootstrap, source, workload)


@MEMBERSHIPS
async def test_rebalance_zombie_and_kill_mid_transaction(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path, static: bool
) -> None:
    """Two demux processes in one group over a 2-partition database topic (one partition per table group).

    1. A alone owns both partitions; B joins: rebalance while transactions are open.
    2. A is frozen (SIGSTOP) past its session timeout: B takes A's partition and fences
       it; A wakes up as a zombie with an open transaction and must not commit it
       (the aiokafka #844 scenario).
    3. B is killed -9 mid-transaction; A takes everything over.
    """
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source, partitions=2)
    workload = Workload(seed=11)
    feeder = Feeder(kafka_bootstrap, source, workload,
                    partition_of={"public.accounts": 0, "public.audit": 0, "public.lines": 1})
    group = f"rebalance-{unique_name}"
    args = [*demux_args(kafka_bootstrap, source, tmp_path / "state", "--txn-max-ms", "1000",
                        "--txn-max-records", "3000", group=group)]
    a = DemuxProc([*args, *_instance(static, "demux-a")], tmp_path / "a.log").start()
    feeder.start(220, max_size=120, pause=0.05)
    await wait_for_log(a, OPENED, count=2)
    await wait_open_transaction(a)
    b = DemuxProc([*args, *_instance(static, "demux-b")], tmp_path / "b.log").start()
    await wait_for_log(b, OPENED, count=1)
    await wait_for_log(a, OPENED, count=3)  # A reopened one partition after the rebalance
    await wait_open_transaction(a)

    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    await wait_for_log(b, OPENED, count=3, within=60)  # B took over A's partition
    a.proc.send_signal(signal.SIGCONT)
    await wait_for_log(a, OPENED, count=4, within=60)  # A rejoined and got a partition back
    await wait_open_transaction(b)

    b.kill9()
    await wait_for_log(a, OPENED, count=5, within=60)  # A owns both partitions again
    await feeder.wait()
    await wait_caught_up(kafka_bootstrap, group, source, procs=[a], within=120)
    assert a.stop() == 0, a.log_tail()

    aborted = await assert_exactly_once(kafka_bootstrap, source, feeder.values)
    assert sum(aborted.values()) > 0, "no transaction was aborted: the faults hit no open transaction"
    await _assert_tables(kafka_bootstrap, source, workload)
    # The zombie noticed it had been fenced (or its commit was refused) instead of committing.
    fenced = [line for line in a.log_lines() if line.get("level") == "warning" and "Fenced" in str(line.get("error"))]
    assert fenced, a.log_tail(60)
