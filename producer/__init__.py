"""walbus producer: PostgreSQL logical replication -> one LSN-keyed Kafka topic per database."""
