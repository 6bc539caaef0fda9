"""The local development stack (PostgreSQL + Apache Kafka as plain processes, no Docker)."""

from walbus.dev.processes import StackError
from walbus.dev.stack import LocalStack, default_state_dir

__all__ = ["LocalStack", "StackError", "default_state_dir"]
