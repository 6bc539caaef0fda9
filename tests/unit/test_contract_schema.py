"""The published JSON Schema of contract v1 against its generator and decode_event (no services)."""

from __future__ import annotations

import re
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from tests.unit.test_contract_decode import damage, dumps
from tests.unit.test_prop_contract import events
from walbus.contract import (
    FIELD_BITS,
    FIELD_ORDER,
    ContractError,
    decode_event,
    encode_event,
    split_table,
)
from walbus.contract_schema import SCHEMA_PATH, TABLE_PATTERN, contract_schema, schema_text

VALIDATOR = Draft202012Validator(contract_schema())


def test_published_schema_is_the_generated_one() -> None:
    # Regenerate with: python -m walbus.contract_schema
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text()


def test_schema_is_valid_draft_2020_12() -> None:
    Draft202012Validator.check_schema(contract_schema())
    assert list(contract_schema()["properties"]) == list(FIELD_ORDER)


@given(events())
def test_every_valid_event_validates(kw: dict[str, Any]) -> None:
    VALIDATOR.validate(orjson.loads(encode_event(**kw)))


def _schema_gap(obj: Any) -> bool:
    """Where the schema says less than decode_event (documented in the schema's descriptions)."""
    if not isinstance(obj, dict):
        return False
    if isinstance(obj.get("v"), bool):  # decode_event compares v == 1, which True passes
        return True
    if any(isinstance(obj.get(n), float) for n in FIELD_BITS):  # 1.0 is an integer to JSON Schema
        return True
    images = [obj, obj.get("identity")] if "columns" in obj else [obj.get("identity")]
    lists = [[im.get(k) for k in ("columns", "types", "values")] for im in images if isinstance(im, dict)]
    # equal lengths of columns, types and values
    return any(all(isinstance(x, list) for x in three) and len({len(x) for x in three}) > 1 for three in lists)


@given(events(), st.lists(st.tuples(st.sampled_from([*FIELD_ORDER, "extra"]), st.one_of(st.none(), damage)),
                          min_size=1, max_size=3), st.booleans())
def test_schema_and_decoder_agree_on_damaged_events(
    kw: dict[str, Any], changes: list[tuple[str, Any]], drop_none: bool
) -> None:
    obj = orjson.loads(encode_event(**kw))
    for name, value in changes:
        if value is None and drop_none:
            obj.pop(name, None)
        else:
            obj[name] = value
    try:
        decode_event(dumps(obj))
        decoded = True
    except ContractError:
        decoded = False
    if not _schema_gap(obj):
        assert VALIDATOR.is_valid(obj) == decoded, obj


_TABLE_CHARS = st.text(st.sampled_from(list('ab."_ \n')), max_size=10)


@given(st.one_of(_TABLE_CHARS, st.text(max_size=12)))
def test_table_pattern_is_split_table(table: str) -> None:
    try:
        split_table(table)
        splits = True
    except ContractError:
        splits = False
    assert (re.search(TABLE_PATTERN, table) is not None) == splits
