"""Pure re-keying logic: no services."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from demux.rekey import META_FIELDS, OutRecord, Rekeyer, RekeyError, _sorted_in_pieces, strip_meta
from tests.support.demux import DictState
from walbus.contract import ChangeEvent, RowImage, decode_event, encode_event

TS = "2024-05-01T12:00:00.000001+00:00"
TOPIC = "walbus.shop.public.transactions"


def image(**row: Any) -> dict[str, list[Any]]:
    types = ["int4" if isinstance(v, int) else "text" for v in row.values()]
    return {"columns": list(row), "types": types, "values": list(row.values())}


def event(op: str, *, seq: int = 0, table: str = "public.transactions", pk: list[str] | None = None,
          new: dict[str, list[Any]] | None = None, identity: dict[str, list[Any]] | None = None,
          unchanged: list[str] | None = None, commit_lsn: int = 0x16B374D848) -> ChangeEvent:
    raw = encode_event(
        lsn=commit_lsn - 10 + seq, commit_lsn=commit_lsn, seq=seq, xid=777, operation=op, table=table,
        timestamp=TS, pk=["transaction_id"] if pk is None else pk, new=new, identity=identity, unchanged=unchanged,
    )
    return decode_event(raw)


def run(rk: Rekeyer, state: DictState, ev: ChangeEvent) -> list[OutRecord]:
    out = rk.rekey(ev, state)
    state.apply(out.changes)
    return out.records


def val(rec: OutRecord) -> dict[str, Any]:
    assert rec.value is not None
    obj = orjson.loads(rec.value)
    assert isinstance(obj, dict)
    return obj


@pytest.fixture()
def rk() -> Rekeyer:
    return Rekeyer(prefix="walbus", database="shop")


def test_pgkafka_transactions_example(rk: Rekeyer) -> None:
    state = DictState()
    key = b'{"transaction_id":54441}'
    ins = run(rk, state, event("insert", new=image(transaction_id=54441, user_id=36036, amount=2000)))
    upd = run(rk, state, event("update", seq=1, new=image(transaction_id=54441, user_id=36036, amount=2500)))
    dele = run(rk, state, event("delete", seq=2, new=None, identity=image(transaction_id=54441)))
    assert [(r.topic, r.key) for r in ins + upd + dele] == [(TOPIC, key)] * 3
    assert val(ins[0]) == {
        "transaction_id": 54441, "user_id": 36036, "amount": 2000, "__op": "c", "__lsn": 0x16B374D848 - 10,
        "__commit_lsn": 0x16B374D848, "__seq": 0, "__xid": 777, "__ts": TS,
    }
    assert val(upd[0])["amount"] == 2500 and val(upd[0])["__op"] == "u" and val(upd[0])["__seq"] == 1
    assert dele[0].value is None
    assert state.rows == {}


def test_key_is_compact_json_in_key_order(rk: Rekeyer) -> None:
    ev = event("insert", table="public.lines", pk=["order_id", "line"],
               new={"columns": ["line", "note", "order_id"], "types": ["int4", "text", "text"],
                    "values": [2, "x", "A-1"]})
    (rec,) = rk.rekey(ev, DictState()).records
    assert rec.key == b'{"order_id":"A-1","line":2}'
    assert rec.topic == "walbus.shop.public.lines"


def test_read_is_r(rk: Rekeyer) -> None:
    (rec,) = rk.rekey(event("read", new=image(transaction_id=1)), DictState()).records
    assert val(rec)["__op"] == "r"


def test_metadata_wins_over_a_column_of_the_same_name(rk: Rekeyer) -> None:
    ev = event("insert", new={"columns": ["transaction_id", "__op"], "types": ["int4", "text"], "values": [1, "mine"]})
    (rec,) = rk.rekey(ev, DictState()).records
    assert val(rec)["__op"] == "c"
    assert set(META_FIELDS) <= set(val(rec))


def test_delete_records_option(rk: Rekeyer) -> None:
    rk.emit_delete_records = True
    state = DictState()
    run(rk, state, event("insert", new=image(transaction_id=5, amount=10)))
    recs = run(rk, state, event("delete", seq=1, identity=image(transaction_id=5)))
    assert [r.key for r in recs] == [b'{"transaction_id":5}'] * 2
    assert val(recs[0]) | {} == {"transaction_id": 5, "amount": 10, **{k: val(recs[0])[k] for k in META_FIELDS}}
    assert val(recs[0])["__op"] == "d"
    assert recs[1].value is None


def test_delete_record_of_unknown_row_has_the_identity(rk: Rekeyer) -> None:
    rk.emit_delete_records = True
    recs = run(rk, DictState(), event("delete", identity=image(transaction_id=9)))
    assert {k: v for k, v in val(recs[0]).items() if not k.startswith("__")} == {"transaction_id": 9}


def test_primary_key_change(rk: Rekeyer) -> None:
    state = DictState()
    run(rk, state, event("insert", new=image(transaction_id=1, amount=3)))
    recs = run(rk, state, event("update", seq=1, new=image(transaction_id=2, amount=3), identity=image(transaction_id=1)))
    assert [(r.key, r.value is None) for r in recs] == [(b'{"transaction_id":1}', True), (b'{"transaction_id":2}', False)]
    assert list(state.keys("public.transactions")) == [b'{"transaction_id":2}']


def test_full_identity_same_key_is_not_a_key_change(rk: Rekeyer) -> None:
    state = DictState()
    recs = run(rk, state, event("update", new=image(transaction_id=1, amount=4), identity=image(transaction_id=1, amount=3)))
    assert len(recs) == 1 and val(recs[0])["amount"] == 4


def test_unchanged_toast_filled_from_store(rk: Rekeyer) -> None:
    state = DictState()
    big = "x" * 5000
    run(rk, state, event("insert", new=image(transaction_id=1, amount=1, doc=big)))
    out = rk.rekey(event("update", seq=1, new=image(transaction_id=1, amount=2), unchanged=["doc"]), state)
    state.apply(out.changes)
    assert val(out.records[0])["doc"] == big and val(out.records[0])["amount"] == 2
    assert out.unfilled == []
    # Filled again on the next update, from the row just stored.
    (rec,) = run(rk, state, event("update", seq=2, new=image(transaction_id=1, amount=3), unchanged=["doc"]))
    assert val(rec)["doc"] == big


def test_unchanged_toast_with_key_change_uses_the_old_key_row(rk: Rekeyer) -> None:
    state = DictState()
    run(rk, state, event("insert", new=image(transaction_id=1, doc="long")))
    recs = run(rk, state, event("update", seq=1, new=image(transaction_id=7), identity=image(transaction_id=1),
                                unchanged=["doc"]))
    assert val(recs[1])["doc"] == "long" and recs[1].key == b'{"transaction_id":7}'


def test_a_key_column_left_unchanged_as_toast_while_another_changes(rk: Rekeyer) -> None:
    # Key (a, k), k a TOASTed text: UPDATE SET a = 10 leaves k out of the new row (unchanged)
    # and sends the old key as the identity. The new key was the identity's whole key, so the
    # row said a=10 under the key a=1, and a=10 never appeared (found by a key fuzz).
    state = DictState()
    big = "k" * 3000
    run(rk, state, event("insert", pk=["a", "k"], new=image(a=1, k=big, v=1)))
    ev = event("update", seq=1, pk=["a", "k"], new=image(a=10, v=1), identity=image(a=1, k=big), unchanged=["k"])
    recs = run(rk, state, ev)
    old, new = orjson.dumps({"a": 1, "k": big}), orjson.dumps({"a": 10, "k": big})
    assert [(r.key, r.value is None) for r in recs] == [(old, True), (new, False)]
    assert val(recs[1])["a"] == 10 and val(recs[1])["k"] == big
    assert ev.key_values() == {"a": 10, "k": big}  # the client's key: the same rule
    assert list(state.keys("public.transactions")) == [new]


def _ktable(records: list[OutRecord]) -> dict[bytes, Any]:
    table: dict[bytes, Any] = {}
    for r in records:
        if r.value is None:
            table.pop(r.key, None)  # type: ignore[arg-type]
        else:
            table[r.key] = val(r)["n"]  # type: ignore[index]
    return table


@pytest.mark.parametrize("order", ["ascending", "swap", "twice"])
def test_key_changes_under_a_deferrable_key(rk: Rekeyer, order: str) -> None:
    # A DEFERRABLE primary key is unique again only at commit: UPDATE t SET id = id + 1 moves
    # row 1 onto key 2 while row 2 still holds it. Row 2 leaving key 2 tombstoned it, so only
    # the last row of the shift survived (a key fuzz found it). REPLICA IDENTITY FULL (which
    # PostgreSQL needs to publish such a table's updates) says which row leaves.
    state = DictState()
    pk = ["transaction_id"]
    records: list[OutRecord] = []
    for i in (1, 2, 3):
        records += run(rk, state, event("insert", pk=pk, new=image(transaction_id=i, n=10 * i), commit_lsn=0x100))

    def move(seq: int, old: int, new: int, n: int) -> None:
        nonlocal records
        ev = event("update", seq=seq, pk=pk, new=image(transaction_id=new, n=n), identity=image(transaction_id=old, n=n), commit_lsn=0x200)
        records += run(rk, state, ev)
        rk.rekey(ev, state)  # re-keyed twice (as the worker does once it has the store): no change

    if order == "ascending":
        move(0, 1, 2, 10)
        move(1, 2, 3, 20)
        move(2, 3, 4, 30)
        want = {2: 10, 3: 20, 4: 30}
    elif order == "swap":  # UPDATE t SET id = 3 - id WHERE id IN (1, 2)
        move(0, 1, 2, 10)
        move(1, 2, 1, 20)
        want = {1: 20, 2: 10, 3: 30}
    else:  # one row moved twice, no other row involved
        move(0, 1, 7, 10)
        move(1, 7, 8, 10)
        want = {2: 20, 3: 30, 8: 10}
    assert _ktable(records) == {orjson.dumps({"transaction_id": k}): n for k, n in want.items()}
    assert sorted(state.keys("public.transactions")) == sorted(orjson.dumps({"transaction_id": k}) for k in want)


@pytest.mark.parametrize("order", ["ascending", "swap", "twice"])
@pytest.mark.parametrize("restart_after", [0, 1])
def test_key_changes_under_a_deferrable_key_across_a_restart(order: str, restart_after: int) -> None:
    # The demux restarted (or its partition reopened) inside the shift: the moves before it
    # are in the table's topic (so the store), not in the new process's ledger. A row leaving
    # a key that a row moved into before the restart tombstoned it (a re-fuzz lost one key in
    # 20,000); the worker now says where it resumed and the store answers.
    state = DictState()
    pk = ["transaction_id"]
    records: list[OutRecord] = []
    rk = Rekeyer(prefix="walbus", database="shop")
    for i in (1, 2, 3):
        records += run(rk, state, event("insert", pk=pk, new=image(transaction_id=i, n=10 * i), commit_lsn=0x100))
    moves = {
        "ascending": [(1, 2, 10), (2, 3, 20), (3, 4, 30)],
        "swap": [(1, 2, 10), (2, 1, 20)],
        "twice": [(1, 7, 10), (7, 8, 10)],
    }[order]
    for seq, (old, new, n) in enumerate(moves):
        if seq == restart_after + 1:
            rk = Rekeyer(prefix="walbus", database="shop")  # a new process: an empty ledger
            rk.resumed_inside(0x200)
        ev = event("update", seq=seq, pk=pk, new=image(transaction_id=new, n=n), identity=image(transaction_id=old, n=n), commit_lsn=0x200)
        out = rk.rekey(ev, state)
        assert not out.needs_state or seq > restart_after  # the store is asked only after the restart
        state.apply(out.changes)
        records += out.records
    want = {"ascending": {2: 10, 3: 20, 4: 30}, "swap": {1: 20, 2: 10, 3: 30}, "twice": {2: 20, 3: 30, 8: 10}}[order]
    assert _ktable(records) == {orjson.dumps({"transaction_id": k}): n for k, n in want.items()}
    assert sorted(state.keys("public.transactions")) == sorted(orjson.dumps({"transaction_id": k}) for k in want)


def test_unchanged_toast_prefers_the_identity(rk: Rekeyer) -> None:
    state = DictState()
    run(rk, state, event("insert", new=image(transaction_id=1, doc="stale")))
    (rec,) = run(rk, state, event("update", seq=1, new=image(transaction_id=1, n=1),
                                  identity=image(transaction_id=1, doc="fresh"), unchanged=["doc"]))
    assert val(rec)["doc"] == "fresh"


def test_unknown_unchanged_value_is_left_out_never_null(rk: Rekeyer) -> None:
    out = rk.rekey(event("update", new=image(transaction_id=1, amount=2), unchanged=["doc"]), DictState())
    assert "doc" not in val(out.records[0])
    assert out.unfilled == ["doc"]


def test_table_without_primary_key(rk: Rekeyer) -> None:
    out = rk.rekey(event("insert", pk=[], table="public.log", new=image(msg="hi")), DictState())
    (rec,) = out.records
    assert out.no_pk and rec.key is None and not rec.compact and out.changes == []
    assert rec.topic == "walbus.shop.public.log" and val(rec)["msg"] == "hi"
    out = rk.rekey(event("delete", pk=[], table="public.log", identity=image(msg="hi")), DictState())
    assert val(out.records[0])["__op"] == "d" and out.records[0].key is None
    out = rk.rekey(event("truncate", pk=[], table="public.log"), DictState())
    assert val(out.records[0])["__op"] == "t" and out.records[0].key is None


def test_truncate_tombstones_every_known_key_of_the_table(rk: Rekeyer) -> None:
    state = DictState()
    for i in (3, 1, 2):
        run(rk, state, event("insert", seq=i, new=image(transaction_id=i)))
    run(rk, state, event("insert", seq=9, table="public.other", new=image(transaction_id=1)))
    recs = run(rk, state, event("truncate", seq=10))
    assert [(r.key, r.value) for r in recs] == [(b'{"transaction_id":%d}' % i, None) for i in (1, 2, 3)]
    assert list(state.keys("public.transactions")) == []
    assert list(state.keys("public.other")) == [b'{"transaction_id":1}']


def test_missing_key_columns_is_a_rekey_error(rk: Rekeyer) -> None:
    with pytest.raises(RekeyError):
        rk.rekey(event("insert", new=image(amount=1)), DictState())
    with pytest.raises(RekeyError):  # no identity at all (an identity without the key: the store finds it)
        rk.rekey(event("delete"), DictState())


def test_same_row_same_key_bytes(rk: Rekeyer) -> None:
    a = rk.rekey(event("insert", new=image(transaction_id=1, amount=1)), DictState()).records[0].key
    b = rk.rekey(event("update", new=image(amount=9, transaction_id=1)), DictState()).records[0].key
    c = rk.rekey(event("delete", identity=image(transaction_id=1)), DictState()).records[0].key
    assert a == b == c


def test_image_helper_roundtrip() -> None:
    assert RowImage(("a",), ("int4",), (1,)).as_dict() == {"a": 1}


@pytest.mark.parametrize("emit_delete_records", [False, True])
def test_fast_path_equals_full_path(emit_delete_records: bool) -> None:
    from tests.support.demux import Workload

    fast_rk = Rekeyer(prefix="walbus", database="shop", emit_delete_records=emit_delete_records)
    full_rk = Rekeyer(prefix="walbus", database="shop", emit_delete_records=emit_delete_records)
    fast_state, full_state = DictState(), DictState()
    workload = Workload(seed=3)
    values = [v for _ in range(150) for _, v in workload.transaction(20)]
    # Identity on insert/update (REPLICA IDENTITY FULL) and a column named like metadata.
    values.append(encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="update", table="public.t", timestamp=TS,
                               pk=["id"], new=image(id=1, __seq="x"), identity=image(id=1, __seq="y")))
    values.append(encode_event(lsn=1, commit_lsn=2, seq=1, xid=3, operation="insert", table="public.t", timestamp=TS,
                               pk=["id"], new=image(id=2, __lsn="mine", z=1), identity=None))
    for v in values:
        a = fast_rk.rekey_value(v, fast_state)
        b = full_rk.rekey(decode_event(v), full_state)
        assert (a.table, a.records, a.changes, a.unfilled, a.no_pk) == (b.table, b.records, b.changes, b.unfilled, b.no_pk)
        fast_state.apply(a.changes)
        full_state.apply(b.changes)


def test_fast_path_takes_the_common_events() -> None:
    """Inserts, updates (the producer always sends the old key) and deletes: one tuple each, no ChangeEvent."""
    from demux.rekey import _FastEvent
    from tests.support.demux import Workload
    from walbus.contract import CONTRACT_VERSION

    assert _FastEvent.__annotations__["v"] == f"Literal[{CONTRACT_VERSION}]"
    rk = Rekeyer(prefix="walbus", database="shop")
    workload = Workload(seed=5)
    values = [v for _ in range(100) for _, v in workload.transaction(20)]
    ops = [orjson.loads(v)["operation"] for v in values]
    hits = [rk.fast(v) is not None for v in values]
    same_key_updates = [
        v for v, op in zip(values, ops, strict=True)
        if op == "update" and not orjson.loads(v).get("unchanged")
        and rk.rekey(decode_event(v), DictState()).records[0].value is not None
    ]
    assert same_key_updates and all(rk.fast(v) is not None for v in same_key_updates)
    assert sum(hits) / len(hits) > 0.5
    plain = encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="update", table="public.t", timestamp=TS,
                         pk=["id"], new=image(id=1, n=2), identity=image(id=1))
    assert rk.fast(plain) == ("public.t", "walbus.shop.public.t", b'{"id":1}',
                              b'{"id":1,"n":2,"__op":"u","__lsn":1,"__commit_lsn":2,"__seq":0,"__xid":3,"__ts":"%s"}'
                              % TS.encode(), False)
    moved = encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="update", table="public.t", timestamp=TS,
                         pk=["id"], new=image(id=2, n=2), identity=image(id=1))
    assert rk.fast(moved) is None  # a key change: tombstone + row, the full path


@pytest.mark.parametrize("raw", [
    b"not json", b"[]", b'{"v":2}', b'{"v":1,"operation":"insert"}',
    encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="insert", table="nodot", timestamp=TS, pk=["id"],
                 new=image(id=1), identity=None),
    encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t", timestamp=TS, pk=["id"],
                 new={"columns": ["id"], "types": [], "values": [1]}, identity=None),
    encode_event(lsn=True, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t", timestamp=TS,
                 pk=["id"], new=image(id=1), identity=None),
    orjson.dumps({**orjson.loads(encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t",
                                              timestamp=TS, pk=["id"], new=image(id=1), identity=None)),
                  "unchanged": "doc"}),
    # A delete with "columns": null, and one with a position beyond 64 bits (orjson reads a float).
    orjson.dumps({**orjson.loads(encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="delete", table="public.t",
                                              timestamp=TS, pk=["id"], new=None, identity=image(id=1))),
                  "columns": None}),
    encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="delete", table="public.t", timestamp=TS, pk=["id"],
                 new=None, identity=image(id=1)).replace(b'"lsn":1,', b'"lsn":18446744073709551616,'),
    # Integers outside the contract's ranges (FIELD_BITS): unsigned, seq 32 bits.
    encode_event(lsn=-1, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t", timestamp=TS,
                 pk=["id"], new=image(id=1), identity=None),
    encode_event(lsn=1, commit_lsn=2, seq=0, xid=-5, operation="delete", table="public.t", timestamp=TS,
                 pk=["id"], new=None, identity=image(id=1)),
    encode_event(lsn=1, commit_lsn=2, seq=2**32, xid=3, operation="update", table="public.t", timestamp=TS,
                 pk=["id"], new=image(id=1), identity=None),
    encode_event(lsn=1, commit_lsn=-2, seq=0, xid=3, operation="insert", table="public.t", timestamp=TS,
                 pk=["id"], new=image(id=1), identity=None),
])
@pytest.mark.parametrize("warm", [False, True])
def test_fast_path_refuses_what_the_contract_refuses(raw: bytes, warm: bool) -> None:
    from walbus.contract import ContractError

    rk = Rekeyer(prefix="w", database="d")
    if warm:  # the table's shape is already known: a refusal must not depend on it
        good = encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t", timestamp=TS,
                            pk=["id"], new=image(id=1), identity=None)
        assert rk.fast(good) is not None
    assert rk.fast(raw) is None
    with pytest.raises(ContractError):
        rk.rekey_value(raw, DictState())


def test_fast_path_follows_a_table_whose_columns_change() -> None:
    """The checked shape of a table's events is remembered by its bytes: any change is checked again."""
    rk, full = Rekeyer(prefix="w", database="d"), Rekeyer(prefix="w", database="d")

    def ins(pk: list[str], **row: Any) -> bytes:
        return encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t", timestamp=TS,
                            pk=pk, new=image(**row), identity=None)

    def out(raw: bytes) -> tuple[bytes | None, bytes | None]:
        rec = full.rekey(decode_event(raw), DictState()).records[-1]
        return rec.key, rec.value

    steps = [
        ins(["id"], id=1),
        ins(["id"], id=2, name="a"),  # a column added, TOAST-able: needs the store
        ins(["id", "name"], id=3, name="b"),  # the key widened
        ins(["id"], id=4),  # back to the first shape
    ]
    seen = []
    for raw in steps:
        hit = rk.fast(raw)
        assert hit is not None and (hit[2], hit[3]) == out(raw)
        seen.append((hit[2], hit[4]))
    assert seen == [(b'{"id":1}', False), (b'{"id":2}', True), (b'{"id":3,"name":"b"}', True), (b'{"id":4}', False)]
    # The key column missing from the row: not the fast path's to explain.
    assert rk.fast(ins(["nope"], id=5)) is None
    assert rk.fast(ins(["id"], id=6)) is not None
    # A column named twice: the row and the key both keep the last value, as in the full path.
    twice = ins(["id"], id=7).replace(b'"columns":["id"]', b'"columns":["id","id"]').replace(
        b'"types":["int4"]', b'"types":["int4","int4"]').replace(b'"values":[7]', b'"values":[7,8]')
    hit = rk.fast(twice)
    assert hit is not None and (hit[2], hit[3]) == out(twice) and hit[2] == b'{"id":8}'


def _insert(commit_lsn: int = 2, seq: int = 0, table: str = "public.t", **row: Any) -> bytes:
    return encode_event(lsn=1, commit_lsn=commit_lsn, seq=seq, xid=3, operation="insert", table=table, timestamp=TS,
                        pk=["id"], new=image(**row), identity=None)


@pytest.mark.parametrize("warm", [False, True])
def test_misaligned_row_lists_are_contract_errors(warm: bool) -> None:
    """columns/types/values of different lengths: never a row built from misaligned lists."""
    from walbus.contract import ContractError

    rk = Rekeyer(prefix="w", database="d")
    if warm:  # the fast path knows the table's shape (same columns and types bytes)
        assert rk.fast(_insert(id=1, a="x")) is not None
    bad = orjson.loads(_insert(id=2, a="y"))
    bad["values"] = [2, "y", 7]
    raw = orjson.dumps(bad)
    assert rk.fast(raw) is None
    with pytest.raises(ContractError, match="differ in length"):
        rk.rekey_value(raw, DictState())
    with pytest.raises(ContractError, match="differ in length"):
        rk.rekey_record(b"0000000000000002-00000000", raw, DictState())


def test_record_key_must_be_the_event_position() -> None:
    from walbus.contract import ContractError

    rk = Rekeyer(prefix="w", database="d")
    raw = _insert(commit_lsn=0x1A2B, seq=3, id=1)
    good = b"0000000000001A2B-00000003"
    assert rk.fast(raw, good) is not None and rk.rekey_record(good, raw, DictState()).records
    for key in (b"FFFFFFFFFFFFFFFF-FFFFFFFF", b"0000000000001a2b-00000003", b"1A2B-3", b""):
        assert rk.fast(raw, key) is None
        with pytest.raises(ContractError, match=r"not the event's position|not a walbus event key"):
            rk.rekey_record(key, raw, DictState())
    with pytest.raises(ContractError):
        rk.rekey_record(None, raw, DictState())


def test_unusual_table_names_never_escape_the_fast_path() -> None:
    """A malformed table name is the contract's error (DLQ), not an exception out of the fast path."""
    from walbus.contract import ContractError

    rk = Rekeyer(prefix="w", database="d")
    raw = _insert(table='a"b.c', id=1)
    assert rk.fast(raw) is None
    with pytest.raises(ContractError):
        rk.rekey_value(raw, DictState())
    delete = encode_event(lsn=1, commit_lsn=2, seq=0, xid=3, operation="delete", table='a"b.c', timestamp=TS,
                          pk=["id"], new=None, identity=image(id=1))
    assert rk.fast(delete) is None
    # A prefix that leaves no room for any table name: no topic, a RekeyError.
    long = Rekeyer(prefix="p" * 240, database="d")
    assert long.fast(_insert(table="public.t", id=1)) is None
    with pytest.raises(RekeyError, match="no topic name"):
        long.rekey_value(_insert(table="public.t", id=1), DictState())


def test_hashed_topic_replaces_a_colliding_name() -> None:
    from walbus.contract import table_topic

    rk = Rekeyer(prefix="w", database="d")
    raw = _insert(table="public.c_d", id=1, n=2)
    hit = rk.fast(raw)
    assert hit is not None and hit[1] == "w.d.public.c_d"
    hashed = rk.use_hashed_topic("public.c_d")
    assert hashed == table_topic("w", "d", "public", "c_d", hashed=True) != "w.d.public.c_d"
    hit = rk.fast(raw)
    assert hit is not None and hit[1] == hashed
    assert rk.rekey_value(raw, DictState()).records[0].topic == hashed


def test_unchanged_value_of_an_unknown_row_is_a_rekey_error(rk: Rekeyer) -> None:
    """A key whose last output could not be written: filling from the store would publish a stale value."""
    from demux.rekey import unknown_row

    state = DictState()
    run(rk, state, event("insert", new=image(transaction_id=1, doc="old", n=1)))
    key = b'{"transaction_id":1}'
    state.rows[("public.transactions", key)] = unknown_row("too large")
    upd = event("update", new=image(transaction_id=1, n=2), unchanged=["doc"], commit_lsn=0x16B374D900)
    with pytest.raises(RekeyError, match="unknown: too large"):
        rk.rekey(upd, state)
    # A full row (nothing to fill) is fine, and so is a delete record (identity only).
    full = rk.rekey(event("update", new=image(transaction_id=1, doc="new", n=3)), state)
    assert val(full.records[0])["doc"] == "new"
    deleter = Rekeyer(prefix="walbus", database="shop", emit_delete_records=True)
    deleted = deleter.rekey(event("delete", identity=image(transaction_id=1)), state)
    assert {k: v for k, v in val(deleted.records[0]).items() if k not in META_FIELDS} == {"transaction_id": 1}


def test_every_demux_record_reads_back_through_the_contracts_table_meta(rk: Rekeyer) -> None:
    """One definition of the per-table value: what the demux writes (fast and full path), the
    contract's reader takes apart into the row and the ``__`` fields."""
    from walbus.contract import TABLE_META_FIELDS, pop_table_meta

    values = []
    state = DictState()
    for op, name in (("insert", "a"), ("update", "b"), ("delete", "b")):
        ev = event(op, new=None if op == "delete" else image(transaction_id=1, name=name),
                   identity=image(transaction_id=1) if op == "delete" else None)
        out = rk.rekey(ev, state)  # the full path
        state.apply(out.changes)
        values += [r.value for r in out.records if r.value is not None]
        if op != "delete":
            fast = rk.rekey_value(encode_event(**_fields(ev)), state)  # the fast path
            values += [r.value for r in fast.records if r.value is not None]
    assert values
    for value in values:
        row = orjson.loads(value)
        meta = pop_table_meta(row)
        assert tuple(meta) == TABLE_META_FIELDS
        assert meta["__commit_lsn"] == 0x16B374D848 and meta["__xid"] == 777
        assert set(row) == {"transaction_id", "name"}


def _fields(ev: ChangeEvent) -> dict[str, Any]:
    assert ev.new is not None
    return {"lsn": ev.lsn, "commit_lsn": ev.commit_lsn, "seq": ev.seq, "xid": ev.xid, "operation": ev.operation,
            "table": ev.table, "timestamp": ev.timestamp, "pk": list(ev.pk),
            "new": {"columns": list(ev.new.columns), "types": list(ev.new.types), "values": list(ev.new.values)},
            "identity": None}


@pytest.mark.parametrize("bad", [{"__op": "x"}, {"__op": "c", "__lsn": True}, {"__op": "u", "__seq": 1.0}, {}])
def test_contract_refuses_a_table_value_with_bad_meta(bad: dict[str, Any]) -> None:
    from walbus.contract import ContractError, pop_table_meta

    with pytest.raises(ContractError):
        pop_table_meta({"id": 1, **bad})


def test_a_null_in_a_not_null_key_column_is_refused(rk: Rekeyer) -> None:
    # wal2json writes float and numeric NaN/±Infinity as null: three distinct float keys of a
    # table became one key {"id":null} in its compacted topic (found by a key fuzz). A NOT NULL
    # key column that is null is a lost value: the event goes to the dead-letter topic, on the
    # fast path too. A nullable key column (--key-columns) may be null.
    def raw(op: str, values: list[Any], not_null: list[str]) -> bytes:
        image = {"columns": ["id", "v"], "types": ["float8", "text"], "values": values}
        return encode_event(
            lsn=1, commit_lsn=2, seq=0, xid=3, operation=op, table="public.f", timestamp=TS, pk=["id"],
            new=image if op != "delete" else None, identity=image if op == "delete" else None, not_null=not_null,
        )

    state = DictState()
    for op in ("insert", "update", "delete"):
        for _ in range(2):  # the second time the table's shape is known: the fast path's turn
            with pytest.raises(RekeyError, match="NOT NULL but null"):
                rk.rekey_value(raw(op, [None, "x"], ["id"]), state)
    out = rk.rekey_value(raw("insert", [None, "x"], []), state)  # a nullable key column
    assert [r.key for r in out.records] == [b'{"id":null}']
    assert rk.rekey_value(raw("insert", [1.5, "x"], ["id"]), state).records[0].key == b'{"id":1.5}'


def test_an_identity_of_another_unique_index_finds_the_rows_key(tmp_path: Path) -> None:
    """REPLICA IDENTITY USING INDEX on a unique index that is not the primary key: an update's
    or delete's identity holds the index's columns only (docs/contract.md). The old row's key
    must be found from the last-row store: a delete went to the DLQ and left the row in the
    compacted topic, and an update that moved the key left the old key's row there for good."""
    from demux.state import StateStore

    store = StateStore(tmp_path / "s.sqlite")
    store.track("public.idx_t", [])
    rk = Rekeyer(prefix="walbus", database="shop")
    topic = "walbus.shop.public.idx_t"

    def step(ev: ChangeEvent) -> list[tuple[bytes | None, dict[str, Any] | None]]:
        out = rk.rekey(ev, store)
        store.apply(out.changes)
        return [(r.key, None if r.value is None else strip_meta(val(r))) for r in out.records if r.topic == topic]

    def e(op: str, seq: int, new: dict[str, list[Any]] | None, identity: dict[str, list[Any]] | None) -> ChangeEvent:
        return event(op, seq=seq, table="public.idx_t", pk=["id"], new=new, identity=identity)

    assert step(e("insert", 0, image(id=1, code="c1", a="x"), None)) == [(b'{"id":1}', {"id": 1, "code": "c1", "a": "x"})]
    assert step(e("insert", 1, image(id=2, code="c2", a="y"), None)) == [(b'{"id":2}', {"id": 2, "code": "c2", "a": "y"})]
    store.commit("1")
    # the key moves: 1 -> 10, identity {"code": "c1"}
    assert step(e("update", 2, image(id=10, code="c1", a="x"), image(code="c1"))) == [
        (b'{"id":1}', None), (b'{"id":10}', {"id": 10, "code": "c1", "a": "x"})]
    # a plain update keeps its key; the code changes (the identity is the old code)
    assert step(e("update", 3, image(id=2, code="c3", a="y"), image(code="c2"))) == [
        (b'{"id":2}', {"id": 2, "code": "c3", "a": "y"})]
    # deletes by the index's columns, in the open transaction and after its commit
    assert step(e("delete", 4, None, image(code="c3"))) == [(b'{"id":2}', None)]
    store.commit("2")
    assert step(e("delete", 5, None, image(code="c1"))) == [(b'{"id":10}', None)]
    # a row the demux never saw: nothing to tombstone, and no error
    assert step(e("delete", 6, None, image(code="zz"))) == []
    assert list(store.keys("public.idx_t")) == []


def test_an_identity_without_the_key_needs_the_store(rk: Rekeyer) -> None:
    """Without the table in the store the result cannot be trusted: the worker must load it."""
    state = DictState()
    out = rk.rekey(event("delete", pk=["id"], identity=image(code="c1")), state)
    assert out.needs_state
    out = rk.rekey(event("update", pk=["id"], new=image(id=1, code="c1"), identity=image(code="c1")), state)
    assert out.needs_state


def test_keys_sorted_in_pieces_are_sorted() -> None:
    # A truncate's keys are sorted in pieces and merged (one sort holds the GIL: see the function).
    rng = random.Random(7)
    keys = [orjson.dumps({"id": rng.randrange(10**12)}) for _ in range(120_000)]
    assert list(_sorted_in_pieces(set(keys))) == sorted(set(keys))
    assert list(_sorted_in_pieces([b"b", b"a"])) == [b"a", b"b"]
