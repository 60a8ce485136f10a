"""OpenAI's own schema of POST /chat/completions, fuzzed through the proxy over ASGI.

schemathesis generates valid and invalid requests (bodies, headers) from the operation as
OpenAI publishes it (tests/openapi/chat_completions.json, extracted by extract.py next to
it); the upstream is a respx router that accepts anything. Whatever is sent: no 5xx from the
proxy (the upstream here never answers one), every error the proxy answers is OpenAI's
envelope, and a request the proxy did not compact reaches the upstream byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from hypothesis import HealthCheck, settings

from proxy.app import create_app
from tests.conftest import UPSTREAM, make_settings
from tests.upstream_fakes import REPLY

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")

SPEC = json.loads((Path(__file__).parent / "openapi" / "chat_completions.json").read_text())
EXAMPLES = 60

router = respx.MockRouter(base_url=UPSTREAM, assert_all_called=False)
router.route().respond(200, json=REPLY)  # any method: wrong ones are relayed too
app = create_app(
    make_settings(compaction={"budget_tokens": 4000}),
    transport=httpx.MockTransport(router.async_handler),
)
schema = schemathesis.openapi.from_dict(SPEC)
schema.app = app
seen: list[int] = []


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_proxy_5xx_and_every_proxy_error_is_an_envelope(case: Any) -> None:
    before = len(router.calls)
    response = case.call()
    seen.append(response.status_code)
    assert response.status_code < 500, response.text[:500]
    forwarded = router.calls[before:]
    if response.status_code >= 400:
        assert not forwarded  # the upstream answers 200 here: this error is the proxy's
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        return
    assert response.json() == REPLY
    main = [c for c in forwarded if b"compacts conversation context" not in c.request.content]
    assert len(main) == 1
    if response.headers.get("x-compaction-status") in ("passthrough", "off", "skipped"):
        sent = response.request.body
        assert main[0].request.content == (sent if isinstance(sent, bytes) else sent.encode())


def test_the_fuzz_ran_and_saw_both_answers() -> None:
    # Runs after the fuzz in file order: proves it generated cases, valid and invalid.
    if not seen:
        pytest.skip("run together with the fuzz test")
    assert len(seen) >= EXAMPLES  # ~1,500 with schemathesis's coverage phase
    assert any(code == 200 for code in seen) and any(400 <= code < 500 for code in seen)
