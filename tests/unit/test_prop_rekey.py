"""Properties of the demux' re-keying (demux/rekey.py) against a reference model (no services).

A random stream of transactions over tables with random names, keys and values (inserts,
snapshot reads, updates that leave a TOAST-able column unsent, key changes, deletes,
truncates), with random whole-transaction re-sends (the producer's at-least-once delivery:
same keys) and invalid records in between (garbage, wrong version, misaligned lists, a key
column missing, a malformed table name, a key that is not the value's position). It goes
through what the demux does per record: drop a position not after the last one, check the
key (walbus.contract.check_key), re-key (fast path or full), apply the store changes. Then:

* the compacted view of the output (last value per topic and key) equals a reference model
  (a dict of the latest row per primary key: deletes remove, key changes move, truncate clears);
* every valid position gives exactly its records, once; duplicates and invalid records none;
* every invalid record raises ContractError or RekeyError and leaves the store unchanged.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from demux.rekey import META_FIELDS, Rekeyer, RekeyError, strip_meta
from tests.support.demux import DictState
from tests.support.prop import TS, columns, identifiers, json_values, raw_event, strict
from walbus.contract import (
    ContractError,
    check_key,
    decode_event,
    encode_event,
    event_key,
    qualify_table,
)

Row = dict[str, Any]


@dataclass
class Table:
    schema: str
    name: str
    pk: list[str]
    others: list[str]
    types: dict[str, str]
    toast: str | None  # a text column an update may leave unsent

    @property
    def qualified(self) -> str:
        return qualify_table(self.schema, self.name)

    def key(self, row: Row) -> bytes:
        return orjson.dumps({c: row[c] for c in self.pk})


@dataclass
class Record:
    key: bytes
    value: bytes
    kind: str  # valid, invalid
    op: str = ""


@dataclass
class Stream:
    tables: list[Table]
    records: list[Record] = field(default_factory=list)
    model: dict[tuple[str, bytes], Row] = field(default_factory=dict)  # (table, key) -> row


_usable_names = identifiers.filter(lambda n: n not in META_FIELDS)
_key_values = st.one_of(st.integers(-3, 3), st.sampled_from(["a", "b", "ö", "", '"', "a.b"]))


@st.composite
def tables(draw: st.DrawFn) -> list[Table]:
    out: list[Table] = []
    for _ in range(draw(st.integers(1, 2))):
        cols = draw(columns(2, 4).filter(lambda cs: not set(cs) & set(META_FIELDS)))
        npk = draw(st.integers(1, min(2, len(cols) - 1)))
        pk, others = cols[:npk], cols[npk:]
        types = {c: draw(st.sampled_from(["int4", "text"])) for c in pk}
        types |= {c: draw(st.sampled_from(["int8", "text", "float8", "bool", "numeric"])) for c in others}
        toast = next((c for c in others if types[c] == "text"), None)
        out.append(Table(draw(_usable_names), draw(_usable_names), pk, others, types, toast))
    names = [t.qualified for t in out]
    return out if len(set(names)) == len(names) else out[:1]


def _image(t: Table, row: Row, cols: list[str]) -> dict[str, list[Any]]:
    return {"columns": cols, "types": [t.types[c] for c in cols], "values": [row[c] for c in cols]}


def _invalid(draw: st.DrawFn, t: Table, commit_lsn: int, seq: int) -> bytes:
    """A record at this position that the contract or the re-keying must refuse."""
    kind = draw(st.sampled_from(["garbage", "version", "misaligned", "no_key", "table", "null_columns"]))
    row = {c: 1 for c in t.pk + t.others}
    good = orjson.loads(raw_event(commit_lsn=commit_lsn, seq=seq, operation="insert", schema=t.schema,
                                  table=t.name, pk=t.pk, new=_image(t, row, t.pk + t.others)))
    if kind == "garbage":
        return draw(st.sampled_from([b"not json", b"[]", b"{", b"null", b'{"v":1}', b"\xff"]))
    if kind == "version":
        good["v"] = 2
    elif kind == "misaligned":
        good["values"] = good["values"][:-1]
    elif kind == "no_key":
        good["columns"], good["types"], good["values"] = t.others, good["types"][len(t.pk):], good["values"][len(t.pk):]
    elif kind == "table":
        good["table"] = draw(st.sampled_from(['"a.b', 'a"b.c', ".t", "t.", "nodot", "a.b.c", '"a"x.b']))
    else:
        good["columns"] = None
    return orjson.dumps(good)


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    s = Stream(draw(tables()))
    commit_lsn = 0x1_0000_0000
    txns: list[list[Record]] = []
    for _ in range(draw(st.integers(1, 8))):
        commit_lsn += draw(st.integers(1, 0x10000))
        txn: list[Record] = []
        for seq in range(draw(st.integers(1, 5))):
            t = draw(st.sampled_from(s.tables))
            txn.append(_change(draw, s, t, commit_lsn, seq))
        txns.append(txn)
        s.records.extend(txn)
        if draw(st.integers(0, 3)) == 0:  # the producer restarted: the last transactions again, same keys
            for again in txns[-draw(st.integers(1, len(txns))):]:
                s.records.extend(again)
    return s


def _change(draw: st.DrawFn, s: Stream, t: Table, commit_lsn: int, seq: int) -> Record:
    key = event_key(commit_lsn, seq)
    live = {k: r for (tbl, k), r in s.model.items() if tbl == t.qualified}
    op = draw(st.sampled_from(["upsert", "upsert", "update", "move", "delete", "truncate", "invalid", "bad_key"]))
    if op == "invalid":
        return Record(key, _invalid(draw, t, commit_lsn, seq), "invalid")
    if op == "bad_key":  # a valid value whose key says another position: moves nothing
        value = raw_event(commit_lsn=commit_lsn, seq=seq + 1000, operation="truncate", schema=t.schema,
                          table=t.name, pk=t.pk)
        return Record(key, value, "invalid")
    if op == "truncate":
        for k in live:
            del s.model[(t.qualified, k)]
        return Record(key, raw_event(commit_lsn=commit_lsn, seq=seq, operation="truncate", schema=t.schema,
                                     table=t.name, pk=t.pk), "valid", "truncate")
    if op in ("update", "move", "delete") and live:
        old_key = draw(st.sampled_from(sorted(live)))
        old = live[old_key]
        identity = _image(t, old, t.pk)
        if op == "delete":
            del s.model[(t.qualified, old_key)]
            return Record(key, raw_event(commit_lsn=commit_lsn, seq=seq, operation="delete", schema=t.schema,
                                         table=t.name, pk=t.pk, identity=identity), "valid", "delete")
        row = dict(old)
        for c in t.others:
            row[c] = draw(json_values)
        if op == "move":
            for c in t.pk:
                row[c] = draw(_key_values)
            if t.key(row) in live and t.key(row) != old_key:
                op = "update"
                row.update({c: old[c] for c in t.pk})
        unsent = [t.toast] if t.toast is not None and draw(st.booleans()) else []
        if unsent:
            row[t.toast] = old[t.toast]  # not sent: the row keeps its value
        del s.model[(t.qualified, old_key)]
        s.model[(t.qualified, t.key(row))] = row
        sent = [c for c in t.pk + t.others if c not in unsent]
        value = raw_event(commit_lsn=commit_lsn, seq=seq, operation="update", schema=t.schema, table=t.name,
                          pk=t.pk, new=_image(t, row, sent), identity=identity, unchanged=unsent)
        return Record(key, value, "valid", "update")
    row = {c: draw(_key_values) for c in t.pk} | {c: draw(json_values) for c in t.others}
    operation = draw(st.sampled_from(["insert", "read"])) if t.key(row) not in live else draw(
        st.sampled_from(["update", "read"]))
    s.model[(t.qualified, t.key(row))] = row
    value = raw_event(commit_lsn=commit_lsn, seq=seq, operation=operation, schema=t.schema, table=t.name,
                      pk=t.pk, new=_image(t, row, t.pk + t.others))
    return Record(key, value, "valid", operation)


@dataclass
class Outcome:
    compacted: dict[tuple[str, bytes], bytes] = field(default_factory=dict)
    per_position: Counter[tuple[int, int, str]] = field(default_factory=Counter)
    refused: list[Record] = field(default_factory=list)
    processed: list[Record] = field(default_factory=list)


def run_demux(records: list[Record], rk: Rekeyer, full: Rekeyer) -> Outcome:
    """What the demux does per source record, without Kafka (see demux/worker.py)."""
    state, full_state = DictState(), DictState()
    out = Outcome()
    last_key: bytes | None = None
    for rec in records:
        if last_key is not None and rec.key <= last_key:
            continue  # a re-sent position: already done
        last_key = rec.key
        before = dict(state.rows)
        try:
            check_key(rec.key, decode_event(rec.value))
            res = rk.rekey_value(rec.value, state)
        except (ContractError, RekeyError):
            out.refused.append(rec)
            assert state.rows == before
            continue
        ref = full.rekey(decode_event(rec.value), full_state)  # the full path agrees with the fast one
        assert (res.records, res.changes, res.unfilled) == (ref.records, ref.changes, ref.unfilled)
        state.apply(res.changes)
        full_state.apply(ref.changes)
        out.processed.append(rec)
        pos = decode_event(rec.value).position
        for r in res.records:
            assert r.key is not None and r.compact
            if r.value is None:
                out.compacted.pop((r.topic, r.key), None)
                out.per_position[(*pos, "tombstone")] += 1
            else:
                out.compacted[(r.topic, r.key)] = r.value
                meta = orjson.loads(r.value)
                assert (meta["__commit_lsn"], meta["__seq"]) == pos
                out.per_position[(*pos, "row")] += 1
    return out


@given(streams())
def test_rekeying_matches_the_reference_model(stream: Stream) -> None:
    rk, full = Rekeyer(prefix="walbus", database="shop"), Rekeyer(prefix="walbus", database="shop")
    out = run_demux(stream.records, rk, full)
    # Every record refused was meant to be, and every invalid one was refused.
    assert all(r.kind == "invalid" for r in out.refused)
    first_seen = {r.key: r for r in reversed(stream.records)}
    assert sorted(r.key for r in out.refused) == sorted(k for k, r in first_seen.items() if r.kind == "invalid")
    # Exactly one row per upsert position; deletes give a tombstone and no row.
    rows = {(p[0], p[1]) for p, n in out.per_position.items() if p[2] == "row" and n == 1}
    assert all(n == 1 for p, n in out.per_position.items() if p[2] == "row")
    upserts = {decode_event(r.value).position for r in out.processed if r.op in ("insert", "read", "update")}
    assert rows == upserts
    deletes = {decode_event(r.value).position for r in out.processed if r.op == "delete"}
    assert deletes <= {(p[0], p[1]) for p in out.per_position if p[2] == "tombstone"}
    # The compacted topics hold exactly the model's rows, with exact values.
    got = {(topic, key): {c: strict(v) for c, v in strip_meta(orjson.loads(v)).items()}
           for (topic, key), v in out.compacted.items()}
    by_table = {t.qualified: t for t in stream.tables}
    want = {(rk.topic_for(table), key): {c: strict(v) for c, v in row.items()}
            for (table, key), row in stream.model.items() if table in by_table}
    assert got == want


@given(st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_resent_transactions_change_nothing(resend_points: list[int]) -> None:
    """The same stream with and without re-sends gives the very same output."""
    t = Table("public", "t", ["id"], ["doc"], {"id": "int4", "doc": "text"}, "doc")
    txns = [[Record(event_key(0x100 + i, 0), raw_event(commit_lsn=0x100 + i, seq=0, operation="insert",
                                                       schema="public", table="t", pk=["id"],
                                                       new=_image(t, {"id": i % 3, "doc": str(i)}, ["id", "doc"])),
                    "valid", "insert")] for i in range(6)]
    once = [r for txn in txns for r in txn]
    again: list[Record] = []
    for i, txn in enumerate(txns):
        again.extend(txn)
        for p in resend_points:
            if p == i:
                again.extend(r for back in txns[: i + 1] for r in back)
    a = run_demux(once, Rekeyer(prefix="w", database="d"), Rekeyer(prefix="w", database="d"))
    b = run_demux(again, Rekeyer(prefix="w", database="d"), Rekeyer(prefix="w", database="d"))
    assert (a.compacted, a.per_position) == (b.compacted, b.per_position)


# -- the fast path on its own: the worker calls it outside its error handling --------------------

_BAD_TABLES = ['"a.b', 'a"b.c', ".t", "t.", "a.b.c", '"a"x.b', 'public.a.b']


@st.composite
def refused_values(draw: st.DrawFn) -> bytes:
    """An insert, update or delete that decode_event refuses for its table name alone."""
    table = draw(st.one_of(st.sampled_from(_BAD_TABLES), st.text(st.sampled_from('ab."'), max_size=6)))
    try:
        decode_event(encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="truncate", table=table,
                                  timestamp=TS, pk=["id"], new=None, identity=None))
    except ContractError:
        pass
    else:
        table = '"a.b'
    op = draw(st.sampled_from(["insert", "update", "delete"]))
    img = {"columns": ["id"], "types": ["int4"], "values": [1]}
    return encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation=op, table=table, timestamp=TS, pk=["id"],
                        new=None if op == "delete" else img, identity=img if op != "insert" else None)


@given(refused_values())
def test_fast_path_never_raises_on_what_the_contract_refuses(raw: bytes) -> None:
    rk = Rekeyer(prefix="w", database="d")
    assert rk.fast(raw) is None
