"""Which events a consumer wants: table name patterns and operations."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from walbus.contract import OPERATIONS, ContractError, split_table


def _split_pattern(pattern: str) -> tuple[str | None, str]:
    """``(schema pattern or None for any schema, table pattern)``, split like the event's field."""
    if "." not in pattern and '"' not in pattern:
        return None, pattern
    try:
        return split_table(pattern)
    except ContractError:
        pass
    try:  # a single quoted name: the table in any schema
        _, table = split_table("_." + pattern)
    except ContractError:
        raise ValueError(
            f"table pattern {pattern!r} is neither 'table' nor 'schema.table' "
            '(double-quote a name that holds a dot: public."a.b")'
        ) from None
    return None, table


class EventFilter:
    """Matches ``(schema, table)`` against fnmatch patterns and the operation against a set.

    A pattern without a dot matches the table name in any schema (``transactions`` matches
    ``public.transactions``); ``schema.table`` matches each part (``public.*``). A name
    holding a dot or a double quote is written as in the event's ``table`` field
    (:func:`walbus.contract.qualify_table`): ``"my.schema".*``, ``public."a.b"``.
    No patterns (or no operations) means everything.
    """

    def __init__(self, tables: Iterable[str] = (), operations: Iterable[str] = ()) -> None:
        self.tables: tuple[str, ...] = tuple(tables)
        self._patterns = [_split_pattern(p) for p in self.tables]
        self.operations: frozenset[str] = frozenset(operations)
        unknown = self.operations - OPERATIONS
        if unknown:
            raise ValueError(
                f"unknown operation(s) {', '.join(sorted(unknown))}; expected {', '.join(sorted(OPERATIONS))}"
            )
        # The same few table names repeat for millions of events: match each name once.
        self._cache: dict[str, bool] = {}

    def wants_table(self, table: str) -> bool:
        """``table`` is the event's field (``schema.table``, parts quoted where needed)."""
        hit = self._cache.get(table)
        if hit is None:
            hit = not self._patterns or self._match(split_table(table))
            self._cache[table] = hit
        return hit

    def wants(self, table: str, operation: str) -> bool:
        return (not self.operations or operation in self.operations) and self.wants_table(table)

    def _match(self, name: tuple[str, str]) -> bool:
        schema, table = name
        return any(
            (sp is None or fnmatchcase(schema, sp)) and fnmatchcase(table, tp) for sp, tp in self._patterns
        )
