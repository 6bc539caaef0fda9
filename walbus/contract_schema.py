"""The JSON Schema of a contract-v1 value, generated from walbus.contract's definitions.

    python -m walbus.contract_schema [PATH]   # writes docs/contract-v1.schema.json by default

The fields come from ``FIELD_ORDER``, the integer widths from ``FIELD_BITS``, the operations
from ``OPERATIONS``/``ROW_OPERATIONS``; a field the contract gains without a rule here stops
the generation. What JSON Schema cannot say (``columns``, ``types`` and ``values`` of one
length; ``1.0`` is no integer for the contract) is in the descriptions; ``decode_event``
remains the full check. tests/unit/test_contract_schema.py keeps the published file equal
to the generated one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Final

from walbus.contract import (
    CONTRACT_VERSION,
    FIELD_BITS,
    FIELD_ORDER,
    KEY_PATTERN,
    OPERATIONS,
    ROW_OPERATIONS,
    TYPMOD_LIMIT,
)

# In the source tree (the command is for walbus's developers; the file is published in docs/).
SCHEMA_PATH: Final = Path(__file__).resolve().parent.parent / "docs" / f"contract-v{CONTRACT_VERSION}.schema.json"

# walbus.contract.split_table's grammar: two parts joined by '.', each either plain (no dot,
# no quote) or in double quotes with inner quotes doubled; neither part empty. The end is
# `$(?![\s\S])`: at the very end (Python's `$` also matches before a final newline).
_TABLE_PART: Final = r'(?:[^."]+|"(?:[^"]|"")+")'
TABLE_PATTERN: Final = rf"^{_TABLE_PART}\.{_TABLE_PART}$(?![\s\S])"

_NAMES: Final = {"type": "array", "items": {"type": "string"}}
_DESCRIPTIONS: Final = {
    "v": "contract version",
    "lsn": "LSN of the change's own WAL record (not unique)",
    "commit_lsn": "LSN of the transaction's commit record",
    "seq": "0-based position of the change in its transaction; (commit_lsn, seq) is unique",
    "xid": "transaction id",
    "operation": "read for snapshot rows",
    "table": "schema.table; a part holding a dot or a double quote is double-quoted, inner quotes doubled",
    "timestamp": "commit time, ISO 8601 with offset and microseconds, UTC",
    "pk": "primary-key column names in key order; [] without a primary key",
    "not_null": "the table's NOT NULL columns (captured ones); absent when none, or from a producer before 2026-11",
    "typmods": (
        "type modifier per captured column that has one, as SQL writes it: numeric(12,2) [12,2], varchar(40) [40], "
        "timestamp(3) [3]; arrays as their element; absent when none"
    ),
    "columns": "new row's column names (absent on delete and truncate); as long as types and values",
    "types": "pg_type.typname of each column",
    "values": "each column's JSON value",
    "identity": "old key or old row (update, delete); absent without a replica identity",
    "unchanged": "columns whose unchanged TOAST value PostgreSQL did not send",
}


def _image_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["columns", "types", "values"],
        "properties": {"columns": _NAMES, "types": _NAMES, "values": {"type": "array"}},
        "description": "columns, types and values of one length",
    }


# The new row: types and values are read only when columns is present (decode_event).
_ROW_IMAGE: Final = {"required": ["types", "values"], "properties": {"types": _NAMES, "values": {"type": "array"}}}


def _field_schema(name: str) -> dict[str, Any]:
    if name == "v":
        return {"const": CONTRACT_VERSION}
    if name in FIELD_BITS:
        # Integers only: 1.0 is a contract error, though JSON Schema calls it an integer.
        return {"type": "integer", "minimum": 0, "maximum": (1 << FIELD_BITS[name]) - 1}
    if name == "operation":
        return {"enum": sorted(OPERATIONS)}
    if name == "table":
        return {"type": "string", "pattern": TABLE_PATTERN}
    if name == "timestamp":
        return {"type": "string"}
    if name in ("pk", "columns", "unchanged"):
        return dict(_NAMES)
    if name == "not_null":
        return {"type": ["array", "null"], "items": {"type": "string"}}
    if name == "typmods":
        modifier = {"type": "integer", "minimum": -TYPMOD_LIMIT, "maximum": TYPMOD_LIMIT - 1}
        return {"type": ["object", "null"], "additionalProperties": {"type": "array", "items": modifier}}
    if name in ("types", "values"):
        return {}  # read only beside columns: see _ROW_IMAGE
    if name == "identity":
        return {"oneOf": [_image_schema(), {"type": "null"}]}
    raise ValueError(f"walbus.contract's field {name!r} has no JSON Schema rule: add one to walbus.contract_schema")


def contract_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one database-topic value."""
    required = [n for n in FIELD_ORDER if n in FIELD_BITS or n in ("v", "operation", "table", "timestamp")]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"walbus contract v{CONTRACT_VERSION}: one database-topic value",
        "description": (
            f"One row change (docs/contract.md). The record's key is {KEY_PATTERN} = "
            "(commit_lsn, seq) as upper-case hex. Unknown fields are ignored by consumers."
        ),
        "type": "object",
        "required": required,
        "properties": {name: {**_field_schema(name), "description": _DESCRIPTIONS[name]} for name in FIELD_ORDER},
        "dependentSchemas": {"columns": _ROW_IMAGE},
        "if": {"properties": {"operation": {"enum": sorted(ROW_OPERATIONS)}}, "required": ["operation"]},
        "then": {"required": ["columns"]},
    }


def schema_text() -> str:
    """The published file's exact text."""
    return json.dumps(contract_schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the JSON Schema of the walbus contract.")
    ap.add_argument("path", nargs="?", type=Path, default=SCHEMA_PATH, help="output file (default: %(default)s)")
    args = ap.parse_args(argv)
    args.path.write_text(schema_text(), encoding="utf-8")


if __name__ == "__main__":
    main()
