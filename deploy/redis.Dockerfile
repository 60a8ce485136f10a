# Redis from Debian's packages on the same base as the proxy's image, so the stack builds
# with nothing but a python:3.11-slim image and apt.
FROM python:3.11-slim
# Debian's redis-server at the version bookworm ships; pinning it would break on updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data \
    && chown redis:redis /data
# The system user the package creates; its uid is picked at install time, so no number here.
# hadolint ignore=DL3066
USER redis
# Quota counters and the usage and spend ledger live here with the summaries: an append-only
# file (fsync every second) in /data, a volume in compose.yaml, so a restart keeps them.
VOLUME /data
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--dir", "/data", \
     "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
