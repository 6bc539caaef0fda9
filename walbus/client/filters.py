"""Which events a consumer wants: table name patterns and operations."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from walbus.contract import OPERATIONS


class EventFilter:
    """Matches ``schema.table`` against fnmatch patterns and the operation against a set.

    A pattern without a dot matches the table name in any schema (``transactions`` matches
    ``public.transactions``); with a dot it matches the qualified name (``public.*``).
    No patterns (or no operations) means everything.
    """

    def __init__(self, tables: Iterable[str] = (), operations: Iterable[str] = ()) -> None:
        self.tables: tuple[str, ...] = tuple(tables)
        self.operations: frozenset[str] = frozenset(operations)
        unknown = self.operations - OPERATIONS
        if unknown:
            raise ValueError(
                f"unknown operation(s) {', '.join(sorted(unknown))}; expected {', '.join(sorted(OPERATIONS))}"
            )
        # The same few table names repeat for millions of events: match each name once.
        self._cache: dict[str, bool] = {}

    def wants_table(self, table: str) -> bool:
        hit = self._cache.get(table)
        if hit is None:
            hit = not self.tables or any(self._match(p, table) for p in self.tables)
            self._cache[table] = hit
        return hit

    def wants(self, table: str, operation: str) -> bool:
        return (not self.operations or operation in self.operations) and self.wants_table(table)

    @staticmethod
    def _match(pattern: str, table: str) -> bool:
        if "." in pattern:
            return fnmatchcase(table, pattern)
        return fnmatchcase(table.split(".", 1)[-1], pattern)
