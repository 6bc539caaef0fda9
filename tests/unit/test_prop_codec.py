"""Property: the producer's fast encoder writes the very bytes of walbus.contract.encode_event.

Random relations (any PostgreSQL-legal names, random types, replica identities) and random
transactions of inserts, reads, updates (unchanged TOAST values, columns added later, full
old rows), deletes and truncates; each event is rebuilt by the reference encoder from the
same inputs and the two must be byte-identical, keys included; what the encoded event tells
beside its bytes (table, operation, primary keys) must be what its bytes say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from producer.codec import CaptureFilter, EncodedEvent, EventEncoder, Relation
from tests.support.prop import MAX_LSN, TS, columns, identifiers, json_values, type_names
from walbus.contract import decode_event, encode_event, event_key, qualify_table


@dataclass
class Change:
    operation: str
    new: list[Any] | None
    unchanged: list[int]
    absent: list[int]
    old: list[Any] | None
    old_is_full: bool


@dataclass
class Case:
    rel: Relation
    commit_lsn: int
    xid: int
    changes: list[Change]


def _plain(name: str) -> bool:
    return "." not in name and '"' not in name


# A name that needs quoting in the event's table field: a dot or a quote first (kept when cut).
quoted_names = st.builds(lambda mark, rest: (mark + rest)[:20], st.sampled_from(['.', '"']), identifiers)


@st.composite
def cases(draw: st.DrawFn, names: st.SearchStrategy[str]) -> Case:
    cols = draw(columns(1, 5))
    n = len(cols)
    types = draw(st.lists(type_names, min_size=n, max_size=n))
    ident = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    pk = [c for c, flag in zip(cols, ident, strict=True) if flag]
    replident = draw(st.sampled_from("dfni"))
    not_null = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    modifier = st.one_of(st.none(), st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=2))
    modifiers = draw(st.lists(modifier, min_size=n, max_size=n))
    rel = Relation(draw(st.integers(1, 2**32 - 1)), draw(names), draw(names), cols, types, ident, pk, replident,
                   not_null=not_null, modifiers=modifiers)
    rel.prepare(CaptureFilter())
    row = st.lists(json_values, min_size=n, max_size=n)
    changes: list[Change] = []
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["insert", "read", "update", "delete", "truncate"]))
        if op in ("insert", "read"):
            changes.append(Change(op, draw(row), [], [], None, False))
        elif op == "update":
            # Only non-key columns go unsent (PostgreSQL sends a changed key's value).
            others = [i for i in range(n) if not ident[i]]
            unchanged = draw(st.lists(st.sampled_from(others), unique=True)) if others else []
            absent = [i for i in draw(st.lists(st.sampled_from(others), unique=True)) if i not in unchanged] if others else []
            old_is_full = draw(st.booleans())
            old = draw(row) if old_is_full or draw(st.booleans()) else None
            changes.append(Change(op, draw(row), sorted(unchanged), sorted(absent), old, old_is_full))
        elif op == "delete":
            old_is_full = draw(st.booleans())
            changes.append(Change(op, None, [], [], draw(row), old_is_full))
        else:
            changes.append(Change(op, None, [], [], None, False))
    return Case(rel, draw(st.integers(0, MAX_LSN)), draw(st.integers(0, 2**32 - 1)), changes)


def _image(rel: Relation, idx: list[int], values: list[Any]) -> dict[str, list[Any]]:
    return {"columns": [rel.columns[i] for i in idx], "types": [rel.types[i] for i in idx],
            "values": [values[i] for i in idx]}


def reference(case: Case, seq: int, lsn: int, ch: Change) -> bytes:
    """The event by walbus.contract.encode_event, from the contract's rules alone."""
    rel = case.rel
    everything = list(range(len(rel.columns)))
    new_image = identity = None
    unchanged_names: list[str] = []
    if ch.new is not None:
        new = list(ch.new)
        unsent = list(ch.unchanged)
        if unsent and ch.old is not None and ch.old_is_full:  # the full old row supplies them
            for i in unsent:
                new[i] = ch.old[i]
            unsent = []
        left_out = set(unsent) | set(ch.absent)
        new_image = _image(rel, [i for i in everything if i not in left_out], new)
        unchanged_names = [rel.columns[i] for i in unsent]
    if ch.operation in ("update", "delete"):
        if ch.old is not None and ch.old_is_full:
            identity = _image(rel, everything, ch.old)
        else:
            src = ch.old if ch.old is not None else ch.new
            idx = [i for i in everything if rel.identity[i]]
            identity = _image(rel, idx, src) if idx and src is not None else None
    return encode_event(
        lsn=lsn, commit_lsn=case.commit_lsn, seq=seq, xid=case.xid, operation=ch.operation,
        table=qualify_table(rel.schema, rel.name), timestamp=TS, pk=list(rel.pk), new=new_image,
        identity=identity, unchanged=unchanged_names,
        not_null=[c for c, flag in zip(rel.columns, rel.not_null, strict=True) if flag],
        typmods={c: m for c, m in zip(rel.columns, rel.modifiers, strict=True) if m is not None},
    )


def fast(enc: EventEncoder, rel: Relation, lsn: int, ch: Change) -> EncodedEvent:
    new = list(ch.new) if ch.new is not None else None  # the encoder may fill it in place
    if ch.operation == "insert" and new is not None:
        return enc.insert(rel, lsn, new)
    if ch.operation == "read" and new is not None:
        return enc.read(rel, lsn, new)
    if ch.operation == "truncate":
        return enc.truncate(rel, lsn)
    return enc.encode(rel, ch.operation, lsn, new, unchanged=ch.unchanged, absent=ch.absent, old=ch.old,
                      old_is_full=ch.old_is_full)


def check_case(case: Case) -> None:
    enc = EventEncoder()
    enc.begin(case.commit_lsn, case.xid, TS)
    for seq, ch in enumerate(case.changes):
        lsn = max(case.commit_lsn - 100 + seq, 0)
        ev = fast(enc, case.rel, lsn, ch)
        assert ev.key == event_key(case.commit_lsn, seq)
        assert ev.value == reference(case, seq, lsn, ch), ch
        check_beside_bytes(ev)


def check_beside_bytes(ev: EncodedEvent) -> None:
    """The event's table, operation and keys, as the producer hands them to its neighbours,
    agree with a consumer's reading of the bytes."""
    wire = decode_event(ev.value)
    assert (ev.table, ev.operation) == (wire.table, wire.operation)
    key = wire.key_values()
    if key is not None and None not in key.values():
        assert tuple(key.values()) in ev.primary_keys()
    if ev.operation in ("insert", "read"):
        assert ev.row() == wire.row()


@given(cases(identifiers.filter(_plain)))
def test_fast_encoder_is_byte_identical_to_the_contract(case: Case) -> None:
    check_case(case)


@given(cases(quoted_names))
def test_fast_encoder_quotes_names_with_dots_and_quotes(case: Case) -> None:
    check_case(case)
