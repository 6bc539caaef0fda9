"""The optional compiled hot path (``native/``, the ``walbus_native`` extension), chosen at import.

``WALBUS_NATIVE=0`` forces pure Python; without the extension (not built: no Rust toolchain
where walbus was installed) pure Python it is, said once in an info line. Both paths give
the same bytes (tests/unit/test_prop_native.py); the native one returns None for whatever
it does not handle, and the caller then takes the pure-Python path, which decides errors.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

from producer.codec import ChangeRunParts
from producer.decoders import WalMessages
from walbus.native import native_module, switched_off

log = logging.getLogger("walbus.producer.native")


class DecodeTuple(Protocol):
    def __call__(
        self, buf: bytes, pos: int, kinds: bytes, render: bool, /
    ) -> tuple[list[object], list[int], int, bytes | None] | None: ...


class EncodeChanges(Protocol):
    def __call__(
        self, messages: WalMessages, start: int, relid: int, kinds: bytes,
        parts: tuple[bytes, bytes, bytes, bytes], key_parts: tuple[bytes, int], seq: int, limit: int,
        key: list[int] | None = None, change_parts: tuple[bytes, bytes, bytes, bytes] | None = None,
        rows: bool = True, /,
    ) -> ChangeRunParts: ...


class EncodeWal2jsonChanges(Protocol):
    def __call__(
        self, messages: WalMessages, start: int, schema: str, table: str,
        signature: list[tuple[str, int, str | None, bool | None]], kinds: bytes,
        parts: tuple[bytes, bytes, bytes, bytes], key_parts: tuple[bytes, int], seq: int, limit: int,
        key: list[int] | None = None, change_parts: tuple[bytes, bytes, bytes, bytes] | None = None, rows: bool = True, /,
    ) -> ChangeRunParts: ...


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


def encode_changes() -> EncodeChanges | None:
    """The extension's run-of-pgoutput-changes encoder (None: pure Python, or an extension
    built before it)."""
    module = _module()
    found = getattr(module, "encode_changes", None)
    return None if found is None else cast(EncodeChanges, found)


def encode_wal2json_changes() -> EncodeWal2jsonChanges | None:
    """The extension's run-of-wal2json-changes encoder (None: pure Python, or an extension
    built before it)."""
    module = _module()
    found = getattr(module, "encode_wal2json_changes", None)
    return None if found is None else cast(EncodeWal2jsonChanges, found)


class EncodeCopyRows(Protocol):
    def __call__(
        self, lines: list[bytes], start: int, kinds: bytes, parts: tuple[bytes, bytes, bytes, bytes],
        key_parts: tuple[bytes, int], seq: int, lsn: int, limit: int, /,
    ) -> ChangeRunParts: ...


def encode_copy_rows() -> EncodeCopyRows | None:
    """The extension's run-of-COPY-lines encoder for the initial snapshot (None: pure Python,
    or an extension built before it)."""
    module = _module()
    found = getattr(module, "encode_copy_rows", None)
    return None if found is None else cast(EncodeCopyRows, found)


class LoadsExact(Protocol):
    def __call__(self, buf: bytes, /) -> Any: ...


def loads_exact() -> LoadsExact | None:
    """The extension's exact JSON reader for wal2json payloads (None: pure Python)."""
    module = _module()
    found = getattr(module, "loads_exact", None)
    return None if found is None else cast(LoadsExact, found)


class CopyReader(Protocol):
    def read(self, pgconn: int, out: WalMessages, limit: int, /) -> tuple[int, int, bool]: ...


def new_messages() -> Callable[[], WalMessages] | None:
    """The extension's empty walbus_native.Messages maker, for the CopyReader to fill (None:
    pure Python, whose reads are lists)."""
    found = getattr(_module(), "Messages", None)
    return None if found is None else cast(Callable[[], WalMessages], found)


@functools.cache
def copy_reader() -> CopyReader | None:
    """The extension's CopyData reader, bound to the libpq psycopg's connections use (None:
    pure Python). Only with psycopg's binary package, whose libpq is its own file: the reader
    calls that library's functions, and a libpq of another build must never get its PGconn."""
    module = _module()
    if module is None or not hasattr(module, "CopyReader"):
        return None
    functions = _libpq_copy_functions()
    if functions is None:
        log.info("native replication reads off: psycopg's own libpq not found (reads in Python)")
        return None
    return cast(CopyReader, module.CopyReader(*functions))


def _libpq_copy_functions() -> tuple[int, int] | None:
    """The addresses of PQgetCopyData and PQfreemem in psycopg_binary's libpq, once it is the
    library psycopg says it runs (same version)."""
    from psycopg import pq

    if pq.__impl__ != "binary":
        return None
    try:
        with open("/proc/self/maps") as maps:  # the loaded file, not some other libpq on the path
            path = next((line.split()[-1] for line in maps if "/psycopg_binary.libs/libpq" in line), None)
    except OSError:
        return None
    if path is None:
        return None
    lib = ctypes.CDLL(path)  # already loaded: the same handle, nothing loaded twice
    lib.PQlibVersion.restype = ctypes.c_int
    if lib.PQlibVersion() != pq.version():
        return None
    get, free = ctypes.cast(lib.PQgetCopyData, ctypes.c_void_p).value, ctypes.cast(lib.PQfreemem, ctypes.c_void_p).value
    return (get, free) if get and free else None
