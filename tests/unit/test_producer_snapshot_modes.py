"""Snapshot modes (issue 18): what each mode does with the facts found at start."""

from __future__ import annotations

import pytest

from producer.config import load
from producer.setup import SlotState
from producer.snapshot import SnapshotPlan, plan_snapshot
from walbus.config import ConfigError

NO_SLOT = SlotState(False)
SLOT = SlotState(True, "pgoutput", 100)
LOST = SlotState(True, "pgoutput", 100, lost=True)


@pytest.mark.parametrize(("mode", "slot", "status", "plan"), [
    # initial: a new slot, or an interrupted snapshot; an existing slot without a record streams
    ("initial", NO_SLOT, None, SnapshotPlan(snapshot=True)),
    ("initial", SLOT, "completed", SnapshotPlan()),
    ("initial", SLOT, None, SnapshotPlan()),
    ("initial", SLOT, "running", SnapshotPlan(snapshot=True, drop_slot=True)),
    # when_needed: also when no completed snapshot is recorded for an existing slot, or the slot was lost
    ("when_needed", NO_SLOT, "completed", SnapshotPlan(snapshot=True)),
    ("when_needed", SLOT, None, SnapshotPlan(snapshot=True)),
    ("when_needed", SLOT, "completed", SnapshotPlan()),
    ("when_needed", SLOT, "running", SnapshotPlan(snapshot=True, drop_slot=True)),
    ("when_needed", LOST, "completed", SnapshotPlan(snapshot=True, drop_slot=True)),
    # no_data: the slot, no reads, recorded as completed; never: the slot, nothing recorded
    ("no_data", NO_SLOT, None, SnapshotPlan(create_slot=True, record_no_data=True)),
    ("no_data", SLOT, "completed", SnapshotPlan()),
    ("no_data", SLOT, None, SnapshotPlan(record_no_data=True)),
    ("never", NO_SLOT, None, SnapshotPlan(create_slot=True)),
    ("never", SLOT, "running", SnapshotPlan()),
    ("always", SLOT, "completed", SnapshotPlan(snapshot=True)),
    ("always", LOST, "completed", SnapshotPlan(snapshot=True, drop_slot=True)),
])
def test_plan(mode: str, slot: SlotState, status: str | None, plan: SnapshotPlan) -> None:
    assert plan_snapshot(mode, slot, status) == plan


@pytest.mark.parametrize("mode", ["always", "when_needed", "initial"])
def test_an_attempt_interrupted_over_a_slot_that_had_streamed_keeps_the_slot(mode: str) -> None:
    # Dropping the slot lost what it held since its last confirmed position: a row deleted
    # while the producer was down stayed live (a fuzz found it, --snapshot-mode always).
    assert plan_snapshot(mode, SLOT, "running", over_existing_slot=True) == SnapshotPlan(snapshot=True)
    # The slot the interrupted attempt created itself streamed nothing: a new one loses nothing.
    assert plan_snapshot(mode, SLOT, "running", over_existing_slot=False) == SnapshotPlan(snapshot=True, drop_slot=True)


@pytest.mark.parametrize("mode", ["initial", "initial_only", "never", "no_data"])
def test_a_lost_slot_is_a_configuration_error_that_names_the_way_out(mode: str) -> None:
    with pytest.raises(ConfigError, match="when_needed"):
        plan_snapshot(mode, LOST, "completed")


def test_the_new_modes_are_accepted() -> None:
    base = ["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--snapshot-mode"]
    assert load([*base, "when_needed"]).snapshot_mode == "when_needed"
    assert load([*base, "no_data"]).snapshot_mode == "no_data"


def test_reads_of_a_snapshot_over_an_existing_slot_sit_between_the_topic_and_the_replay() -> None:
    from producer.snapshot import reads_position

    replay_from = 0x5000  # the slot sends again what commits from here on
    assert reads_position(replay_from, None) == (0x4FFF, 0)
    assert reads_position(replay_from, (0x4000, 7)) == (0x4FFF, 0)
    # Reads of an earlier snapshot at 0x4FFF (redone, or always twice before the slot moved):
    # after them, still below 0x5000, where a transaction's commit record may start. They went
    # to 0x5000 itself, and that transaction's events, sent after them, were skipped (a fuzz).
    assert reads_position(replay_from, (0x4FFF, 2)) == (0x4FFF, 3)
    # A commit at or after the replay's start is complete in the topic (streamed first): after it.
    assert reads_position(replay_from, (0x5000, 9)) == (0x5001, 0)
    assert reads_position(1, None) == (0, 0)
