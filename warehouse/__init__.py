"""walbus warehouse: PySpark loader for per-table history and current-state tables."""
