"""Pure tests: no services, no Spark, no network; each runs in well under a second."""
