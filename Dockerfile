# The walbus services (producer, demux) as one image; the warehouse job runs on Spark instead.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY walbus ./walbus
COPY producer ./producer
COPY demux ./demux
COPY warehouse ./warehouse
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT []
