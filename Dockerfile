# Two images (no Docker engine runs in CI: tests/test_compose.py checks this file):
#   docker build --target services .    the producer, the demux and `walbus status` (the default)
#   docker build --target warehouse .   the same package with a Java runtime for Spark
FROM python:3.11-slim AS base
# A non-root user whose home holds the demux' state: a named volume mounted there starts as a
# copy of this directory, owned by this user, so the demux can write it (0700: rows live there).
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/walbus --create-home --shell /usr/sbin/nologin walbus \
    && chmod 0700 /var/lib/walbus
WORKDIR /app
COPY pyproject.toml README.md ./
COPY walbus ./walbus
COPY producer ./producer
COPY demux ./demux
COPY warehouse ./warehouse
# [compression]: the lz4, zstd and snappy codecs of --compression (gzip needs nothing)
RUN pip install --no-cache-dir '.[compression]'
ENV WALBUS_DEMUX_STATE_DIR=/var/lib/walbus/demux
ENTRYPOINT []

FROM base AS warehouse
# Spark runs on the JVM: `walbus warehouse load|sql` need a Java runtime (Debian's default: 17 or 21, Spark 4.2 runs on Java 17+).
RUN apt-get update && apt-get install -y --no-install-recommends default-jre-headless \
    && rm -rf /var/lib/apt/lists/*
USER walbus
CMD ["walbus", "warehouse", "--help"]

FROM base AS services
USER walbus
CMD ["walbus", "--help"]
