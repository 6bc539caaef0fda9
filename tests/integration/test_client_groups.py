"""walbus groups: each consumer group's lag on a walbus topic, in records and seconds."""

from __future__ import annotations

import asyncio
import os
import random
import sys

import orjson
import pytest

from tests.support.cdc_data import workload
from tests.support.kafka import create_topic, produce
from tests.support.pipeline import ROOT
from walbus.client import Feed
from walbus.client.groups import group_lags

pytestmark = pytest.mark.integration


async def test_group_lag_in_records_and_seconds(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(41), 10, ["public.t"])
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    behind, done = unique_name + "-behind", unique_name + "-done"
    async with Feed(unique_name, group_id=behind, start="earliest", bootstrap_servers=kafka_bootstrap) as feed:
        async with asyncio.timeout(30):
            for _ in range(4):
                await anext(feed)
        await feed.commit()
    async with Feed(unique_name, group_id=done, start="earliest", bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert len([e async for e in feed]) == len(changes)

    lags = {lag.group: lag for lag in await group_lags({"bootstrap_servers": kafka_bootstrap}, topics=[unique_name])}
    assert set(lags) == {behind, done}
    assert lags[behind].records == len(changes) - 4 and lags[behind].seconds > 0
    assert lags[behind].partitions[0].committed == 4 and lags[behind].partitions[0].end == len(changes)
    assert lags[done].records == 0 and lags[done].seconds == 0

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "walbus.app.cli", "groups", "--topic", unique_name, cwd=ROOT,
        env={**os.environ, "WALBUS_KAFKA_BOOTSTRAP": kafka_bootstrap},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    rows = {row["group"]: row for row in map(orjson.loads, out.splitlines())}
    assert rows[behind]["lag_records"] == len(changes) - 4 and rows[done]["lag_records"] == 0


async def test_a_group_behind_the_log_start_shows_its_age(kafka_bootstrap: str, unique_name: str) -> None:
    # Records deleted before the group read them: the worst case showed as 0 s behind (the age
    # was read with auto_offset_reset=latest, which reads nothing there; an operations fuzz).
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    changes = workload(random.Random(42), 10, ["public.t"])
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    tp = TopicPartition(unique_name, 0)
    group = unique_name + "-g"
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: 2})
    finally:
        await consumer.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.delete_records({tp: RecordsToDelete(8)})
    finally:
        await admin.close()
    await asyncio.sleep(1.1)
    (lag,) = await group_lags({"bootstrap_servers": kafka_bootstrap}, topics=[unique_name])
    assert lag.records == len(changes) - 2 and lag.seconds >= 1


async def test_commands_say_an_unreachable_broker_or_a_missing_topic_in_one_line(kafka_bootstrap: str, unique_name: str) -> None:
    # groups printed a traceback (exit 1); tail --until-end waited for a missing topic forever.
    async def walbus(*args: str, bootstrap: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "walbus.app.cli", *args, cwd=ROOT, env={**os.environ, "WALBUS_KAFKA_BOOTSTRAP": bootstrap},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 90)
        assert proc.returncode is not None
        return proc.returncode, err.decode()

    for args in (("groups",), ("dead-letters", "list", "--topic", "t", "--group-id", "g"), ("tail", "--topic", "t", "--until-end")):
        code, err = await walbus(*args, bootstrap="127.0.0.1:1")
        assert code == 2 and "cannot reach Kafka at 127.0.0.1:1" in err and "Traceback" not in err, (args, err)
    code, err = await walbus("tail", "--topic", unique_name + "-missing", "--until-end", bootstrap=kafka_bootstrap)
    assert code == 2 and "does not exist" in err


async def test_a_named_topic_that_does_not_exist_is_said(kafka_bootstrap: str, unique_name: str) -> None:
    # `walbus groups --topic <a typo>` printed an empty table and `dead-letters list --topic <a typo>`
    # '0 dead letter(s) listed', both exit 0: no group, no lag, no word.
    await create_topic(kafka_bootstrap, unique_name)
    missing = unique_name + "-missing"
    for args in (("groups", "--topic", f"{unique_name},{missing}"),
                 ("dead-letters", "list", "--topic", missing, "--group-id", unique_name)):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "walbus.app.cli", *args, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "WALBUS_KAFKA_BOOTSTRAP": kafka_bootstrap},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 2, (args, err.decode())
        assert err.decode().strip().endswith(f"error: topic {missing} does not exist")  # only the missing one
        assert out == b""
