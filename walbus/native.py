"""The optional compiled extension (``native/``, ``walbus_native``): whether it is there and on.

``WALBUS_NATIVE=0`` forces pure Python; without the extension (not built: no Rust toolchain
where walbus was installed) pure Python it is. Every native path returns None for whatever it
does not handle, and its caller then takes the pure-Python path, which decides errors; both
give the same results (property tests in tests/unit/test_prop_native*.py). No logging here:
the core imports this before a service has set up its logs (the producer says which path runs).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any


def switched_off() -> bool:
    """``WALBUS_NATIVE=0`` (or false, no, off): pure Python even where the extension is installed."""
    return os.environ.get("WALBUS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache
def native_module() -> Any:
    """The extension module, or None for pure Python (decided once per process)."""
    if switched_off():
        return None
    try:
        return importlib.import_module("walbus_native")
    except ImportError:
        return None
