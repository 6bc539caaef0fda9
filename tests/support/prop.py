"""Shared pieces of the property suites (tests/unit/test_prop_*.py): profile and strategies.

The profile is deterministic (derandomize: the same examples on every run, so a red run is
reproducible and a green one stays green), has no deadline (2 shared cores are slow) and a
bounded number of examples per property, so each file runs in seconds. Set
WALBUS_HYPOTHESIS_PROFILE=deep for a longer, randomized local run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from walbus.contract import encode_event, qualify_table

settings.register_profile(
    "walbus",
    derandomize=True,
    deadline=None,
    max_examples=150,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("deep", deadline=None, max_examples=5000, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("WALBUS_HYPOTHESIS_PROFILE", "walbus"))

TS = "2024-05-01T12:00:00.000001+00:00"
MAX_IDENTIFIER_BYTES = 63  # PostgreSQL's NAMEDATALEN - 1
INT8_MIN, INT8_MAX = -(2**63), 2**63 - 1
MAX_LSN = 2**64 - 1
MAX_SEQ = 2**32 - 1  # the key's 8 hex digits

# Names that broke, or could break, naive splitting and escaping.
SPECIAL_NAMES = [
    "public", "order_items", "Order Items", "a.b", "a_b", "a-b", "a--b", "a-2E", "-", "--", "-2D", ".", "..",
    '"', '""', '"a.b"', 'a"b', " ", "a\tb", "ö", "日本語", "emoji😀", "x" * 63, "ö" * 31, "😀" * 15, "a-ö", "-_-",
]


def _fit_identifier(name: str) -> str:
    """``name`` cut to PostgreSQL's 63 bytes, at a character boundary (as PostgreSQL cuts)."""
    while len(name.encode("utf-8")) > MAX_IDENTIFIER_BYTES:
        name = name[:-1]
    return name


# Any character PostgreSQL takes in a quoted identifier: no NUL, no lone surrogate (not UTF-8).
_ANY_CHAR = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
# Characters that meet the escaping's special cases often.
_TRICKY_CHAR = st.sampled_from(list('ab_.-" 2EDÖö😀\t09Z'))

identifiers = st.one_of(
    st.sampled_from(SPECIAL_NAMES),
    st.text(_ANY_CHAR, min_size=1, max_size=70).map(_fit_identifier),
    st.text(_TRICKY_CHAR, min_size=1, max_size=70).map(_fit_identifier),
)

# JSON values as the producer sends them (docs/contract.md, "Values").
FLOAT_SPECIALS = ("NaN", "Infinity", "-Infinity")
json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(INT8_MIN, INT8_MAX),
    st.sampled_from([INT8_MIN, INT8_MAX, 0, -1, 2**31 - 1, -(2**31), 2**32 - 1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(FLOAT_SPECIALS),
    st.text(st.characters(exclude_categories=("Cs",))),
)
type_names = st.sampled_from(["int2", "int4", "int8", "oid", "float4", "float8", "bool", "text", "numeric",
                              "timestamptz", "jsonb", "_int4", "bytea", "my_enum", "varchar"])


def columns(min_size: int = 1, max_size: int = 6) -> st.SearchStrategy[list[str]]:
    """Distinct column names of one table."""
    return st.lists(identifiers, min_size=min_size, max_size=max_size, unique=True)


def image(cols: list[str], types: list[str], values: list[Any]) -> dict[str, list[Any]]:
    return {"columns": list(cols), "types": list(types), "values": list(values)}


def strict(value: Any) -> Any:
    """A value with its JSON type made part of equality (True != 1, 1.0 != 1, -0.0 != 0.0)."""
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


def raw_event(*, commit_lsn: int, seq: int, operation: str, schema: str, table: str, pk: list[str],
              new: dict[str, list[Any]] | None = None, identity: dict[str, list[Any]] | None = None,
              unchanged: list[str] | None = None, xid: int = 7) -> bytes:
    """One database-topic value, built by the reference encoder."""
    return encode_event(
        lsn=max(commit_lsn - 1, 0), commit_lsn=commit_lsn, seq=seq, xid=xid, operation=operation,
        table=qualify_table(schema, table), timestamp=TS, pk=pk, new=new, identity=identity, unchanged=unchanged,
    )


def decoded(decode: Callable[[], Iterable[Any]]) -> list[Any]:
    """What a producer decoder gives (``decode()``'s items, runs flattened to events), each
    event with its values' JSON types, then the error that stopped it (if one did): the
    outcome two paths of a decoder must agree on."""
    from producer.codec import EncodedEvent
    from producer.decoders import flat

    out: list[Any] = []
    try:
        for item in flat(decode()):
            if isinstance(item, EncodedEvent):
                out.append((item.key, item.value, item.partition_key, item.operation, item.table,
                            None if item.new is None else strict(item.new), None if item.old is None else strict(item.old)))
            else:
                out.append(repr(item))
    except Exception as e:  # the error is part of the outcome: both paths must raise the same
        out.append(("error", type(e).__name__, str(e)))
    return out
