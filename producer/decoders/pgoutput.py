"""Decoder for PostgreSQL's built-in ``pgoutput`` plugin (protocol version 1, text values).

Message layouts: PostgreSQL docs, "Logical Replication Message Formats".
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from producer.catalog import CatalogLookup, TableGone, type_modifiers
from producer.codec import (
    PG_EPOCH,
    CaptureFilter,
    EncodedEvent,
    EventEncoder,
    Relation,
    pg_timestamp_iso,
)
from producer.decoders import Item, LogicalMessage, TxnBegin, TxnEnd, WalMessages
from producer.native import DecodeTuple, EncodeChanges, decode_tuple, encode_changes
from producer.replication import quote_ident

log = logging.getLogger("walbus.producer.pgoutput")

_BEGIN = struct.Struct(">QqI")  # final_lsn, commit_ts, xid
_COMMIT = struct.Struct(">xQQq")  # flags, commit_lsn, end_lsn, commit_ts
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_TYPE = struct.Struct(">Ii")  # type oid, atttypmod
_MSG = struct.Struct(">BQ")  # flags, lsn
_PG_EPOCH_UNIX_US = int(PG_EPOCH.timestamp()) * 1_000_000
_CHANGE_RUN = 512  # changes the native path encodes per call: bounds what it holds at once
_COUNT_INDEX = {"insert": 0, "update": 1, "delete": 2}  # Relation.txn_counts


class DecodeError(ValueError):
    pass


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(0, pos)
    return buf[pos:end].decode(), end + 1


class PgoutputDecoder:
    plugin = "pgoutput"

    def __init__(self, catalog: CatalogLookup, capture: CaptureFilter, *, native: bool = True) -> None:
        """``native``: use the compiled tuple decoder when it is there (producer.native)."""
        self.native: DecodeTuple | None = decode_tuple() if native else None
        self.native_changes: EncodeChanges | None = encode_changes() if native else None
        self.catalog = catalog
        self.capture = capture
        self.encoder = EventEncoder()
        self.relations: dict[int, Relation] = {}
        self._commit_unix_us = 0
        self._iso = ""

    def start_options(self, publication: str) -> dict[str, str]:
        # A list of identifiers: quoted, or PostgreSQL folds the name to lower case.
        return {"proto_version": "1", "publication_names": quote_ident(publication), "messages": "true"}

    def decode(self, messages: WalMessages) -> Iterator[Item]:
        relations = self.relations
        insert = self.encoder.insert
        tuple_ = self._rel_tuple if self.native is None else self._native_tuple
        native = self.native
        changes = self.native_changes
        # An index, not enumerate(): a native run takes hundreds of messages, passed over at once.
        i, end = 0, len(messages)
        while i < end:
            lsn, buf = messages[i]
            i += 1
            kind = buf[0]
            if changes is not None and kind in (0x49, 0x55, 0x44):  # I U D
                rel = relations.get(_U32.unpack_from(buf, 1)[0])
                if rel is not None and rel.captured and rel.plain:
                    # Natively: this change and those that follow it, values and event values.
                    enc = self.encoder
                    key = rel.run_key()
                    args = (messages, i - 1, rel.relid, rel.kinds, enc.insert_parts(rel), enc.key_parts(), enc.seq,
                            _CHANGE_RUN, key, None if key is None else enc.change_parts(rel))
                    run = changes(*args, False)  # the rows only if somebody looks (ChangeRun.images)
                    if run[0]:
                        i += len(run[0]) - 1
                        changed = enc.changed_run(rel, run, partial(changes, *args, True))
                        counts = rel.txn_counts
                        for op, n in changed.counts().items():
                            counts[_COUNT_INDEX[op]] += n
                        yield changed
                        continue
            if kind == 0x49:  # I: the hot path
                rel = relations.get(_U32.unpack_from(buf, 1)[0])
                if rel is None:
                    raise DecodeError("insert before its Relation message")
                if rel.captured:
                    # Natively, the values' JSON comes with them (the encoder uses it when it can).
                    got = None if native is None else native(buf, 6, rel.kinds, rel.plain)
                    if got is None:
                        yield insert(rel, lsn, self._tuple(buf, 6, rel.converters)[0])
                    else:
                        yield insert(rel, lsn, got[0], got[3])
                    rel.txn_counts[0] += 1
            elif kind in (0x55, 0x44):  # U D
                relid = _U32.unpack_from(buf, 1)[0]
                rel = relations.get(relid)
                if rel is None:
                    raise DecodeError(f"change for relation {relid} before its Relation message")
                if not rel.captured:
                    continue
                if kind == 0x55:
                    old = None
                    old_full = False
                    pos = 5
                    sub = buf[pos]
                    if sub in (0x4B, 0x4F):  # K (old key) or O (old row)
                        old, _, pos = tuple_(buf, pos + 1, rel)
                        old_full = sub == 0x4F
                    new, unchanged, _ = tuple_(buf, pos + 1, rel)
                    yield self.encoder.encode(rel, "update", lsn, new, unchanged=unchanged, old=old, old_is_full=old_full)
                    rel.txn_counts[1] += 1
                else:
                    sub = buf[5]
                    old, _, _ = tuple_(buf, 6, rel)
                    yield self.encoder.encode(rel, "delete", lsn, None, old=old, old_is_full=sub == 0x4F)
                    rel.txn_counts[2] += 1
            elif kind == 0x42:  # B
                final_lsn, ts, xid = _BEGIN.unpack_from(buf, 1)
                iso = pg_timestamp_iso(ts)
                self.encoder.begin(final_lsn, xid, iso)
                self._commit_unix_us = ts + _PG_EPOCH_UNIX_US
                self._iso = iso
                yield TxnBegin(final_lsn, xid, iso)
            elif kind == 0x43:  # C
                commit_lsn, end_lsn, _ts = _COMMIT.unpack_from(buf, 1)
                yield TxnEnd(commit_lsn, end_lsn, self.encoder.xid, self._iso, self._commit_unix_us, self._take_counts())
            elif kind == 0x52:  # R
                self._relation(buf)
            elif kind == 0x54:  # T
                yield from self._truncate(buf, lsn)
            elif kind == 0x59:  # Y: a non-built-in type's name
                oid = _U32.unpack_from(buf, 1)[0]
                ns, pos = _cstring(buf, 5)
                name, _ = _cstring(buf, pos)
                self.catalog.remember_type(oid, ns, name)
            elif kind == 0x4D:  # M: logical decoding message
                flags, msg_lsn = _MSG.unpack_from(buf, 1)
                prefix, pos = _cstring(buf, 10)
                size = _U32.unpack_from(buf, pos)[0]
                enc = self.encoder
                yield LogicalMessage(msg_lsn, prefix, buf[pos + 4 : pos + 4 + size], bool(flags & 1), enc.commit_lsn, enc.xid, enc.seq, self._iso)
            elif kind == 0x4F:  # O: origin — nothing to emit
                continue
            else:
                raise DecodeError(f"unknown pgoutput message type {chr(kind)!r}")

    def _rel_tuple(self, buf: bytes, pos: int, rel: Relation) -> tuple[list[Any], list[int], int]:
        return self._tuple(buf, pos, rel.converters)

    def _native_tuple(self, buf: bytes, pos: int, rel: Relation) -> tuple[list[Any], list[int], int]:
        assert self.native is not None
        got = self.native(buf, pos, rel.kinds, False)
        if got is None:  # something the native path leaves to this one (it decides the errors)
            return self._tuple(buf, pos, rel.converters)
        return got[0], got[1], got[2]

    @staticmethod
    def _tuple(buf: bytes, pos: int, convs: list[Callable[[bytes], Any]]) -> tuple[list[Any], list[int], int]:
        # `pos` points at the column count that follows the 'N'/'K'/'O' byte.
        n = _U16.unpack_from(buf, pos)[0]
        pos += 2
        values: list[Any] = [None] * n
        unchanged: list[int] = []
        unpack = _U32.unpack_from
        for i in range(n):
            kind = buf[pos]
            pos += 1
            if kind == 0x74:  # t: text
                size = unpack(buf, pos)[0]
                pos += 4
                values[i] = convs[i](buf[pos : pos + size])
                pos += size
            elif kind == 0x75:  # u: unchanged TOAST
                unchanged.append(i)
            elif kind != 0x6E:  # not n(ull)
                raise DecodeError(f"unexpected tuple column kind {chr(kind)!r}")
        return values, unchanged, pos

    def _relation(self, buf: bytes) -> None:
        relid = _U32.unpack_from(buf, 1)[0]
        schema, pos = _cstring(buf, 5)
        name, pos = _cstring(buf, pos)
        replident = chr(buf[pos])
        ncols = _U16.unpack_from(buf, pos + 1)[0]
        pos += 3
        columns: list[str] = []
        types: list[str] = []
        identity: list[bool] = []
        modifiers: list[list[int] | None] = []
        for _ in range(ncols):
            flags = buf[pos]
            col, pos = _cstring(buf, pos + 1)
            type_oid, typmod = _TYPE.unpack_from(buf, pos)
            pos += 8
            typname = self.catalog.typname(type_oid)
            columns.append(col)
            types.append(typname)
            identity.append(bool(flags & 1))
            modifiers.append(type_modifiers(typname, typmod))
        invalidate = getattr(self.catalog, "invalidate", None)
        if invalidate is not None:
            invalidate(schema, name)  # a Relation message means its schema may have changed
        # The message has no nullability or primary key: the catalog's, read once per relation
        # version (here), by the table's oid (a table renamed since is still found).
        try:
            info = self.catalog.table(schema, name, relid)
            pk, not_null = list(info.pk), set(info.not_null)
            flagged = [c for c, f in zip(columns, identity, strict=True) if f]
            if replident == "d" and flagged and set(flagged) != set(pk):
                # The primary key changed since the change was written (the producer lagged
                # behind an ALTER TABLE): the message's identity flags are the key it was
                # written under (a delete named the old key, and went to the demux's DLQ as
                # lacking the new one). Their order is the columns'.
                log.warning(
                    "primary key changed since the change was written: the key it was written under is used",
                    extra={"table": f"{schema}.{name}", "pk_then": flagged, "pk_now": pk},
                )
                pk = flagged
        except TableGone:
            # Dropped since the change was written (the producer lagged behind): what the
            # message itself says. Its identity flags are the primary key's columns under
            # REPLICA IDENTITY DEFAULT; under FULL or USING INDEX the key is not known.
            pk = [c for c, flagged in zip(columns, identity, strict=True) if flagged] if replident == "d" else []
            not_null = set(pk)
            log.warning(
                "table not in the catalog: its primary key from the relation message, nullability unknown",
                extra={"table": f"{schema}.{name}", "relid": relid, "pk": pk},
            )
        rel = Relation(
            relid, schema, name, columns, types, identity, pk, replident,
            not_null=[c in not_null for c in columns], modifiers=modifiers,
        ).prepare(self.capture)
        old = self.relations.get(relid)
        if old is not None:
            rel.txn_counts = old.txn_counts
        self.relations[relid] = rel
        self.encoder.forget(relid)
        log.debug("relation", extra={"table": rel.qualified, "columns": columns})

    def _truncate(self, buf: bytes, lsn: int) -> Iterator[EncodedEvent]:
        nrels = _U32.unpack_from(buf, 1)[0]
        for i in range(nrels):
            relid = _U32.unpack_from(buf, 6 + 4 * i)[0]
            rel = self.relations.get(relid)
            if rel is None or not rel.captured:
                continue
            yield self.encoder.truncate(rel, lsn)
            rel.txn_counts[3] += 1

    def _take_counts(self) -> dict[tuple[str, str], int]:
        # Per-relation counters are cheaper on the hot path than a dict keyed by (table, op).
        counts: dict[tuple[str, str], int] = {}
        for rel in self.relations.values():
            c = rel.txn_counts
            if any(c):
                for op, n in zip(("insert", "update", "delete", "truncate"), c, strict=True):
                    if n:
                        counts[(rel.qualified, op)] = n
                rel.txn_counts = [0, 0, 0, 0]
        return counts
