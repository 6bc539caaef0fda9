"""A catalog lookup with fixed answers, for pure-logic tests of the decoders (no database)."""

from __future__ import annotations

from collections.abc import Callable

from producer.catalog import TableInfo


class StaticCatalog:
    """Answers ``table()`` with ``tables(schema, name)``; type names from ``types``."""

    def __init__(self, types: dict[int, str], tables: Callable[[str, str], TableInfo]) -> None:
        self.types = dict(types)
        self.tables = tables

    @classmethod
    def of(cls, types: dict[int, str], info: TableInfo) -> StaticCatalog:
        """The catalog of one table, whatever name is asked for."""
        return cls(types, lambda _schema, _name: info)

    def typname(self, oid: int) -> str:
        return self.types[oid]

    def table(self, schema: str, name: str, relid: int | None = None) -> TableInfo:
        return self.tables(schema, name)

    def remember_type(self, oid: int, schema: str, name: str) -> None:
        self.types[oid] = name
