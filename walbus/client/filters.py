"""Which events a consumer wants: table name patterns and operations."""

from __future__ import annotations

from collections.abc import Iterable

from walbus.contract import OPERATIONS, NameMatcher


class EventFilter:
    """Matches the event's table against name patterns and the operation against a set.

    The patterns are walbus's table patterns (docs/contract.md): ``transactions`` matches the
    table in any schema, ``public.*`` each part, ``"my.schema".*`` a name holding a dot.
    No patterns (or no operations) means everything.
    """

    def __init__(self, tables: Iterable[str] = (), operations: Iterable[str] = ()) -> None:
        self._matcher = NameMatcher(tables)
        self.tables: tuple[str, ...] = self._matcher.patterns
        # The same few table names repeat for millions of events: match each name once.
        self._cache: dict[str, bool] = {}
        self.operations: frozenset[str] = frozenset(operations)
        unknown = self.operations - OPERATIONS
        if unknown:
            raise ValueError(
                f"unknown operation(s) {', '.join(sorted(unknown))}; expected {', '.join(sorted(OPERATIONS))}"
            )

    def wants_table(self, table: str) -> bool:
        """``table`` is the event's field (``schema.table``, parts quoted where needed)."""
        hit = self._cache.get(table)
        if hit is None:
            hit = self._cache[table] = not self.tables or self._matcher.matches_table(table)
        return hit

    def wants(self, table: str, operation: str) -> bool:
        return (not self.operations or operation in self.operations) and self.wants_table(table)
