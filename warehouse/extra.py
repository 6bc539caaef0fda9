"""Whether the ``warehouse`` extra (Spark, Delta Lake) is installed: importable without it."""

from __future__ import annotations

import importlib.util


def spark_missing() -> str | None:
    """Why the warehouse cannot run here (a package of the extra is not installed), or None."""
    missing = [name for name in ("pyspark", "delta") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not installed: the warehouse needs Spark and Delta Lake, "
        "pip install 'walbus[warehouse]'"
    )
