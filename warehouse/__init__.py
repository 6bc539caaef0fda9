"""walbus warehouse: PySpark loader for per-table history and current-state tables.

Spark comes with the ``warehouse`` extra (``pip install 'walbus[warehouse]'``): this module
and :mod:`warehouse.cli` import without it, so the commands can say so.
"""

from __future__ import annotations

from typing import Final

NUMERIC_SCALE: Final = 10  # default scale of decimal(38, s) for numeric (see warehouse.types)

