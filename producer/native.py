"""The optional compiled hot path (``native/``, the ``walbus_native`` extension), chosen at import.

``WALBUS_NATIVE=0`` forces pure Python; without the extension (not built: no Rust toolchain
where walbus was installed) pure Python it is, said once in an info line. Both paths give
the same bytes (tests/unit/test_prop_native.py); the native one returns None for whatever
it does not handle, and the caller then takes the pure-Python path, which decides errors.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol, cast

from walbus.native import native_module, switched_off

log = logging.getLogger("walbus.producer.native")


class DecodeTuple(Protocol):
    def __call__(
        self, buf: bytes, pos: int, kinds: bytes, render: bool, /
    ) -> tuple[list[object], list[int], int, bytes | None] | None: ...


class EncodeInserts(Protocol):
    def __call__(
        self, messages: list[tuple[int, bytes]], start: int, relid: int, kinds: bytes,
        parts: tuple[bytes, bytes, bytes, bytes], seq: int, limit: int, /,
    ) -> list[tuple[list[object], bytes]]: ...


@functools.cache
def _module() -> Any:
    """The extension, or None for the pure-Python path (logged on the first call: after
    logging is set up)."""
    module = native_module()
    if module is not None:
        log.info("native hot path on", extra={"extension": module.__name__})
    elif switched_off():
        log.info("native hot path off (WALBUS_NATIVE=0): pure Python")
    else:
        log.info("native hot path not installed (pip install ./native builds it): pure Python")
    return module


def decode_tuple() -> DecodeTuple | None:
    """The extension's tuple decoder (None: pure Python)."""
    module = _module()
    return None if module is None else cast(DecodeTuple, module.decode_tuple)


def encode_inserts() -> EncodeInserts | None:
    """The extension's run-of-inserts encoder (None: pure Python)."""
    module = _module()
    return None if module is None else cast(EncodeInserts, module.encode_inserts)
