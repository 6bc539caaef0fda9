"""walbus: a change-data-capture log bus for PostgreSQL.

The shared package: the message contract, config loading, logging, metrics,
Kafka/PostgreSQL helpers, the local development stack, the client API and the CLI.
"""

__version__ = "0.1.0"
