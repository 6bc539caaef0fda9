"""The driver JVM's log file is rotated when a JVM starts, so it cannot grow forever."""

from __future__ import annotations

from pathlib import Path

from warehouse.spark import rotate_log


def test_a_log_past_its_limit_is_rotated_and_the_oldest_dropped(tmp_path: Path) -> None:
    log = tmp_path / "walbus-spark.log"
    for run in range(5):  # five JVM starts, each after a run that wrote past the limit
        assert rotate_log(str(log), max_bytes=100, keep=3) is (run > 0)
        log.write_bytes(f"run {run}\n".encode() * 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "walbus-spark.log", "walbus-spark.log.1", "walbus-spark.log.2", "walbus-spark.log.3",
    ]
    assert log.read_bytes().startswith(b"run 4")
    assert [(tmp_path / f"walbus-spark.log.{g}").read_bytes()[:5] for g in (1, 2, 3)] == [b"run 3", b"run 2", b"run 1"]


def test_a_small_log_or_none_stays(tmp_path: Path) -> None:
    log = tmp_path / "walbus-spark.log"
    assert rotate_log(str(log), max_bytes=100) is False
    log.write_bytes(b"x" * 99)
    assert rotate_log(str(log), max_bytes=100) is False
    assert [p.name for p in tmp_path.iterdir()] == ["walbus-spark.log"]
