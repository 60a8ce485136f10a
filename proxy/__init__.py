"""compaction-proxy: an OpenAI-compatible reverse proxy that compacts long chat histories."""

import sys

__version__ = "0.1.0"

# httpx imports its command-line client (rich, pygments, click: ~3 MB of RSS) whenever
# those packages happen to be installed; the proxy never runs it. A None entry makes that
# import fail, and httpx then defines a stub `httpx.main` instead (its own fallback).
if "httpx" not in sys.modules:
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
