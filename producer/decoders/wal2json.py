"""Decoder for the wal2json plugin, format version 2 (one JSON object per message).

wal2json 2.5 prints numeric values unquoted, so a float parser would lose digits:
payloads that carry a numeric column (or a -0) are parsed with the standard library
keeping every number's text; all others with orjson. Its limits, kept as they are:
float/numeric NaN and ±Infinity arrive as null, and an unchanged TOAST column is
simply absent from an update (listed in ``unchanged`` here, like pgoutput's).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from functools import partial
from typing import Any, Final

import orjson

from producer.catalog import (
    CatalogLookup,
    TableGone,
    TableInfo,
    modifiers_from_text,
    type_modifiers,
)
from producer.codec import CaptureFilter, EventEncoder, Relation, iso_from_pg_text
from producer.decoders import WATERMARK_PREFIX, Item, LogicalMessage, TxnBegin, TxnEnd, WalMessages
from producer.decoders.pgoutput import DecodeError
from producer.native import EncodeWal2jsonChanges, LoadsExact, encode_wal2json_changes, loads_exact
from walbus.contract import BOOL_TYPES, FLOAT_SPECIALS, FLOAT_TYPES, INT_TYPES, qualify_table

log = logging.getLogger("walbus.producer.wal2json")

_NUMERIC_MARK = b'"typeoid":1700,'
_CHANGE_RUN = 512  # changes the native path encodes per call: bounds what it holds at once
_ROW_ACTIONS = (b'{"action":"I"', b'{"action":"U"', b'{"action":"D"')
Entry = tuple[Relation, dict[str, int], list[Callable[[Any], Any]]]
Signature = tuple[str, int, str | None, bool | None]  # name, type oid, declared type, optional


def _lsn(text: str) -> int:
    """wal2json's ``X/X`` LSN text (always well formed: the server prints it), fast."""
    hi, _, lo = text.partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def _signatures(cols: list[dict[str, Any]]) -> list[Signature]:
    """Each column's signature, as a change lists its columns."""
    return [(c["name"], c["typeoid"], c.get("type"), c.get("optional")) for c in cols]


def _int_or_negative_zero(text: str) -> int | float:
    return -0.0 if text == "-0" else int(text)


def _loads(buf: bytes, native_exact: LoadsExact | None) -> Any:
    """A payload, its numbers exactly: a numeric's digits as printed (fractions as text), and
    a float column's -0 (which JSON parsers read as the integer 0) with its sign. The native
    reader, when there, reads such payloads as the standard library does here (property test)."""
    negative_zero = b'"value":-0,' in buf or b'"value":-0}' in buf
    if negative_zero or _NUMERIC_MARK in buf:
        if native_exact is not None:
            got = native_exact(buf)
            if got is not None:
                return got
        if negative_zero:
            return json.loads(buf, parse_float=str, parse_int=_int_or_negative_zero)
        return json.loads(buf, parse_float=str)
    return orjson.loads(buf)


_BOOL_TEXT: Final = {"t": True, "f": False}


def _value_converter(typname: str) -> Callable[[Any], Any]:
    if typname in INT_TYPES:
        return lambda v: v if v is None or isinstance(v, int) else int(v)
    if typname in FLOAT_TYPES:
        # (a float domain's value is quoted text: its NaN and ±Infinity are kept as pgoutput's)
        return lambda v: v if v is None or isinstance(v, float) or v in FLOAT_SPECIALS else float(v)
    if typname == "numeric":
        return lambda v: v if v is None or isinstance(v, str) else str(v)
    if typname == "bytea":
        # wal2json drops the \x of a bytea (oid 17) only: a domain over bytea keeps it (a fuzz)
        return lambda v: v if v is None or v.startswith("\\x") else "\\x" + v
    if typname in BOOL_TYPES:
        # a bool domain's value is quoted output text ("t"): wal2json prints true/false for
        # the bool oid only (see producer.catalog.type_names_cte)
        return lambda v: _BOOL_TEXT[v] if type(v) is str else v
    return lambda v: v if v is None or isinstance(v, str) else str(v)


def _without(cols: list[dict[str, Any]], names: frozenset[str]) -> list[dict[str, Any]]:
    """A change's columns but generated ones: pgoutput and the snapshots never send those."""
    return [c for c in cols if c["name"] not in names]


def _identity_agrees(rel: Relation, names: list[str]) -> bool:
    """Whether an identity of columns ``names`` is what ``rel``'s replica identity sends: every
    column in order under FULL, else its key's columns."""
    if rel.replident == "f":
        return names == rel.columns
    return set(names) == {c for c, flagged in zip(rel.columns, rel.identity, strict=True) if flagged}


# A column's declared type as wal2json prints it: up to the type oid that follows. A quote in
# the type's text is doubled (SQL quoting), so ',"typeoid":' cannot occur inside it.
_TYPE_FIELD: Final = re.compile(rb'"type":(.*?),"typeoid":', re.DOTALL)


def _with_type_names_quoted(buf: bytes) -> bytes | None:
    """``buf`` with each column type wal2json printed as bare text made a JSON string, or None
    when there is none. wal2json quotes a type's name only when it does not start with a double
    quote, so a type SQL must quote and qualify or decorate (``"my s".e``, ``"Mood"[]``) came
    as invalid JSON, and the producer stopped at that change."""
    def quoted(m: re.Match[bytes]) -> bytes:
        raw = m.group(1)
        try:
            if isinstance(json.loads(raw), str):
                return m.group(0)
        except ValueError:
            pass
        return b'"type":' + orjson.dumps(raw.decode("utf-8", "replace")) + b',"typeoid":'

    fixed = _TYPE_FIELD.sub(quoted, buf)
    return None if fixed == buf else fixed


def _message_with_bytes(buf: bytes) -> Any:
    """A payload that is not valid UTF-8 JSON: wal2json prints a logical message's content as
    it is, and ``pg_logical_emit_message`` takes any bytes from any login role. Such a
    message is read with the bytes replaced (no walbus message is binary); anything else
    stays an error."""
    msg = json.loads(buf.decode("utf-8", "replace"))
    if not isinstance(msg, dict) or msg.get("action") != "M":
        raise DecodeError(f"wal2json payload is not valid JSON: {buf[:200]!r}")
    return msg


class Wal2jsonDecoder:
    plugin = "wal2json"

    def __init__(self, catalog: CatalogLookup, capture: CaptureFilter, *, native: bool = True) -> None:
        """``native``: encode runs of changes, and read payloads with numerics, with the compiled
        path when it is there (producer.native)."""
        self.catalog = catalog
        self.capture = capture
        self.encoder = EventEncoder()
        self._relations: dict[tuple[str, str], Entry] = {}
        # Column signatures each cached relation is known to match: checked per event, so it
        # must cost set look-ups, not catalog calls. The declared type (with its modifier) and
        # nullability are in it: ALTER TABLE … TYPE numeric(14,4) keeps the type oid.
        self._known: dict[tuple[str, str], set[Signature]] = {}
        self._whole: dict[tuple[str, str], list[Signature]] = {}  # the last insert that matched
        self._captured: dict[tuple[str, str], bool] = {}  # the capture filter's answer per table
        self._generated: dict[tuple[str, str], frozenset[str]] = {}  # as the catalog last said
        self._info: dict[tuple[str, str], TableInfo] = {}  # the catalog's table, as last read
        self._relid = 0
        self._counts: dict[tuple[str, str], int] = {}
        self._begin: TxnBegin | None = None
        self._commit_unix_us = 0
        self.native_changes: EncodeWal2jsonChanges | None = encode_wal2json_changes() if native else None
        self.native_loads: LoadsExact | None = loads_exact() if native else None
        # The table the last whole row (an insert's, an update's) went to, when the native path
        # may take the next changes: (schema, table, column signature, relation, the key's
        # column indexes: None when updates and deletes are the slow path's).
        self._hot: tuple[str, str, list[Signature], Relation, list[int] | None] | None = None

    def start_options(self, publication: str) -> dict[str, str]:
        return {
            "format-version": "2",
            "include-xids": "1",
            "include-timestamp": "1",
            "include-lsn": "1",
            "include-type-oids": "1",
            "include-typmod": "1",  # "type": "numeric(12,2)"
            "include-not-null": "1",  # "optional": false
            "include-transaction": "1",
            # Only walbus's own logical messages: wal2json escapes a message's every byte (up
            # to six), so anybody's pg_logical_emit_message of 180 MB passed PostgreSQL's
            # 1 GB string limit and failed the slot at that record on every reconnect.
            "add-msg-prefixes": WATERMARK_PREFIX,
        }

    def _relation(
        self, schema: str, table: str, cols: list[dict[str, Any]], *, whole: bool = False,
        new_row: list[dict[str, Any]] | None = None, fresh: bool = False,
    ) -> Entry:
        """The relation a change was written with. ``whole``: ``cols`` is the whole row (an
        insert, or an old row under REPLICA IDENTITY FULL), so its column list is the table's as
        of that change and must match exactly. ``new_row``: an update's new row, which leaves out
        only unchanged TOAST values: a relation column it lacks whose type is never TOASTed
        means the relation is not the change's (a column dropped before it, or added after).

        The catalog says how a table is now, which may be a later version than the change's
        (a column added, dropped, renamed or retyped later in its transaction or since): when
        the catalog does not match the change's own columns, those columns are the relation.
        ``fresh``: read the catalog again even when the cached relation matches."""
        key = (schema, table)
        cached = self._relations.get(key)
        if cached is not None and not fresh:
            if whole:
                # An insert like the last one matched: one list compare, no per-column look-ups.
                signature = _signatures(cols)
                if signature == self._whole.get(key):
                    return cached
            if self._matches(cached, cols, whole, self._known[key]) and self._lacks_only_toast(cached[0], new_row):
                if whole:
                    self._whole[key] = signature
                return cached
        invalidate = getattr(self.catalog, "invalidate", None)
        if invalidate is not None:
            invalidate(schema, table)
        try:
            info = self.catalog.table(schema, table)
        except TableGone:
            # Renamed or dropped since the change was written (the producer lagged behind):
            # the relation is the change's own columns; wal2json names no key or identity.
            info = TableInfo(schema, table, (), (), (), "d", ())
            log.warning(
                "table not in the catalog: described by the change's own columns, without a primary key",
                extra={"table": f"{schema}.{table}"},
            )
        self._info[key] = info
        generated = self._generated[key] = frozenset(info.generated)
        if generated:
            cols = [c for c in cols if c["name"] not in generated]
            new_row = None if new_row is None else [c for c in new_row if c["name"] not in generated]
        entry = self._from_catalog(schema, table, info)
        if not self._matches(entry, cols, whole, None):
            entry = self._from_change(schema, table, cols, info)
        elif not self._lacks_only_toast(entry[0], new_row):
            # the change's own columns, and the catalog's columns it may have left out as
            # unchanged TOAST values (in the catalog's order)
            entry = self._from_change(schema, table, self._with_toastable(cols, info), info)
            log.debug("relation from the change's own columns", extra={"table": entry[0].qualified, "columns": entry[0].columns})
        self._cache(key, entry)
        return entry

    def _cache(self, key: tuple[str, str], entry: Entry) -> None:
        self._relations[key] = entry
        self._hot = None  # its relation may be this table's old one
        self._known[key] = set()
        self._whole.pop(key, None)

    def _with_identity(
        self, schema: str, table: str, entry: Entry, new_row: list[dict[str, Any]] | None, ident_cols: list[dict[str, Any]],
    ) -> tuple[Entry, list[dict[str, Any]], bool]:
        """The relation with the replica identity an update or delete was written under, its
        identity columns (without generated ones) and whether they are the whole old row.

        wal2json prints a change's identity as the change's own catalog version has it: the
        key's columns (the primary key's, or the index's under USING INDEX), or every column
        under FULL. The catalog says how the table is now (or was when last read): after ALTER
        TABLE … REPLICA IDENTITY the two differ, and the change's own identity decides (a
        cached FULL made a key-only identity the old row, its unchanged TOAST values null)."""
        key = (schema, table)
        names = [c["name"] for c in ident_cols]
        if _identity_agrees(entry[0], names):
            return entry, ident_cols, entry[0].replident == "f"
        # The catalog read may be stale (an ALTER TABLE since): read it again.
        changed = (new_row or []) + ident_cols
        entry = self._relation(schema, table, changed, new_row=new_row, fresh=True)
        generated = self._generated[key]
        if generated:
            ident_cols = _without(ident_cols, generated)
            new_row = None if new_row is None else _without(new_row, generated)
            names = [c["name"] for c in ident_cols]
        rel = entry[0]
        if _identity_agrees(rel, names):
            return entry, ident_cols, rel.replident == "f"
        # Still not the catalog's: written under another replica identity than the table's now.
        info = self._info[key]
        ident = set(names)
        pk = set(info.pk)
        if names == rel.columns:
            full = True
        elif ident == pk or (info.replident == "i" and ident == set(info.identity)):
            full = False
        elif new_row is not None:
            # the whole old row holds every column of the new one (an unchanged TOAST value is
            # still in the old row); a key-only identity lacks the others
            full = {c["name"] for c in new_row} <= ident
        else:
            full = ident > pk  # a delete: a key changed since has no more columns than the key
        if full:
            if names != rel.columns:
                # its columns are the relation the change was written with (a column dropped,
                # or added, since)
                entry = self._relation(schema, table, ident_cols, whole=True)
                rel = entry[0]
            replident, identity = "f", tuple(rel.columns)
        else:
            replident, identity = ("d" if ident == pk else "i"), tuple(c for c in rel.columns if c in ident)
        if rel.replident != replident or set(identity) != {c for c, f in zip(rel.columns, rel.identity, strict=True) if f}:
            log.info(
                "change written under another replica identity than the catalog's",
                extra={"table": rel.qualified, "replica_identity": replident, "identity": list(identity)},
            )
            entry = self._build(
                schema, table, rel.columns, rel.types, replace(info, replident=replident, identity=identity),
                rel.modifiers, rel.not_null,
            )
            self._cache(key, entry)
        return entry, ident_cols, full

    def _lacks_only_toast(self, rel: Relation, new_row: list[dict[str, Any]] | None) -> bool:
        """Whether every column of ``rel`` that an update's ``new_row`` lacks may be an
        unchanged TOAST value (a type PostgreSQL TOASTs)."""
        if new_row is None or len(new_row) == len(rel.columns):
            return True
        fixed = self._fixed_length_types()
        names = {c["name"] for c in new_row}
        return all(c in names or t not in fixed for c, t in zip(rel.columns, rel.types, strict=True))

    def _fixed_length_types(self) -> frozenset[str]:
        """The catalog's never-TOASTed type names (none from a catalog that does not say)."""
        fixed_types = getattr(self.catalog, "fixed_length_types", None)
        return fixed_types() if fixed_types is not None else frozenset()

    def _with_toastable(self, cols: list[dict[str, Any]], info: TableInfo) -> list[dict[str, Any]]:
        """``cols`` and, in the catalog's order, the catalog's columns they lack whose type is
        TOASTed (they may be unchanged TOAST values of the change)."""
        fixed = self._fixed_length_types()
        named = {c["name"]: c for c in cols}
        merged = []
        for name, oid in zip(info.columns, info.type_oids, strict=True):
            if name in named:
                merged.append(named.pop(name))
            elif self.catalog.typname(oid) not in fixed:
                merged.append({"name": name, "typeoid": oid})
        return merged + [c for c in cols if c["name"] in named]

    def _matches(self, entry: Entry, cols: list[dict[str, Any]], whole: bool, known: set[Signature] | None) -> bool:
        """Whether the change's columns are the relation's (``known``: signatures already checked)."""
        rel, index, _ = entry
        if whole and (len(cols) != len(rel.columns) or any(c["name"] != n for c, n in zip(cols, rel.columns, strict=True))):
            return False
        signatures = _signatures(cols)
        if known is not None and all(s in known for s in signatures):
            return True
        if not all(self._column_matches(rel, index, s) for s in signatures):
            return False
        if known is not None:
            known.update(signatures)
        return True

    def _column_matches(self, rel: Relation, index: dict[str, int], signature: Signature) -> bool:
        name, oid, declared, optional = signature
        i = index.get(name)
        if i is None or rel.types[i] != self.catalog.typname(oid):
            return False
        # what the change leaves out (no "type" or "optional") it does not contradict
        if declared is not None and modifiers_from_text(rel.types[i], declared) != rel.modifiers[i]:
            return False
        return optional is None or optional is not rel.not_null[i]

    def _from_catalog(self, schema: str, table: str, info: TableInfo) -> Entry:
        types = [self.catalog.typname(oid) for oid in info.type_oids]
        typmods = info.typmods or (-1,) * len(types)
        not_null = set(info.not_null)
        return self._build(
            schema, table, list(info.columns), types, info,
            [type_modifiers(t, m) for t, m in zip(types, typmods, strict=True)], [c in not_null for c in info.columns],
        )

    def _from_change(self, schema: str, table: str, cols: list[dict[str, Any]], info: TableInfo) -> Entry:
        """The relation as the change's own columns describe it (``optional``: wal2json's
        include-not-null, or else the catalog's). An update's or delete's ``cols`` are its new
        row and then its identity: a key column in both is one column of the relation."""
        firsts: dict[str, dict[str, Any]] = {}
        for c in cols:
            firsts.setdefault(c["name"], c)
        cols = list(firsts.values())
        types = [self.catalog.typname(c["typeoid"]) for c in cols]
        catalog_not_null = set(info.not_null)
        return self._build(
            schema, table, [c["name"] for c in cols], types, info,
            [modifiers_from_text(t, c.get("type")) for t, c in zip(types, cols, strict=True)],
            [c["name"] in catalog_not_null if c.get("optional") is None else c["optional"] is False for c in cols],
        )

    def _build(
        self, schema: str, table: str, columns: list[str], types: list[str], info: TableInfo,
        modifiers: list[list[int] | None], not_null: list[bool],
    ) -> Entry:
        ident = set(info.identity)
        self._relid += 1
        rel = Relation(
            self._relid, schema, table, columns, types, [c in ident for c in columns],
            [c for c in info.pk if c in columns], info.replident, not_null=not_null, modifiers=modifiers,
        ).prepare(self.capture)
        return rel, {c: i for i, c in enumerate(columns)}, [_value_converter(t) for t in types]

    def _row(self, cols: list[dict[str, Any]], index: dict[str, int], convs: list[Callable[[Any], Any]], n: int) -> tuple[list[Any], set[int]]:
        values: list[Any] = [None] * n
        present: set[int] = set()
        for c in cols:
            i = index.get(c["name"])
            if i is None:
                continue  # a column dropped since: nothing to say about it
            values[i] = convs[i](c["value"])
            present.add(i)
        return values, present

    def _captures(self, schema: str, table: str) -> bool:
        key = (schema, table)
        known = self._captured.get(key)
        if known is None:
            known = self._captured[key] = self.capture.captures(qualify_table(schema, table))
        return known

    def _make_hot(self, schema: str, table: str, cols: list[dict[str, Any]], rel: Relation) -> None:
        """Let the native path take the next changes of ``rel`` like ``cols`` (a whole row, in
        the relation's column order), when it can take that table at all. Updates and deletes
        too when the identity is the key (a full identity is an old row, the slow path's)."""
        if (self.native_changes is not None and rel.plain and "bytea" not in rel.types  # (bytea: see _value_converter)
                and not self._generated.get((schema, table))):  # its changes hold more columns than the relation
            self._hot = (schema, table, _signatures(cols), rel, rel.run_key())

    def _loads_repaired(self, buf: bytes) -> Any:
        """A payload that is not valid JSON: its type names quoted, else a logical message's bytes."""
        fixed = _with_type_names_quoted(buf)
        if fixed is not None:
            try:
                return _loads(fixed, self.native_loads)
            except ValueError:
                pass
        return _message_with_bytes(buf)

    def decode(self, messages: WalMessages) -> Iterator[Item]:
        changes = self.native_changes
        # An index, not enumerate(): a native run takes hundreds of messages, passed over at once.
        i, end = 0, len(messages)
        while i < end:
            buf = messages[i][1]
            i += 1
            hot = self._hot
            if hot is not None and changes is not None and buf.startswith(_ROW_ACTIONS):
                # Natively: changes like the last whole row (same table, same columns).
                schema, table, signature, rel, ident = hot
                enc = self.encoder
                args = (messages, i - 1, schema, table, signature, rel.kinds, enc.insert_parts(rel), enc.key_parts(), enc.seq,
                        _CHANGE_RUN, ident, None if ident is None else enc.change_parts(rel))
                run = changes(*args, False)  # the rows only if somebody looks (ChangeRun.images)
                if run[0]:
                    i += len(run[0]) - 1
                    got = enc.changed_run(rel, run, partial(changes, *args, True))
                    for op, n in got.counts().items():
                        counted = (rel.qualified, op)
                        self._counts[counted] = self._counts.get(counted, 0) + n
                    yield got
                    continue
            try:
                msg = _loads(buf, self.native_loads)
            except ValueError:
                msg = self._loads_repaired(buf)
            action = msg["action"]
            if action in ("I", "U", "D"):
                schema, table = msg["schema"], msg["table"]
                if not self._captures(schema, table):
                    continue
                lsn = _lsn(msg["lsn"])
                cols = msg.get("columns") or []
                ident_cols = msg.get("identity")
                generated = self._generated.get((schema, table))
                if generated:
                    cols, ident_cols = _without(cols, generated), None if ident_cols is None else _without(ident_cols, generated)
                if action == "I":
                    rel, index, convs = self._relation(schema, table, cols, whole=True)
                else:
                    rel, index, convs = self._relation(
                        schema, table, cols + (ident_cols or []), new_row=cols if action == "U" else None
                    )
                if self._generated.get((schema, table)) != generated:
                    # the catalog was read for this change: a generated column it named is left out
                    generated = self._generated[(schema, table)]
                    cols, ident_cols = _without(cols, generated), None if ident_cols is None else _without(ident_cols, generated)
                old_full = False
                if action != "I" and ident_cols:
                    (rel, index, convs), ident_cols, old_full = self._with_identity(
                        schema, table, (rel, index, convs), cols if action == "U" else None, ident_cols
                    )
                if not rel.captured:
                    continue
                n = len(rel.columns)
                old = None
                old_lacks: list[int] = []
                if ident_cols is not None:
                    old, old_present = self._row(ident_cols, index, convs, n)
                    if old_full and len(old_present) < n:
                        old_lacks = [i for i in range(n) if i not in old_present]
                if action == "I":
                    # The relation matched the insert's columns exactly, in order: one value each.
                    new = [conv(c["value"]) for conv, c in zip(convs, cols, strict=True)]
                    yield self.encoder.insert(rel, lsn, new)
                    op = "insert"
                    self._make_hot(schema, table, cols, rel)
                elif action == "U":
                    new, present = self._row(cols, index, convs, n)
                    unchanged = [i for i in range(n) if i not in present]
                    if not unchanged and [c["name"] for c in cols] == rel.columns:
                        self._make_hot(schema, table, cols, rel)  # a transaction of updates: the next ones natively
                    yield self.encoder.encode(
                        rel, "update", lsn, new, unchanged=unchanged, old=old, old_is_full=old_full, old_lacks=old_lacks
                    )
                    op = "update"
                else:
                    yield self.encoder.encode(rel, "delete", lsn, None, old=old, old_is_full=old_full)
                    op = "delete"
                key = (rel.qualified, op)
                self._counts[key] = self._counts.get(key, 0) + 1
            elif action == "B":
                iso = iso_from_pg_text(msg["timestamp"])
                commit_lsn = _lsn(msg["lsn"])
                self.encoder.begin(commit_lsn, int(msg["xid"]), iso)
                self._counts = {}
                self._commit_unix_us = int(datetime.fromisoformat(iso).astimezone(UTC).timestamp() * 1_000_000)
                self._begin = TxnBegin(commit_lsn, int(msg["xid"]), iso)
                yield self._begin
            elif action == "C":
                begin = self._begin
                if begin is None:
                    raise DecodeError("wal2json commit without begin")
                yield TxnEnd(begin.commit_lsn, _lsn(msg["nextlsn"]), begin.xid, begin.timestamp, self._commit_unix_us, self._counts)
                self._counts = {}
            elif action == "T":
                schema, table = msg["schema"], msg["table"]
                if not self._captures(schema, table):
                    continue
                rel, _, _ = self._relation(schema, table, [])
                if self._info[(schema, table)].kind == "p":
                    # A partitioned table's truncate is its partitions' (which come too):
                    # pgoutput leaves it out, and so its events' seq.
                    continue
                yield self.encoder.truncate(rel, _lsn(msg["lsn"]))
                key = (rel.qualified, "truncate")
                self._counts[key] = self._counts.get(key, 0) + 1
            elif action == "M":
                content = msg.get("content", "")
                enc = self.encoder
                yield LogicalMessage(
                    _lsn(msg["lsn"]), msg.get("prefix", ""), str(content).encode(), bool(msg.get("transactional")),
                    enc.commit_lsn, enc.xid, enc.seq, self._begin.timestamp if self._begin is not None else "",
                )
            else:
                raise DecodeError(f"unknown wal2json action {action!r}")
