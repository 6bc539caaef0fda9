"""Python values for the PostgreSQL text a contract-v1 event carries (``event.typed_row()``).

``row()`` stays text-exact; this converts by the column's ``pg_type.typname``:

=============================  ==========================================================
``int2 int4 int8 oid``         ``int``
``float4 float8``              ``float`` (``"NaN"``, ``"Infinity"``, ``"-Infinity"`` too)
``numeric``                    ``Decimal``, exact, with its scale (``"12.50"`` -> ``Decimal("12.50")``)
``bool``                       ``bool``
``timestamptz``                aware ``datetime``
``timestamp``                  naive ``datetime`` (the type has no time zone)
``date`` / ``time`` / ``timetz``  ``date`` / ``time`` / aware ``time``
``uuid``                       ``UUID``
``bytea``                      ``bytes``
``json`` ``jsonb``             the parsed JSON (dict, list, str, int, float, bool, None)
``_<type>`` (arrays)           nested ``list`` of the element type, ``None`` for NULL (a
                               type whose own name starts with ``_``, not array text: ``str``)
anything else                  ``str`` as PostgreSQL wrote it (text, varchar, enums, inet, interval…)
=============================  ==========================================================

A value Python's type cannot hold stays the PostgreSQL text: ``infinity``/``-infinity`` dates
and timestamps, years before 1 or after 9999 (``BC``), ``24:00:00``. A value masked with
``--mask-columns`` (``"****"``) stays ``"****"``.

Type modifiers (the event's ``typmods``): a ``numeric(p,s)`` value is given the column's scale
when its text has fewer fractional digits (``"5"`` -> ``Decimal("5.00")``: exact, only zeros
are added; PostgreSQL's own output already has them). A value with more digits is never cut.
``varchar(n)`` and ``timestamp(p)`` values are as PostgreSQL wrote them. A type name written
with its modifier (``numeric(12,2)``) is read by its name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime, time
from decimal import Decimal, InvalidOperation
from typing import Any
from uuid import UUID

import orjson

from walbus.contract import RowImage, array_delimiter

MASK = "****"


class TypedValueError(ValueError):
    """A value is not the text its type's output function writes."""


def _bool(text: str) -> bool:
    if text in ("t", "true"):
        return True
    if text in ("f", "false"):
        return False
    raise ValueError(text)


def _bytea(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    return _bytea_escape(text)


def _bytea_escape(text: str) -> bytes:
    """``bytea_output = escape``: printable bytes as they are, others as ``\\ooo``, ``\\\\``."""
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out += c.encode("latin-1")
            i += 1
        elif text[i + 1 : i + 2] == "\\":
            out.append(0x5C)
            i += 2
        else:
            out.append(int(text[i + 1 : i + 4], 8))
            i += 4
    return bytes(out)


def _decimal(text: str) -> Decimal:
    try:
        return Decimal(text)
    except InvalidOperation:
        raise ValueError(text) from None


def _json(text: str) -> Any:
    return orjson.loads(text)


# From text (array elements, and values the contract sends as text).
_FROM_TEXT: dict[str, Callable[[str], Any]] = {
    "int2": int,
    "int4": int,
    "int8": int,
    "oid": int,
    "float4": float,
    "float8": float,
    "numeric": _decimal,
    "bool": _bool,
    "timestamptz": datetime.fromisoformat,
    "timestamp": datetime.fromisoformat,
    "date": date.fromisoformat,
    "time": time.fromisoformat,
    "timetz": time.fromisoformat,
    "uuid": UUID,
    "bytea": _bytea,
    "json": _json,
    "jsonb": _json,
}

# Text PostgreSQL writes for values Python's types cannot hold: kept as text.
_UNREPRESENTABLE = ("infinity", "-infinity")


def typed_value(type_name: str, value: Any, modifiers: Sequence[int] = ()) -> Any:
    """The Python value of one column value of type ``type_name`` (a ``pg_type.typname``);
    ``modifiers``: the column's ``typmods`` entry (``(12, 2)`` for ``numeric(12,2)``)."""
    if value is None or not isinstance(value, str) or value == MASK:
        return value  # JSON null, and ints, floats, bools the contract already sends typed
    type_name = type_name.split("(", 1)[0]  # a type with its modifier, numeric(12,2): the name decides
    element = type_name[1:] if type_name.startswith("_") else type_name
    parse = functools.partial(_scalar, element)
    if element == "numeric" and len(modifiers) == 2 and modifiers[1] > 0:
        parse = functools.partial(_numeric_with_scale, modifiers[1])
    if type_name.startswith("_"):
        if element not in _FROM_TEXT and not value.startswith(("{", "[")):
            # Not array text: a type named with a leading underscore itself (PostgreSQL takes
            # CREATE TYPE _mood AS ENUM ...; its array is __mood). Text, as any unknown type.
            return value
        return parse_array(value, parse, delimiter=array_delimiter(element))
    return parse(value)


def _numeric_with_scale(scale: int, text: str) -> Any:
    """A numeric with at least ``scale`` fractional digits (zeros added: never a digit lost)."""
    value = _scalar("numeric", text)
    if not isinstance(value, Decimal) or not value.is_finite():
        return value
    exponent = value.as_tuple().exponent
    if isinstance(exponent, int) and -exponent < scale:
        return value.quantize(Decimal(1).scaleb(-scale))
    return value


def _scalar(type_name: str, text: str) -> Any:
    parse = _FROM_TEXT.get(type_name)
    if parse is None:
        return text
    try:
        return parse(text)
    except ValueError as e:
        if _representable_elsewhere(type_name, text):
            return text
        raise TypedValueError(f"{text[:80]!r} is not a {type_name} value: {e}") from None


def _representable_elsewhere(type_name: str, text: str) -> bool:
    """PostgreSQL text that is legal but out of the Python type's range."""
    if type_name in ("timestamptz", "timestamp", "date"):
        return text in _UNREPRESENTABLE or text.endswith(" BC") or len(text.split("-", 1)[0]) > 4
    if type_name in ("time", "timetz"):
        return text.startswith("24:00:00")
    return False


def typed_image(image: RowImage, typmods: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """A row image as ``{column: Python value}`` (``typmods``: the event's)."""
    mods = typmods or {}
    return {
        c: typed_value(t, v, mods.get(c, ())) for c, t, v in zip(image.columns, image.types, image.values, strict=True)
    }


# -- arrays ---------------------------------------------------------------------------------


def parse_array(text: str, element: Callable[[str], Any] = str, *, delimiter: str = ",") -> list[Any]:
    """PostgreSQL's array text (``{1,2}``, ``{{"a b",NULL},{c,"d\\"e"}}``) as nested lists.

    Unquoted ``NULL`` (any case) is None; a quoted ``"NULL"`` is the string. Elements are passed
    through ``element`` (not NULLs). A ``[1:2]=`` dimension prefix (lower bounds other than 1)
    is dropped. ``delimiter``: the element type's (:func:`walbus.contract.array_delimiter`).
    """
    s = text
    if s.startswith("["):
        eq = s.find("=")
        if eq < 0:
            raise TypedValueError(f"not an array: {text[:80]!r}")
        s = s[eq + 1 :]
    parser = _ArrayParser(s, element, delimiter)
    result = parser.parse()
    return result


class _ArrayParser:
    def __init__(self, text: str, element: Callable[[str], Any], delimiter: str = ",") -> None:
        self.s = text
        self.i = 0
        self.element = element
        self.delimiter = delimiter

    def fail(self, why: str) -> TypedValueError:
        return TypedValueError(f"not an array ({why} at {self.i}): {self.s[:80]!r}")

    def skip_space(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def parse(self) -> list[Any]:
        self.skip_space()
        out = self.array()
        self.skip_space()
        if self.i != len(self.s):
            raise self.fail("text after the array")
        return out

    def array(self) -> list[Any]:
        if self.s[self.i : self.i + 1] != "{":
            raise self.fail("expected '{'")
        self.i += 1
        out: list[Any] = []
        self.skip_space()
        if self.s[self.i : self.i + 1] == "}":
            self.i += 1
            return out
        while True:
            self.skip_space()
            out.append(self.item())
            self.skip_space()
            c = self.s[self.i : self.i + 1]
            self.i += 1
            if c == "}":
                return out
            if c != self.delimiter:
                raise self.fail(f"expected {self.delimiter!r} or '}}'")

    def item(self) -> Any:
        c = self.s[self.i : self.i + 1]
        if c == "{":
            return self.array()
        if c == '"':
            return self.element(self.quoted())
        raw = self.unquoted()
        return None if raw.upper() == "NULL" else self.element(raw)

    def quoted(self) -> str:
        self.i += 1
        chars: list[str] = []
        while self.i < len(self.s):
            c = self.s[self.i]
            if c == "\\":
                if self.i + 1 >= len(self.s):
                    break
                chars.append(self.s[self.i + 1])
                self.i += 2
            elif c == '"':
                self.i += 1
                return "".join(chars)
            else:
                chars.append(c)
                self.i += 1
        raise self.fail("unterminated quote")

    def unquoted(self) -> str:
        chars: list[str] = []
        while self.i < len(self.s):
            c = self.s[self.i]
            if c == self.delimiter or c == "}":
                break
            if c in '{"':
                raise self.fail(f"unexpected {c!r}")
            if c == "\\" and self.i + 1 < len(self.s):
                chars.append(self.s[self.i + 1])
                self.i += 2
                continue
            chars.append(c)
            self.i += 1
        text = "".join(chars).rstrip()
        if not text:
            raise self.fail("empty element")
        return text
