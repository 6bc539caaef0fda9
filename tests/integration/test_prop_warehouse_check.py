"""The warehouse's first pass (warehouse.decode: the contract's decoder in Python workers)
against the contract itself (walbus.contract.decode_event + check_key): the same verdict on
every record, and the fields and value texts the load reads.

Each hypothesis example is a batch of records (valid ones from the reference encoder, and
mutations of them: junk JSON, wrong types, misaligned lists, bad keys, out-of-range
integers, bad table quoting, duplicate keys) checked by one Spark job, so the whole file
stays near a minute on one local session. The three inputs the Spark-expression check it
replaced accepted and the contract refuses (a lone surrogate escape, a number beyond the
double range, a JSON value followed by "]" and more), which orjson cannot write, are a test
of their own.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.prop import identifiers, image, json_values, raw_event, type_names
from walbus.contract import (
    FIELD_BITS,
    ContractError,
    check_key,
    decode_event,
    event_key,
    parse_event_key,
    qualify_table,
    split_table,
)

Record = tuple[bytes | None, bytes | None]

# JSON texts that break one rule or another, put in place of a field's value.
WEIRD = [
    "null", "true", "false", "0", "1", "-1", "-0", "1.0", "0.0", "100.0", "1e2", "2.5", '"1"', '"x"', '""',
    "[]", '["a"]', "[1]", '["a",null]', '[["a"]]', "{}", '{"a":1}', str(2**31), str(2**32 - 1), str(2**32),
    str(2**63), str(2**64 - 1), str(2**64), "1" + "0" * 41, "1.0000000000000000000001", '"insert"',
    '"public.t"', '"2024-01-01"',
]
NUMBERS = [
    "1.0", "0.0", "-0", "-1", "1e2", "1E0", "15.5", '"7"', "true", str(2**32), str(2**32 - 1), str(2**63),
    str(2**64 - 1), str(2**64), "1" + "0" * 41, "7.0000000000000000000001",
]
TABLES = [
    "public.t", "a.b.c", '"a.b".c', 'a."b.c"', '"a"b".c', 'a."b', ".x", "x.", '"".x', 'x.""', '"""".x', 'a"b.c',
    '"a""b".c', '"a""b"."c"', '"x"."y"\n', "public.t\n", "a", "", "..", '"."."."', 'ö."日本.語"', "a .b", '"a".b"',
]
# typmods, valid and not: a name that reads like a type in schema_of_variant's text among them
TYPMODS = [
    '{"a":[12,2]}', '{"a":[12,2],"b":[40]}', '{"a":[]}', "{}", '{"a":[-2147483648,2147483647]}', '{"a":[12.0]}',
    '{"a":["12"]}', '{"a":[null]}', '{"a":[2147483648]}', '{"a":[-2147483649]}', '{"a":12}', '{"a":{"b":[1]}}',
    '{"a":[true]}', '{"a":[1],"b":[1e2]}', '{"ARRAY<STRING>":[1]}', '{"x: ARRAY<BIGINT>, y":["s"]}', '{"a":[[1]]}',
    "[]", '"a"', "null",
]
JUNK = [
    b"", b" ", b"{", b"{nope", b"null", b"[]", b"[{}]", b"1", b'"x"', b"{}", b"\xff\xfe", b'{"v":1\xff}',
    b"\xef\xbb\xbf{}", b"{} x", b"{},{}", b"{}}", b"{} {}", b'{"v":NaN}', b"{'v':1}",
]


def _fields(value: bytes) -> dict[str, str]:
    """A valid value's fields as their JSON texts, in order (to rewrite one at a time)."""
    return {k: orjson.dumps(v).decode() for k, v in orjson.loads(value).items()}


def _dump(fields: list[tuple[str, str]]) -> bytes:
    return ("{" + ",".join(f"{orjson.dumps(k).decode()}:{v}" for k, v in fields) + "}").encode()


@st.composite
def valid_records(draw: st.DrawFn) -> Record:
    commit_lsn = draw(st.sampled_from([0, 1, 0x16_B374D848, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))
    seq = draw(st.sampled_from([0, 1, 2**32 - 1]) | st.integers(0, 2**32 - 1))
    operation = draw(st.sampled_from(["insert", "update", "delete", "truncate", "read"]))
    cols = draw(st.lists(identifiers, min_size=1, max_size=4))  # repeated names are legal
    types = draw(st.lists(type_names, min_size=len(cols), max_size=len(cols)))
    values = draw(st.lists(json_values, min_size=len(cols), max_size=len(cols)))
    new = image(cols, types, values) if operation in ("insert", "update", "read") else None
    if operation == "delete" and draw(st.booleans()):
        new = None
    identity = image(cols[:1], types[:1], values[:1]) if operation in ("update", "delete") and draw(st.booleans()) else None
    value = raw_event(
        commit_lsn=commit_lsn, seq=seq, operation=operation, schema=draw(identifiers), table=draw(identifiers),
        pk=draw(st.lists(identifiers, max_size=2)), new=new, identity=identity,
        unchanged=draw(st.lists(identifiers, max_size=2)), xid=draw(st.sampled_from([0, 7, 2**32, 2**64 - 1])),
    )
    return event_key(commit_lsn, seq), value


@st.composite
def mutated_records(draw: st.DrawFn) -> Record:
    key, value = draw(valid_records())
    assert key is not None and value is not None
    fields = _fields(value)
    names = [*list(fields), "columns", "types", "values", "identity", "unchanged", "pk", "not_null", "typmods"]
    how = draw(st.sampled_from(
        ["key", "junk", "set", "int", "drop", "duplicate", "table", "misalign", "identity", "text", "typmods", "typmods"]
    ))
    if how == "key":
        commit_lsn, seq = parse_event_key(key)
        other = draw(st.sampled_from([
            None, b"", key.lower(), key + b"\n", key[:-1], b" " + key, key.replace(b"-", b"_"),
            event_key(commit_lsn, (seq + 1) % 2**32), event_key((commit_lsn + 1) % 2**64, seq), b"\xff" * 25,
        ]))
        return other, value
    if how == "junk":
        return key, draw(st.sampled_from([None, *JUNK]))
    if how == "text":  # whitespace is legal, trailing text is not
        return key, draw(st.sampled_from([b" \n\t" + value + b"\r\n ", value + b" x", value + b",{}", value + b"}"]))
    if how == "set":
        fields[draw(st.sampled_from(names))] = draw(st.sampled_from(WEIRD))
    elif how == "int":  # numbers that are no integer, or out of range, where the contract wants one
        fields[draw(st.sampled_from(sorted(FIELD_BITS)))] = draw(st.sampled_from(NUMBERS))
    elif how == "drop":
        fields.pop(draw(st.sampled_from(list(fields))))
    elif how == "duplicate":  # the last of two wins, in orjson as in Spark, the odd one first or last
        name = draw(st.sampled_from(names))
        odd = (name, draw(st.sampled_from([*WEIRD, fields.get(name, "null")])))
        items = list(fields.items())
        return key, _dump([*items, odd] if draw(st.booleans()) else [odd, *items])
    elif how == "typmods":
        fields["typmods"] = draw(st.sampled_from(TYPMODS))
        if draw(st.booleans()):
            fields["not_null"] = draw(st.sampled_from(['["a"]', "[]", "null", '["a",1]', '"a"']))
    elif how == "table":
        fields["table"] = orjson.dumps(draw(st.sampled_from(TABLES))).decode()
    elif how == "misalign":
        part = draw(st.sampled_from(["columns", "types", "values"]))
        items = orjson.loads(fields.get(part, "[]"))
        fields[part] = orjson.dumps(items[1:] if items and draw(st.booleans()) else [*items, "extra"]).decode()
    else:
        ident = {"columns": ["id"], "types": ["int4"], "values": [1]}
        part = draw(st.sampled_from(["columns", "types", "values"]))
        ident[part] = orjson.loads(draw(st.sampled_from(WEIRD)))
        if draw(st.booleans()):
            ident.pop(draw(st.sampled_from(["columns", "types", "values"])))
        fields["identity"] = orjson.dumps(ident).decode()
    return key, _dump(list(fields.items()))


records = st.one_of(valid_records(), mutated_records(), mutated_records())


def contract_verdict(key: bytes | None, value: bytes | None) -> tuple[bool, Any]:
    """(valid, (table respelled, commit_lsn, seq, lsn, xid) when valid) by the contract itself."""
    if value is None:
        return False, None
    try:
        event = decode_event(value)
        check_key(key, event)
    except ContractError:
        return False, None
    identity = (
        (list(event.identity.columns), list(event.identity.types), _texts(event.identity.values))
        if event.identity is not None else None
    )
    return True, (
        qualify_table(*split_table(event.table)), event.commit_lsn, event.seq, event.lsn, event.xid,
        event.operation, event.timestamp, list(event.pk), list(event.new.columns) if event.new else None,
        list(event.new.types) if event.new else None, identity, list(event.unchanged) or None,
        list(event.not_null) or None, {name: list(mods) for name, mods in event.typmods.items()} or None,
        _texts(event.new.values) if event.new else None,
    )


def _texts(values: Any) -> list[Any] | None:
    """Row values as the warehouse reads them: a string as itself, anything else as its JSON
    text, then as :func:`_spark_texts` compares them."""
    return _spark_texts([v if v is None or isinstance(v, str) else orjson.dumps(v).decode() for v in values])


def _spark_texts(values: list[Any] | None) -> list[Any] | None:
    """Texts as compared: a list or object's text is Spark's own spelling of it (spacing,
    escapes), compared as "nested" only; a fraction is Spark's spelling of the double
    (12657241.0 is 1.2657241E7), compared as that double. (A string holding such text reads
    the same: the column's type decides.)"""
    if values is None:
        return None
    return [_compared(v) for v in values]


def _compared(text: str | None) -> Any:
    if text is None:
        return None
    if text[:1] in ("[", "{") and _is_json_container(text):
        return "nested"
    if re.fullmatch(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?", text) and not re.fullmatch(r"-?[0-9]+", text):
        return float(text)
    return text


def _is_json_container(text: str) -> bool:
    try:
        return isinstance(orjson.loads(text), list | dict)
    except orjson.JSONDecodeError:
        return False


def spark_verdicts(spark: Any, batch: list[Record]) -> list[tuple[bool, Any, str | None]]:
    from warehouse.decode import INVALID, parse_events

    raw = spark.createDataFrame(
        [(k, v, 0, i) for i, (k, v) in enumerate(batch)], "key binary, value binary, partition int, offset bigint"
    )
    rows = parse_events(raw).orderBy("kafka_offset").collect()
    out = []
    for r in rows:
        valid = r[INVALID] is None
        xid = r["xid"] if r["xid"] is None or r["xid"] >= 0 else None
        ident = r["identity"]
        fields = (
            r["table"], int(r["commit_lsn"]), r["seq"], int(r["lsn"]), xid, r["operation"], r["timestamp"],
            r["pk"] or [], r["columns"], r["types"],
            (ident["columns"], ident["types"], _spark_texts(ident["values"])) if ident else None,
            r["unchanged"] or None, r["not_null"] or None, dict(r["typmods"] or {}) or None,
            _spark_texts(r["values"]) if r["columns"] is not None else None,
        ) if valid else None
        out.append((valid, fields, r[INVALID]))
    return out


@pytest.fixture(scope="module")
def warm_spark(spark: Any) -> Any:
    """The session after one check: PySpark raises the recursion limit on its first job, which
    hypothesis would report as changed inside an example."""
    spark_verdicts(spark, [(None, None)])
    return spark


@pytest.mark.spark
@settings(max_examples=12)
@given(st.lists(records, min_size=25, max_size=40))
def test_spark_check_agrees_with_the_contract(warm_spark: Any, batch: list[Record]) -> None:
    got = spark_verdicts(warm_spark, batch)
    for (key, value), (valid, fields, reason) in zip(batch, got, strict=True):
        expected_valid, expected = contract_verdict(key, value)
        assert valid == expected_valid, (key, value, reason)
        if valid:
            assert expected is not None
            if expected[4] >= 1 << 63:  # beyond the history's bigint pg_txn_id: null as before
                expected = (*expected[:4], None, *expected[5:])
            assert fields == expected, (key, value)


@pytest.mark.spark
def test_reasons_name_the_broken_rule(spark: Any) -> None:
    key, good = event_key(16, 2), raw_event(commit_lsn=16, seq=2, operation="insert", schema="public", table="t",
                                            pk=["id"], new=image(["id"], ["int4"], [1]))
    misaligned = raw_event(commit_lsn=16, seq=2, operation="insert", schema="public", table="t", pk=["id"],
                           new=image(["id", "a"], ["int4", "text"], [1]))
    null_name = good.replace(b'"columns":["id"]', b'"columns":[null]')
    batch: list[Record] = [
        (key, None), (key, b"{nope"), (key, good.replace(b'"v":1', b'"v":2')), (key, misaligned), (key, null_name),
        (event_key(16, 3), good), (key, good.replace(b'"seq":2', b'"seq":4294967296')),
        (key, good.replace(b'"lsn":15', b'"lsn":15.0')), (key, good),
    ]
    spelled = [raw_event(commit_lsn=16, seq=2, operation="insert", schema="public", table="t", pk=["id"],
                         new=image(["id", "id"], ["int4", "int4"], [1, 2])).replace(b'"public.t"', spelling)
               for spelling in (b'"\\"public\\".\\"a b\\""', b'"\\"a.b\\".c"')]
    batch += [(key, value) for value in spelled]
    verdicts = spark_verdicts(spark, batch)
    # another spelling of one (schema, table) pair loads as that pair; a column named twice is legal
    assert [v[1][0] if v[1] else v[2] for v in verdicts[-2:]] == ["public.a b", '"a.b".c']
    reasons = [r for _, _, r in verdicts]
    assert reasons[0] == "record without a value"
    assert "not JSON" in (reasons[1] or "")
    assert "unknown contract version 2" in (reasons[2] or "")
    assert "differ in length" in (reasons[3] or "")
    assert reasons[4] == "row columns: names must be strings"
    assert "is not the event's position b'0000000000000010-00000002'" in (reasons[5] or "")
    assert reasons[6] == "field 'seq' is out of range: 4294967296"
    assert reasons[7] == "field 'lsn' must be an integer, got 15.0"
    assert reasons[8] is None


def test_a_key_with_a_trailing_newline_is_not_a_key() -> None:
    # re's $ matches before a final newline: b"…-00000002\n" was read as (16, 2)
    with pytest.raises(ContractError):
        parse_event_key(event_key(16, 2) + b"\n")
    event = decode_event(raw_event(commit_lsn=16, seq=2, operation="truncate", schema="s", table="t", pk=[]))
    with pytest.raises(ContractError):
        check_key(event_key(16, 2) + b"\n", event)



@pytest.mark.parametrize("operation", [[], {}, ["insert"]])
def test_an_operation_that_is_not_a_string_is_a_contract_error(operation: Any) -> None:
    # `operation not in OPERATIONS` raised TypeError (unhashable) past every ContractError handler
    value = raw_event(commit_lsn=16, seq=2, operation="truncate", schema="s", table="t", pk=[])
    with pytest.raises(ContractError, match="unknown operation"):
        decode_event(value.replace(b'"truncate"', orjson.dumps(operation)))


@pytest.mark.spark
def test_types_without_columns_are_no_row_image(spark: Any) -> None:
    # decode_event ignores "types"/"values" without "columns"; the load zipped such stray
    # types with the identity's columns and typed the table's columns by them
    value = raw_event(commit_lsn=16, seq=2, operation="delete", schema="public", table="t", pk=["id"],
                      identity=image(["id"], ["int4"], [1]))
    stray = value[:-1] + b',"types":["text"],"values":["x"]}'
    from warehouse.decode import parse_events

    raw = spark.createDataFrame([(event_key(16, 2), stray, 0, 0)], "key binary, value binary, partition int, offset bigint")
    (row,) = parse_events(raw).collect()
    assert row["invalid_reason"] is None
    assert (row["columns"], row["types"], row["values"]) == (None, None, None)
    assert row["identity"]["types"] == ["int4"]


@pytest.mark.spark
def test_what_the_spark_expression_check_accepted_and_the_contract_refuses_is_invalid(spark: Any) -> None:
    # The check written as Spark expressions took these (Spark's JSON reader does) where the
    # contract refuses them, so a load wrote events no other walbus consumer would read.
    key = event_key(16, 2)
    good = raw_event(commit_lsn=16, seq=2, operation="insert", schema="public", table="t", pk=["id"],
                     new=image(["id", "a"], ["int4", "float8"], [1, 0.5]))
    batch: list[Record] = [
        (key, good.replace(b'"values":[1,0.5]', b'"values":[1,"\\ud800"]')),  # a lone surrogate
        (key, good.replace(b'"values":[1,0.5]', b'"values":[1,1e400]')),  # beyond the double range
        (key, good + b"]"),  # a whole JSON value, then "]"
        (key, good),
    ]
    verdicts = spark_verdicts(spark, batch)
    assert [contract_verdict(k, v)[0] for k, v in batch] == [False, False, False, True]
    assert [valid for valid, _, _ in verdicts] == [False, False, False, True]
    assert all(reason for _, _, reason in verdicts[:3])
