"""Property: a row read through COPY's text format gives the very event bytes the stream gives
for the same row through pgoutput's text tuple (both carry each value's type output text).

The COPY line is escaped the way PostgreSQL's CopyAttributeOutText does it (backslash, the
tab delimiter, newline, carriage return, backspace, form feed, vertical tab; ``\\N`` for NULL).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.codec import CaptureFilter, EventEncoder, Relation, text_converter, text_kind
from producer.decoders import flat
from producer.decoders.pgoutput import PgoutputDecoder
from producer.native import encode_copy_rows
from producer.snapshot import read_events
from producer.tablescan import convert_line, convert_row, str_converters
from tests.support.prop import json_values, strict

_COPY_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\b": "\\b", "\f": "\\f", "\v": "\\v"}

texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40) | st.sampled_from(
    ["\\N", "\\", "a\tb\nc\rd\be\ff\vg", '"quoted" \'and\'', "\\x41\\101", "é😀"]
)


def _float_text(f: float) -> str:
    if f != f:
        return "NaN"
    if f in (float("inf"), float("-inf")):
        return "Infinity" if f > 0 else "-Infinity"
    return repr(f)


def _array_text(items: list[str | None]) -> str:
    quoted = ('"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"' if s is not None else "NULL" for s in items)
    return "{" + ",".join(quoted) + "}"


# Per type, its output function's text.
OUTPUTS: dict[str, st.SearchStrategy[str]] = {
    "int2": st.integers(-(2**15), 2**15 - 1).map(str),
    "int4": st.integers(-(2**31), 2**31 - 1).map(str),
    "int8": st.integers(-(2**63), 2**63 - 1).map(str),
    "float8": st.floats().map(_float_text),
    "bool": st.sampled_from(["t", "f"]),
    "text": texts,
    "_text": st.lists(st.none() | texts, max_size=4).map(_array_text),
    "jsonb": json_values.map(lambda v: orjson.dumps(v).decode()),
    "bytea": st.binary(max_size=20).map(lambda b: "\\x" + b.hex()),
    "numeric": st.decimals(allow_nan=True, allow_infinity=False).map(lambda d: "NaN" if d.is_nan() else str(Decimal(d))),
    "timestamptz": st.datetimes().map(lambda d: d.isoformat(sep=" ") + "+00"),
}


@st.composite
def rows(draw: st.DrawFn) -> tuple[list[str], list[str | None]]:
    types = draw(st.lists(st.sampled_from(sorted(OUTPUTS)), min_size=1, max_size=8))
    values = [draw(st.none() | OUTPUTS[t]) for t in types]
    return types, values


def copy_line(values: list[str | None]) -> bytes:
    fields = ("\\N" if v is None else "".join(_COPY_ESCAPES.get(c, c) for c in v) for v in values)
    return ("\t".join(fields) + "\n").encode()


def pgoutput_tuple(values: list[str | None]) -> bytes:
    parts = [struct.pack(">H", len(values))]
    for v in values:
        if v is None:
            parts.append(b"n")
        else:
            raw = v.encode()
            parts.append(b"t" + struct.pack(">I", len(raw)) + raw)
    return b"".join(parts)


@given(rows())
def test_copy_text_read_events_equal_the_pgoutput_ones(row: tuple[list[str], list[str | None]]) -> None:
    types, texts_out = row
    cols = [f"c {i}" for i in range(len(types))]
    rel = Relation(7, "public", "t", cols, types, [False] * len(cols), []).prepare(CaptureFilter())
    convs = [text_converter(t) for t in types]
    streamed, _, _ = PgoutputDecoder._tuple(pgoutput_tuple(texts_out), 0, convs)
    line = copy_line(texts_out)
    read = convert_line(line, convs, str_converters(types))
    assert convert_row(line, convs)[0] == read
    events = []
    for values in (streamed, read):
        enc = EventEncoder()
        enc.begin(0x1234, 5, "2024-01-02T03:04:05.000001+00:00")
        events.append(enc.read(rel, 0x1234, values))
    assert events[0].key == events[1].key
    assert events[0].value == events[1].value


ODD_FIELDS = st.sampled_from(["1_0", " 1", "+7", "007", "-0", "x", "1e5", "Infinity", "-nan", "18446744073709551616", "\\",
                               "a\\", "\u0663", "t", ""])


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[str], list[bytes]]:
    """A table's types and COPY lines of it: its types' output texts, now and then an odd
    field, a line with a field too many or too few."""
    types = draw(st.lists(st.sampled_from(sorted(OUTPUTS)), min_size=1, max_size=6))
    lines = []
    for _ in range(draw(st.integers(1, 8))):
        values = [draw(st.none() | OUTPUTS[t] | (ODD_FIELDS if draw(st.integers(0, 9)) == 0 else OUTPUTS[t])) for t in types]
        line = copy_line(values)
        if draw(st.integers(0, 11)) == 0:
            line = draw(st.sampled_from([line[:-1] + b"\t1\n", line.rsplit(b"\t", 1)[0] + b"\n", line[:-1]]))
        lines.append(line)
    return types, lines


def _outcome(events: Iterator[Any]) -> list[Any]:
    out: list[Any] = []
    try:
        out += [(e.key, e.value, e.operation, strict(e.new)) for e in flat(events)]
    except Exception as e:  # both paths must raise the same
        out.append((type(e).__name__, str(e)))
    return out


@settings(max_examples=400)
@given(tables())
def test_the_native_copy_run_gives_the_pure_python_events(table: tuple[list[str], list[bytes]]) -> None:
    """producer.snapshot.read_events (native runs, a line they leave converted in Python)
    against EventEncoder.read over the pure-Python conversion of every line: the same keys,
    values and rows, or the same error."""
    copy_rows = encode_copy_rows()
    if copy_rows is None:  # pure Python only here (test_prop_native checks it is built)
        return
    types, lines = table
    cols = [f"c {i}" for i in range(len(types))]
    rel = Relation(7, "public", "t", cols, types, [False] * len(cols), []).prepare(CaptureFilter())
    rel.kinds = b"".join(text_kind(t) for t in types)
    rel.converters = [text_converter(t) for t in types]
    strs = str_converters(types)
    native, pure = EventEncoder(), EventEncoder()
    for e in (native, pure):
        e.begin(0x1234, 5, "2024-01-02T03:04:05.000001+00:00")
    got = _outcome(read_events(native, rel, 0x1234, lines, copy_rows))
    want = _outcome(pure.read(rel, 0x1234, convert_line(line, rel.converters, strs)) for line in lines)
    assert got == want


def test_a_line_the_converters_refuse_fails_alike_either_way() -> None:
    """convert_line (text) and convert_row (bytes, where a native run leaves a line) raised
    different errors for one bad integer field (int('') against int(b'')), and the text one
    read a non-ASCII digit or space (int('\u0663') == 3), and cut a line without its newline
    by characters where convert_row cuts bytes: the property above found the first once the
    examples Hypothesis draws moved, the last under WALBUS_HYPOTHESIS_PROFILE=deep."""
    cases = [("int4", line) for line in (b"1", b"\n", b"x\n", b"1\t2\n", "\u0663\n".encode(), "\u00a01\n".encode())]
    # a line without its newline whose last character is two bytes: the text path cut the
    # character (and read the line), the bytes path half of it
    cases.append(("text", "\u0080".encode()))
    for pg_type, line in cases:
        converters, strs = [text_converter(pg_type)], str_converters([pg_type])
        errors = []
        for convert, args in ((convert_line, (line, converters, strs)), (convert_row, (line, converters))):
            try:
                convert(*args)  # type: ignore[operator]
            except ValueError as e:
                errors.append((type(e).__name__, str(e)))
        assert len(errors) == 2 and errors[0] == errors[1], (line, errors)
