"""walbus.allocator: large buffers stay on the heap once a service tuned the allocator.

Each case runs in a child process: the tuning is process-wide and must not leak into the rest
of the suite. Page faults are counted, not timed: a buffer served by a fresh mmap faults all of
its pages in again on every allocation, one served from the heap only the first time."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CHILD = """
import resource, sys
from walbus.allocator import tune_for_large_buffers
applied = tune_for_large_buffers()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    buf = bytes(bytearray(1 << 20))  # a 1 MB batch, copied, then freed
    del buf
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, faults)
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's mallopt")


def _child(**env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "WALBUS_MALLOC_TUNE"}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**clean, **env}, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@glibc_only
def test_tuned_large_buffers_stop_page_faulting() -> None:
    tuned, tuned_faults = _child()
    untuned, untuned_faults = _child(WALBUS_MALLOC_TUNE="0")
    assert tuned and not untuned
    # untuned: ~256 faults per MB allocated (200 MB); tuned: the first few only
    assert untuned_faults > 20_000, untuned_faults
    assert tuned_faults < 2_000, tuned_faults


@glibc_only
def test_the_operators_own_malloc_settings_win() -> None:
    applied, _ = _child(MALLOC_MMAP_THRESHOLD_="131072")
    assert not applied


COLLECTOR_CHILD = """
import gc
from walbus.allocator import COLLECTOR_THRESHOLDS, tune_collector
garbage = [[i] for i in range(1000)]  # start-up state: frozen, never traversed again
tune_collector()
print(gc.get_threshold() == COLLECTOR_THRESHOLDS, gc.get_freeze_count() >= 1000, gc.isenabled())
"""


def test_tune_collector_freezes_start_up_state_and_raises_the_young_threshold() -> None:
    out = subprocess.run([sys.executable, "-c", COLLECTOR_CHILD], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True"]  # still collecting cycles, just less often


@pytest.mark.parametrize("service", ["producer.service", "demux.service"])
def test_both_services_tune_the_collector_at_start(service: str) -> None:
    # Each service's main() calls the shared tuning (a service left on CPython's defaults
    # spends a few % of its CPU in young collections of records aiokafka holds).
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(service).main)
    assert "tune_collector()" in source
