"""The native wal2json insert runs against pure Python: the same items, bytes for bytes, or the
same error, for any wal2json (format 2) stream of random tables, values and odd messages."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.catalog import TableInfo
from producer.codec import CaptureFilter, ChangeRun, EncodedEvent
from producer.decoders import WalMessages, flat
from producer.decoders.wal2json import Wal2jsonDecoder
from producer.native import encode_wal2json_changes, loads_exact
from tests.support.catalog import StaticCatalog
from tests.support.prop import columns, decoded, strict
from walbus.native import native_module

# type name → (oid, wal2json's declared type)
TYPES = {"int2": (21, "smallint"), "int4": (23, "integer"), "int8": (20, "bigint"), "oid": (26, "oid"),
         "float4": (700, "real"), "float8": (701, "double precision"), "bool": (16, "boolean"),
         "text": (25, "text"), "numeric": (1700, "numeric(12,2)"), "jsonb": (3802, "jsonb"),
         "varchar": (1043, "character varying(40)"), "bytea": (17, "bytea")}
STRINGS = st.one_of(st.text(st.characters(exclude_categories=("Cs",))),
                    st.text(st.sampled_from('a"\\\n\t\x01\x7f/\u00e4\u2028\U0001f600')))


def raw_value(typname: str) -> st.SearchStrategy[bytes]:
    """A column value as wal2json prints it (numbers and booleans bare, the rest quoted), now
    and then one it would not print."""
    odd = st.sampled_from([b'"7"', b"7.0", b"-0", b"1e5", b"1E+400", b"99999999999999999999999", b"true", b"[1]",
                           b'"\\ud800"', b'"\xff"', b"00", b"-", b"1.", b".5", b"null",
                           # escapes other than the ones the events' JSON writes for the same characters
                           b'"a\\/b"', b'"\\u00e4\\""', b'"\\u001F"', b'"\\u001f\\\\"', b'"\\u0008"', b'"x\\u000a"'])
    usual: st.SearchStrategy[bytes]
    if typname in ("int2", "int4", "int8", "oid"):
        usual = st.integers(-(2**63), 2**63 - 1).map(lambda i: str(i).encode())
    elif typname in ("float4", "float8"):
        usual = st.one_of(st.floats(allow_nan=False, allow_infinity=False).map(lambda f: repr(f).encode()),
                          st.integers(-(10**6), 10**6).map(lambda i: str(i).encode()))
    elif typname == "numeric":
        usual = st.decimals(allow_nan=False, allow_infinity=False, places=2).map(lambda d: str(d).encode())
    elif typname == "bool":
        usual = st.sampled_from([b"true", b"false"])
    else:
        usual = STRINGS.map(orjson.dumps)
    return st.integers(0, 12).flatmap(lambda n: odd if n == 0 else st.one_of(usual, st.just(b"null")))


def _column(name: str, typname: str, optional: bool | None, value: bytes) -> bytes:
    oid, declared = TYPES[typname]
    out = b'{"name":' + orjson.dumps(name) + b',"type":' + orjson.dumps(declared) + b',"typeoid":' + str(oid).encode()
    if optional is not None:
        out += b',"optional":' + (b"true" if optional else b"false")
    return out + b',"value":' + value + b"}"


@st.composite
def streams(draw: st.DrawFn) -> tuple[StaticCatalog, list[tuple[int, bytes]]]:
    cols = draw(columns(1, 5))
    types = [draw(st.sampled_from(sorted(TYPES))) for _ in cols]
    pk = cols[: draw(st.integers(0, len(cols)))]
    replident = draw(st.sampled_from("ddddf"))  # f: the identity is the whole old row
    info = TableInfo("s", "t", tuple(cols), tuple(TYPES[t][0] for t in types), tuple(pk), replident,
                     tuple(cols) if replident == "f" else tuple(pk))
    catalog = StaticCatalog.of({oid: name for name, (oid, _) in TYPES.items()}, info)
    optional = [draw(st.sampled_from([None, True, False])) for _ in cols]

    def row(action: str, key: str = "columns") -> bytes:
        cells = [_column(c, t, o, draw(raw_value(t))) for c, t, o in zip(cols, types, optional, strict=True)]
        if action == "U" and len(cells) > 1 and draw(st.integers(0, 5)) == 0:
            del cells[draw(st.integers(1, len(cells) - 1))]  # an unchanged TOAST value is left out
        return b'"' + key.encode() + b'":[' + b",".join(cells) + b"]"

    def identity() -> bytes:
        """wal2json's old key: the key columns (no "optional"); now and then another set."""
        which = draw(st.sampled_from(["key", "key", "key", "all", "first"]))
        names = {"key": pk, "all": cols, "first": cols[:1]}[which]
        cells = [_column(c, t, None, draw(raw_value(t))) for c, t in zip(cols, types, strict=True) if c in names]
        return b'"identity":[' + b",".join(cells) + b"]"

    msgs = [b'{"action":"B","xid":42,"timestamp":"2026-01-01 00:00:00.5+00","lsn":"0/900","nextlsn":"0/930"}']
    for n in range(draw(st.integers(1, 12))):  # runs of inserts go through the native path in one call
        op = draw(st.sampled_from("IIIIUUUDDX"))
        lsn = f'"lsn":"0/{0x900 + n:X}"'.encode()
        # A run's changes of one shape are taken without a parse (their text between the parts
        # that vary repeated): parts that vary here, and now and then a change of another shape.
        xid = draw(st.sampled_from([b"42", b"42", b"43", b"4294967295"]))
        stamp = draw(st.sampled_from([b"", b"", b'"timestamp":"2026-01-01 00:00:00.5+00",',
                                      b'"timestamp":"2026-01-01 00:00:01+00",', b'"timestamp":"\\u00322026",']))
        head = (b'{"action":"' + (b"I" if op == "X" else op.encode()) + b'","xid":' + xid + b"," + stamp + lsn
                + b',"schema":"s","table":"t",')
        if op in ("I", "X"):
            msg = head + row(op)
            if op == "X":  # another signature: a declared type changed, or another table
                msg = draw(st.sampled_from([msg.replace(b'"typeoid"', b'"type":"x","typeoid"', 1),
                                            msg.replace(b'"table":"t"', b'"table":"u"'),
                                            msg.replace(b'"schema":"s"', b'"schema":"\\u0073"')]))
        elif op == "U":
            msg = head + row(op) + b"," + identity()
        else:
            msg = head + identity()
        msg += b"}"
        if draw(st.integers(0, 10)) == 0:  # the same change, spelled otherwise
            spelled = draw(st.sampled_from([(b'"lsn":"0/', b'"lsn":"0\\/'), (b',"value":', b',"value": '),
                                            (b'"xid":', b'"xid":null,"xid":'), (b'"xid":' + xid, b'"xid":"' + xid + b'"'),
                                            (b'"value":', b'"value":"\\u0000",  "value":'), (b"}", b"} ")]))
            msg = msg.replace(*spelled, 1)
        if draw(st.integers(0, 24)) == 0:  # damaged: cut short
            msg = msg[: draw(st.integers(1, len(msg)))]
        msgs.append(msg)
    msgs.append(b'{"action":"C","xid":42,"timestamp":"2026-01-01 00:00:00.5+00","lsn":"0/930","nextlsn":"0/960"}')
    return catalog, [(0x100 + i, m) for i, m in enumerate(msgs)]


def outcome(native: bool, catalog: StaticCatalog, msgs: WalMessages) -> list[Any]:
    """Each item the decoder gives, then the error that stopped it (if one did)."""
    return decoded(lambda: Wal2jsonDecoder(catalog, CaptureFilter(), native=native).decode(msgs))


@settings(max_examples=300)
@given(streams())
def test_native_and_pure_python_give_the_same_items(stream: tuple[StaticCatalog, list[tuple[int, bytes]]]) -> None:
    catalog, msgs = stream
    expected = outcome(False, catalog, msgs)
    assert outcome(True, catalog, msgs) == expected
    module = native_module()
    if module is not None:  # the native reader's form: one buffer, the run encoder reads it
        assert outcome(True, catalog, module.Messages(msgs)) == expected


def test_a_run_of_plain_inserts_goes_natively_in_one_item() -> None:
    """The hot path is taken: after the first insert (decoded in Python, which learns the
    table's columns), the following ones come as one ChangeRun."""
    if encode_wal2json_changes() is None:  # pure Python only here (test_prop_native checks it is built)
        return
    info = TableInfo("s", "t", ("id", "name"), (23, 25), ("id",), "d", ("id",))
    catalog = StaticCatalog.of({23: "int4", 25: "text"}, info)
    msgs = [b'{"action":"B","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/900","nextlsn":"0/930"}']
    msgs += [b'{"action":"I","xid":42,"lsn":"0/%X","schema":"s","table":"t","columns":[%s,%s]}'
             % (0x900 + i, _column("id", "int4", False, b"%d" % i), _column("name", "text", True, orjson.dumps(f"n\u00e4{i}")))
             for i in range(5)]
    items = list(Wal2jsonDecoder(catalog, CaptureFilter()).decode([(0, m) for m in msgs]))
    assert [type(i).__name__ for i in items] == ["TxnBegin", "EncodedEvent", "ChangeRun"]
    run = items[2]
    assert isinstance(run, ChangeRun) and run.rows is None  # made only when somebody looks
    assert run.images()[0] == [[i, f"n\u00e4{i}"] for i in range(1, 5)]
    assert [orjson.loads(v)["seq"] for v in run.values] == [1, 2, 3, 4]


def test_a_transaction_of_updates_and_deletes_goes_natively() -> None:
    """Updates with every column and deletes by the key are the native path's too, once an
    update (decoded in Python) showed the table's columns: the same events as pure Python."""
    if encode_wal2json_changes() is None:
        return
    info = TableInfo("s", "t", ("id", "name"), (23, 25), ("id",), "d", ("id",))
    catalog = StaticCatalog.of({23: "int4", 25: "text"}, info)

    def key(i: int) -> bytes:
        return b'"identity":[%s]' % _column("id", "int4", None, b"%d" % i)

    msgs = [b'{"action":"B","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/900","nextlsn":"0/930"}']
    for i, op in enumerate("UUUUDUD"):
        head = b'{"action":"%s","xid":42,"lsn":"0/%X","schema":"s","table":"t",' % (op.encode(), 0x900 + i)
        if op == "D":
            msgs.append(head + key(i) + b"}")
        else:
            cols = b",".join([_column("id", "int4", False, b"%d" % i), _column("name", "text", True, orjson.dumps(f"n{i}"))])
            msgs.append(head + b'"columns":[' + cols + b"]," + key(i) + b"}")
    msgs.append(b'{"action":"C","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/930","nextlsn":"0/960"}')
    stream = [(0, m) for m in msgs]
    items = list(Wal2jsonDecoder(catalog, CaptureFilter()).decode(stream))
    assert [type(i).__name__ for i in items] == ["TxnBegin", "EncodedEvent", "ChangeRun", "TxnEnd"]
    run = items[2]
    assert isinstance(run, ChangeRun) and run.operations == b"UUUDUD"
    rows, olds = run.images()
    assert rows[3] is None and olds[3] == [4, None]
    assert outcome(True, catalog, stream) == outcome(False, catalog, stream)


@pytest.mark.parametrize(("other", "taken"), [
    ((b'"table":"t"', b'"table":"u"'), False),  # another table, its name as long
    ((b'"optional":true', b'"optional":null'), False),  # another signature
    ((b'"type":"text"', b'"type":"name"'), False),
    ((b'"name":"b"', b'"name":"c"'), False),
    ((b'"value":"', b'"value": "'), True),  # the same change, spelled otherwise: serde reads it
    ((b'"lsn":"0/', b'"lsn":"0\\/'), True),
    ((b'"xid":42', b'"xid":"42"'), True),
])
def test_only_changes_of_the_learned_shape_are_taken_without_a_parse(other: tuple[bytes, bytes], taken: bool) -> None:
    """After its first change a native run takes those that repeat its text between the parts
    that vary (values, lsn, xid, timestamp) without parsing them: a change that differs
    anywhere else, even by as many bytes, is read by serde (and decided by the slow path)."""
    if encode_wal2json_changes() is None:
        return
    info = TableInfo("s", "t", ("a", "b"), (23, 25), ("a",), "d", ("a",))
    catalog = StaticCatalog.of({23: "int4", 25: "text", 19: "name"}, info)

    def insert(i: int, text: str) -> bytes:
        return (b'{"action":"I","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/%X","schema":"s","table":"t","columns":[%s,%s]}'
                % (0x900 + i, _column("a", "int4", False, b"%d" % i), _column("b", "text", True, orjson.dumps(text))))

    msgs = [b'{"action":"B","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/900","nextlsn":"0/930"}']
    msgs += [insert(i, f"v\u00e4\"{i}") for i in range(4)]
    msgs.append(insert(4, "x").replace(*other, 1))
    msgs.append(b'{"action":"C","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/930","nextlsn":"0/960"}')
    stream = [(0, m) for m in msgs]
    items = list(Wal2jsonDecoder(catalog, CaptureFilter()).decode(stream))
    runs = [i for i in items if isinstance(i, ChangeRun)]
    assert [len(r.keys) for r in runs] == [4 if taken else 3]  # the first insert is Python's
    assert outcome(True, catalog, stream) == outcome(False, catalog, stream)


@pytest.mark.parametrize("escaped", [b'"a\\/b"', b'"\\u00e4"', b'"\\u001F"', b'"\\u001f"', b'"\\u0008"', b'"\\u000a"',
                                     b'"\\"\\\\\\n\\t\\b\\f\\r\\u0001"', b'"\\ud83d\\ude00"', b'"plain \xc3\xa4"'])
def test_a_runs_escaped_text_is_written_as_the_events_json_writes_it(escaped: bytes) -> None:
    """A text value whose escapes are the ones the events' JSON writes is copied as it is; any
    other spelling of the same characters (``\\/``, ``\\u00e4``, upper-case hex, a short form
    written long) is decoded and written again: the same bytes as pure Python either way."""
    if encode_wal2json_changes() is None:
        return
    info = TableInfo("s", "t", ("a", "b"), (23, 25), ("a",), "d", ("a",))
    catalog = StaticCatalog.of({23: "int4", 25: "text"}, info)
    msgs = [b'{"action":"B","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/900","nextlsn":"0/930"}']
    msgs += [b'{"action":"I","xid":42,"lsn":"0/%X","schema":"s","table":"t","columns":[%s,%s]}'
             % (0x900 + i, _column("a", "int4", False, b"%d" % i), _column("b", "text", True, escaped)) for i in range(4)]
    msgs.append(b'{"action":"C","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/930","nextlsn":"0/960"}')
    stream = [(0, m) for m in msgs]
    items = list(Wal2jsonDecoder(catalog, CaptureFilter()).decode(stream))
    assert [len(i.keys) for i in items if isinstance(i, ChangeRun)] == [3]
    assert outcome(True, catalog, stream) == outcome(False, catalog, stream)


@pytest.mark.parametrize("native", [True, False])
def test_a_float_columns_negative_zero_keeps_its_sign(native: bool) -> None:
    """wal2json prints float8 -0 as the bare number -0, which JSON parsers read as the integer
    0: the event said 0.0 (pgoutput's says -0.0)."""
    info = TableInfo("s", "t", ("id", "f", "n"), (23, 701, 1700), ("id",), "d", ("id",))
    catalog = StaticCatalog.of({23: "int4", 701: "float8", 1700: "numeric"}, info)
    msgs = [b'{"action":"B","xid":42,"timestamp":"2026-01-01 00:00:00+00","lsn":"0/900","nextlsn":"0/930"}']
    msgs += [b'{"action":"I","xid":42,"lsn":"0/%X","schema":"s","table":"t","columns":[%s,%s,%s]}'
             % (0x900 + i, _column("id", "int4", False, b"-0"), _column("f", "float8", True, b"-0"),
                _column("n", "numeric", True, b"-1.50" if i else b"7"))
             for i in range(3)]
    events = list(flat(Wal2jsonDecoder(catalog, CaptureFilter(), native=native).decode([(0, m) for m in msgs])))
    rows = [strict(e.new) for e in events if isinstance(e, EncodedEvent) and e.new is not None]
    assert rows == [strict([0, -0.0, n]) for n in ("7", "-1.50", "-1.50")]
    assert all(b'"values":[0,-0.0,' in e.value for e in events if isinstance(e, EncodedEvent))


NUMBER_TEXTS = st.one_of(st.integers().map(str), st.floats(allow_nan=False, allow_infinity=False).map(repr),
                         st.sampled_from(["-0", "0", "1.50", "-0.0", "1E5", "1e-7", "2.5E+3", "18446744073709551616"]))
JSON_TEXTS = st.recursive(
    st.one_of(NUMBER_TEXTS, st.sampled_from(["true", "false", "null"]), STRINGS.map(lambda s: orjson.dumps(s).decode()),
              st.sampled_from(['"\\ud800"', '"\\u00e4\\/"', "NaN", "-Infinity", "01", "1.", "[1,]"])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from(["a", "value", "ä", "a"]).map(lambda k: orjson.dumps(k).decode()), inner),
                 max_size=4).map(lambda kvs: "{" + ",".join(f"{k}:{v}" for k, v in kvs) + "}"),
    ),
    max_leaves=12,
)


@settings(max_examples=500)
@given(JSON_TEXTS, st.sampled_from(["", " ", "\n"]))
def test_the_native_exact_reader_reads_what_the_standard_library_reads(text: str, pad: str) -> None:
    """walbus_native.loads_exact against json.loads(parse_float=str) with -0 as -0.0: equal
    values of equal types, or None (the standard library decides those, errors included)."""
    from producer.decoders.wal2json import _int_or_negative_zero

    native = loads_exact()
    if native is None:
        return
    buf = (pad + text + pad).encode()
    got = native(buf)
    if got is None:
        return
    assert _deep(got) == _deep(json.loads(buf, parse_float=str, parse_int=_int_or_negative_zero))


def _deep(value: Any) -> Any:
    """``strict`` into objects too (their members in order)."""
    if isinstance(value, dict):
        return ("dict", [(k, _deep(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [_deep(v) for v in value])
    return strict(value)
