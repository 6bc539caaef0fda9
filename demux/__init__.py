"""walbus demux: the database topic -> compacted per-table topics, keyed by primary key."""
