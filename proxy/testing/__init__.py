"""A kit for testing applications that talk to compaction-proxy, without a real model.

    from proxy.testing import FakeOpenAI, CompactionReport, make_app

`make_app(**sections)` builds the proxy with test defaults (fake upstream URL, small budget,
memory store, tokenizer from the offline package); `FakeOpenAI` is the upstream (on a respx
router or served as an ASGI app); `CompactionReport.from_headers` reads what the proxy did;
`serve(app)` puts an app on a real socket of 127.0.0.1, for clients the test does not build.
The pytest plugin (`-p compaction_proxy`) wires them into fixtures.
"""

from proxy.testing.app import FAKE_UPSTREAM, make_app, make_settings
from proxy.testing.fake_openai import FAKE_SUMMARY_PREFIX, Call, FakeOpenAI
from proxy.testing.report import CompactionReport
from proxy.testing.script import BrokenStream, Error, Reply, ToolCall
from proxy.testing.serve import serve

__all__ = [
    "FAKE_SUMMARY_PREFIX",
    "FAKE_UPSTREAM",
    "BrokenStream",
    "Call",
    "CompactionReport",
    "Error",
    "FakeOpenAI",
    "Reply",
    "ToolCall",
    "make_app",
    "make_settings",
    "serve",
]
