"""The local development stack (PostgreSQL + Apache Kafka as plain processes, no Docker)."""

from walbus.app.dev.processes import StackError
from walbus.app.dev.stack import LocalStack, default_state_dir

__all__ = ["LocalStack", "StackError", "default_state_dir"]
