"""Shared fixtures; the service fixtures live in the fix_* plugins."""

pytest_plugins = ["tests.fix_services", "tests.fix_spark", "tests.fix_cluster"]
