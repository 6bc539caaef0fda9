"""The native hot path (native/, walbus_native) against pure Python: the same items, bytes for
bytes, or the same error, for any pgoutput stream (random relations and tuples)."""

from __future__ import annotations

import shutil
import struct
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.catalog import TableInfo
from producer.codec import CaptureFilter, text_converter
from producer.decoders import WalMessages
from producer.decoders.pgoutput import PgoutputDecoder
from producer.native import decode_tuple
from tests.support.catalog import StaticCatalog
from tests.support.prop import FLOAT_SPECIALS, columns, decoded, strict
from walbus.contract import qualify_table
from walbus.native import native_module, switched_off

# A type name per kind of converter (and a few that are text to the decoder).
TYPES = {"int2": 21, "int4": 23, "int8": 20, "oid": 26, "float4": 700, "float8": 701, "bool": 16, "text": 25,
         "numeric": 1700, "jsonb": 3802, "timestamptz": 1184, "varchar": 1043}
INTS = ("int2", "int4", "int8", "oid")
FLOATS = ("float4", "float8")
HUGE = "ä" * 70_000 + '"\\\n'


def _text(value: Any) -> bytes:
    return str(value).encode()


def raw_value(typname: str) -> st.SearchStrategy[bytes]:
    """PostgreSQL's text output of a column of ``typname``, now and then text that is not quite that."""
    odd = st.sampled_from([b"", b" 1", b"1_0", b"+7", b"007", b"-0", b"x", b"\xff\xfe", b"\xed\xa0\x80", b"1e5", b"inf",
                           b"-nan", b"Infinity", b"0x10", "\u0663".encode(), HUGE.encode()])
    usual: st.SearchStrategy[bytes]
    if typname in INTS:
        usual = st.one_of(st.integers(-(2**63), 2**63 - 1).map(_text), st.integers().map(_text),
                          st.sampled_from([_text(2**64 - 1), _text(2**64), _text(-(2**63) - 1)]))
    elif typname in FLOATS:
        usual = st.one_of(st.floats().map(lambda f: repr(f).encode()), st.floats(1e15, 1e300).map(lambda f: repr(f).encode()), st.floats(width=32).map(lambda f: f"{f:g}".encode()),
                          st.sampled_from([s.encode() for s in FLOAT_SPECIALS] + [b"1e+16", b"1.5e-07", b"-0", b"1e400"]))
    elif typname == "bool":
        usual = st.sampled_from([b"t", b"f"])
    else:
        usual = st.one_of(st.text(st.characters(exclude_categories=("Cs",))).map(str.encode),
                          st.text(st.sampled_from('a"\\\n\t\x01\x7f\u00e4\U0001f600')).map(str.encode),
                          st.sampled_from([b"\x00\x1f\x7f\x08\x0c", "\u2028\U0001f600".encode()]))
    return st.integers(0, 14).flatmap(lambda n: odd if n == 0 else usual)


def _tuple(cells: list[bytes | str | None]) -> bytes:
    """TupleData: ``None`` is NULL, ``"u"`` an unchanged TOAST value, bytes a text value."""
    out = struct.pack(">H", len(cells))
    for c in cells:
        if c is None:
            out += b"n"
        elif isinstance(c, str):
            out += c.encode()
        else:
            out += b"t" + struct.pack(">I", len(c)) + c
    return out


def one_table(cols: list[str], types: list[str], pk: list[str]) -> StaticCatalog:
    """The catalog of one generated table."""
    info = TableInfo("s", "t", tuple(cols), tuple(TYPES[t] for t in types), tuple(pk), "d", tuple(pk))
    return StaticCatalog.of({oid: name for name, oid in TYPES.items()}, info)


@st.composite
def streams(draw: st.DrawFn, keyed: bool = False) -> tuple[StaticCatalog, CaptureFilter, list[tuple[int, bytes]]]:
    """``keyed``: a table with a key and no masked or excluded column, whose updates and
    deletes the native run may take."""
    cols = draw(columns(1, 5))
    types = [draw(st.sampled_from(sorted(TYPES))) for _ in cols]
    pk = cols[: draw(st.integers(1 if keyed else 0, len(cols)))]
    capture = CaptureFilter() if keyed else CaptureFilter(
        mask_columns=tuple("s." + qualify_table("t", c) for c in cols if draw(st.integers(0, 5)) == 0),
        exclude_columns=tuple("s." + qualify_table("t", c) for c in cols if draw(st.integers(0, 5)) == 0),
    )
    relation = b"R" + struct.pack(">I", 7) + b"s\0t\0" + draw(st.sampled_from([b"d", b"d", b"d", b"f"])) + struct.pack(">H", len(cols))
    for c, t in zip(cols, types, strict=True):
        relation += bytes([c in pk]) + c.encode() + b"\0" + struct.pack(">Ii", TYPES[t], -1)

    def cells(unchanged: bool) -> list[bytes | str | None]:
        out: list[bytes | str | None] = []
        for t in types:
            how = draw(st.sampled_from(["value", "value", "value", "null", "u" if unchanged else "null"]))
            out.append(draw(raw_value(t)) if how == "value" else None if how == "null" else "u")
        return out

    msgs = [b"B" + struct.pack(">QqI", 0x900, 12345, 42), relation]
    for _ in range(draw(st.integers(1, 8))):  # runs of changes go through the native path in one call
        op = draw(st.sampled_from(["I", "I", "I", "U", "D"]))
        head = op.encode() + struct.pack(">I", 7)
        if op == "I":
            msg = head + b"N" + _tuple(cells(False))
        elif op == "U":
            old = draw(st.sampled_from([b"", b"", b"K", b"O"]))
            msg = head + (old + _tuple(cells(False)) if old else b"") + b"N" + _tuple(cells(True))
        else:
            msg = head + draw(st.sampled_from([b"K", b"K", b"O"])) + _tuple(cells(False))
        if draw(st.integers(0, 19)) == 0:  # damaged: cut short, or a column kind that does not exist
            msg = draw(st.sampled_from([msg[: draw(st.integers(5, len(msg)))], msg.replace(b"t\0", b"x\0", 1)]))
        msgs.append(msg)
    msgs.append(b"C" + struct.pack(">bQQq", 0, 0x900, 0x930, 12345))
    return one_table(cols, types, pk), capture, [(0x100 + i, m) for i, m in enumerate(msgs)]


def outcome(native: bool, tables: StaticCatalog, capture: CaptureFilter, msgs: WalMessages) -> list[Any]:
    """Each item the decoder gives, then the error that stopped it (if one did)."""
    return decoded(lambda: PgoutputDecoder(tables, capture, native=native).decode(msgs))


def test_the_native_path_is_there_where_it_can_be_built() -> None:
    # scripts/setup.sh builds it when cargo is present; without one, pure Python is all there is.
    assert decode_tuple() is not None or shutil.which("cargo") is None or switched_off()


@settings(max_examples=250)
@given(st.one_of(streams(), streams(keyed=True)))
def test_native_and_pure_python_give_the_same_items(stream: tuple[StaticCatalog, CaptureFilter, list[tuple[int, bytes]]]) -> None:
    tables, capture, msgs = stream
    expected = outcome(False, tables, capture, msgs)
    assert outcome(True, tables, capture, msgs) == expected
    module = native_module()
    if module is not None:  # the native reader's form: one buffer, the run encoder reads it
        assert outcome(True, tables, capture, module.Messages(msgs)) == expected


def test_native_renders_what_orjson_renders() -> None:
    """Edge values the random streams may miss, through the plain insert path (native JSON)."""
    native = decode_tuple()
    if native is None:  # pure Python only here (see the test above)
        return
    kinds = b"ifbt"
    rows = [
        [b"-9223372036854775808", b"1e16", b"f", b'\x00"\\\x1f\x7f\xe2\x80\xa8'],
        [b"18446744073709551615", b"-0", b"t", HUGE.encode()],
        [b"0", b"5e-324", b"t", b""],
        [b"7", b"1.7976931348623157e308", b"x", b"\xf0\x9f\x98\x80"],
        [b"7", b"0.00001", b"t", b"a"],
        [b"7", b"0.000001", b"t", b"a"],
    ]
    convs = [text_converter(t) for t in ("int8", "float8", "bool", "text")]
    for row in rows:
        got = native(_tuple(list(row)), 0, kinds, True)
        assert got is not None
        values = [c(v) for c, v in zip(convs, row, strict=True)]
        assert strict(got[0]) == strict(values) and got[3] == orjson.dumps(values)


def test_the_native_replication_reader_is_there_with_psycopgs_binary_libpq() -> None:
    """producer.native.copy_reader: built with the extension where psycopg runs its own libpq;
    the replication stream then takes libpq's messages in one call per read."""
    from psycopg import pq

    from producer.native import copy_reader

    if decode_tuple() is None or pq.__impl__ != "binary":
        assert copy_reader() is None or decode_tuple() is not None
        return
    reader = copy_reader()
    assert reader is not None
    with pytest.raises(ValueError):
        reader.read(0, [], 1)  # no connection: refused, never dereferenced


def test_native_run_keys_are_the_encoders_keys() -> None:
    """A run's keys are written natively from EventEncoder.key_parts: the same bytes as the
    encoder's own keys, past 8 hex digits of seq too."""
    from producer.codec import EventEncoder
    from producer.native import encode_changes

    native = encode_changes()
    if native is None:  # pure Python only here (see the test above)
        return
    enc = EventEncoder()
    enc.begin(0xABCDEF0123, 7, "2026-01-01T00:00:00+00:00")
    insert = b"I" + struct.pack(">I", 7) + b"N" + _tuple([b"1"])
    for seq in (0, 0xA, 0xFFFFFFFE, 0x1_0000_0000):
        keys, _, _, _, ops = native([(1, insert)] * 2, 0, 7, b"i", (b"", b"", b"", b""), enc.key_parts(), seq, 2)
        assert ops == b"II"
        expected = [enc._key_template % s for s in (seq, seq + 1)]  # the encoder's own keys
        assert keys == expected == [b"000000ABCDEF0123-%08X" % s for s in (seq, seq + 1)]


def test_a_pgoutput_run_makes_its_rows_only_when_asked() -> None:
    """The native run hands over keys and values; the rows' Python values are made only when
    somebody looks (ChangeRun.images: an incremental snapshot's watch, an error), the same."""
    from producer.codec import ChangeRun
    from producer.native import encode_changes

    if encode_changes() is None:  # pure Python only here (see the test above)
        return
    relation = b"R" + struct.pack(">I", 7) + b"s\0t\0d" + struct.pack(">H", 2)
    relation += b"\1id\0" + struct.pack(">Ii", TYPES["int4"], -1) + b"\0v\0" + struct.pack(">Ii", TYPES["text"], -1)
    inserts = [b"I" + struct.pack(">I", 7) + b"N" + _tuple([b"%d" % i, b"r%d" % i]) for i in range(3)]
    delete = b"D" + struct.pack(">I", 7) + b"K" + _tuple([b"1", None])
    msgs = [(0x100 + i, m) for i, m in enumerate([b"B" + struct.pack(">QqI", 0x900, 12345, 42), relation, *inserts, delete])]
    items = list(PgoutputDecoder(one_table(["id", "v"], ["int4", "text"], ["id"]), CaptureFilter()).decode(msgs))
    run = next(i for i in items if isinstance(i, ChangeRun))
    assert run.rows is None and run.operations == b"IIID"
    assert run.images() == ([[0, "r0"], [1, "r1"], [2, "r2"], None], [None, None, None, [1, None]])
    assert [e.operation for e in run.events()] == ["insert", "insert", "insert", "delete"]


def test_a_reads_messages_read_as_its_list() -> None:
    """walbus_native.Messages (what the native reader fills) reads as the list of
    ``(position, payload)`` pairs the pure-Python reader makes."""
    module = native_module()
    if module is None:
        return
    pairs = [(0x16B3748, b"I\0\0\0\x07N"), (2**64 - 1, b""), (0, b"C" * 3000)]
    messages = module.Messages(pairs)
    assert len(messages) == 3 and list(messages) == pairs and [messages[i] for i in range(3)] == pairs
    assert messages[-1] == pairs[-1] and not module.Messages() and bool(messages)
    with pytest.raises(IndexError):
        messages[3]
