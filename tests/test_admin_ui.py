"""/admin/ui in a real headless browser: it loads with data, its plots render, nothing errs.

The proxy is served on a real socket with keys in two teams; requests go through it (some
compacted), and the usage ledger also holds two weeks of earlier days so the plots have a
shape. `UPDATE_DOCS_SCREENSHOT=1` writes the page's picture to docs/admin-ui.png.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.quota.ledger import UsageCounts
from proxy.testing import FakeOpenAI, make_app, serve
from tests.browser import chromium, open_page

REPO = Path(__file__).resolve().parents[1]
TOKEN = "admin-ui-token"
KEYS = {"search-bot": "sk-ui-search", "coder": "sk-ui-coder", "ops-agent": "sk-ui-ops"}
TEAMS = {"search-bot": "search", "coder": "platform", "ops-agent": "platform"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_UI_ADMIN_TOKEN", TOKEN)


def ui_app(upstream: str) -> Any:
    keys = [
        {
            "id": key_id,
            "key_sha256": sha(secret),
            "team": TEAMS[key_id],
            "requests_per_minute": 600,
            "spend_usd_per_day": 5.0,
        }
        for key_id, secret in KEYS.items()
    ]
    return make_app(
        upstream={"base_url": upstream},
        compaction={"budget_tokens": 800, "summarizer": {"retries": 0}},
        auth={"keys": keys, "teams": {"platform": {"spend_usd_per_day": 20.0}}},
        admin={"token_env": "TEST_UI_ADMIN_TOKEN"},
    )


async def seed(app: Any) -> None:
    """Two weeks of usage before today, as earlier traffic would have left it."""
    ledger = app.state.proxy.meter.ledger
    now = time.time()
    for back in range(1, 14):
        for i, (key_id, team) in enumerate(TEAMS.items()):
            requests = 40 + 7 * ((back * (i + 3)) % 9)
            sent = requests * (9000 + 1500 * i)
            saved = sent * (25 + 5 * ((back + i) % 5)) // 100
            counts = UsageCounts(
                requests=requests, prompt_tokens_sent=sent, prompt_tokens_forwarded=sent - saved,
                completion_tokens=requests * 300, tokens_saved=saved,
                cost_nano_usd=(sent - saved) * 150 + requests * 300 * 600,
            )  # fmt: skip
            model = ("gpt-4o-mini", "gpt-4.1-mini", "gpt-4o")[i]
            await ledger.record(key_id, model, counts, now - back * 86400, team=team)


def traffic(url: str) -> None:
    """Short chats and long agent histories (compacted) through the served proxy."""
    history = [
        {"role": "user" if n % 2 == 0 else "assistant", "content": f"step {n} " + "word " * 60}
        for n in range(25)
    ]
    with httpx.Client(base_url=f"{url}/v1", timeout=60, trust_env=False) as client:
        for key_id, secret in KEYS.items():
            headers = {"authorization": f"Bearer {secret}"}
            for turn in range(3):
                messages = history if turn else [{"role": "user", "content": "hi"}]
                body = {"model": "gpt-4o-mini", "messages": messages, "user": f"{key_id}-user"}
                reply = client.post("/chat/completions", json=body, headers=headers)
                assert reply.status_code == 200, reply.text
    recorded(url, len(KEYS) * 3)


def recorded(url: str, requests: int) -> None:
    """Wait (bounded) until the meter's batch with today's requests is in the ledger."""
    today = time.strftime("%Y-%m-%d", time.gmtime())
    deadline = time.monotonic() + 10
    auth = {"authorization": f"Bearer {TOKEN}"}
    while True:
        reply = httpx.get(
            f"{url}/admin/usage", params={"since": today}, headers=auth, trust_env=False
        )
        if sum(row["requests"] for row in reply.json()["data"]) >= requests:
            return
        assert time.monotonic() < deadline, "usage never recorded"
        time.sleep(0.05)


def test_the_page_needs_the_admin_token_and_a_browser_is_asked_for_it(admin_env: None) -> None:
    app = ui_app("http://127.0.0.1:9/v1")
    with serve(app) as url:
        refused = httpx.get(f"{url}/admin/ui", trust_env=False)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Basic ")
        basic = httpx.get(f"{url}/admin/ui", auth=("anyone", TOKEN), trust_env=False)
        assert basic.status_code == 200 and "<svg" in basic.text
        assert "default-src 'none'" in basic.headers["content-security-policy"]
        wrong = httpx.get(f"{url}/admin/ui", auth=("anyone", "nope"), trust_env=False)
        assert wrong.status_code == 401


def test_the_admin_page_in_a_headless_browser(admin_env: None, tmp_path: Path) -> None:
    chromium()  # skips without a browser
    with serve(FakeOpenAI()) as fake_url:
        app = ui_app(f"{fake_url}/v1")
        asyncio.run(seed(app))
        with serve(app) as url:
            traffic(url)
            found = asyncio.run(_look(url, tmp_path / "admin-ui.png"))
    assert found["errors"] == []
    assert found["title"] == "compaction-proxy admin"
    assert found["charts"] == 5
    assert all(width > 300 and height > 100 for width, height in found["sizes"])
    assert found["bars"] == 14 * 2  # both teams on every day: 13 seeded, and today
    assert found["legend"] >= {"platform", "search"}
    assert found["spend"].startswith("$") and found["spend"] != "$0.0000"
    assert found["quota_rows"] == 3 * 2 + 2  # two limits a key, and the platform team cap
    assert found["recent"] == 3 * 2  # per key: compacted, then reused
    assert set(found["statuses"]) == {"compacted", "reused"}
    assert found["replica_saved"] != "0"
    shot = (tmp_path / "admin-ui.png").read_bytes()
    assert shot.startswith(b"\x89PNG") and len(shot) > 20_000
    if os.environ.get("UPDATE_DOCS_SCREENSHOT") == "1":
        (REPO / "docs" / "admin-ui.png").write_bytes(shot)


async def _look(url: str, screenshot: Path) -> dict[str, Any]:
    async with open_page() as page:
        credentials = base64.b64encode(f"admin:{TOKEN}".encode()).decode()
        await page.call(
            "Network.setExtraHTTPHeaders", headers={"Authorization": f"Basic {credentials}"}
        )
        await page.goto(f"{url}/admin/ui?days=14&by=team")
        found = {
            "title": await page.evaluate("document.title"),
            "charts": await page.evaluate("document.querySelectorAll('svg.chart').length"),
            "sizes": await page.evaluate(
                "[...document.querySelectorAll('svg.chart')].map(s => {"
                " const r = s.getBoundingClientRect(); return [r.width, r.height]; })"
            ),
            "bars": await page.evaluate(
                "[...document.querySelectorAll('svg.chart')][0].querySelectorAll('rect.bar').length"
            ),
            "legend": set(
                await page.evaluate(
                    "[...document.querySelectorAll('svg.chart')[0]"
                    ".querySelectorAll('text.legend')].map(t => t.textContent)"
                )
            ),
            "spend": await page.evaluate("document.getElementById('spend').textContent"),
            "saved": await page.evaluate("document.getElementById('saved').textContent"),
            "quota_rows": await page.evaluate("document.querySelectorAll('#quota tr').length - 1"),
            "recent": await page.evaluate("document.querySelectorAll('#recent tr').length - 1"),
            "statuses": await page.evaluate(
                "[...document.querySelectorAll('#recent td:nth-child(5)')].map(t => t.textContent)"
            ),
            "replica_saved": await page.evaluate(
                "document.getElementById('replica-saved').textContent"
            ),
        }
        await page.screenshot(screenshot, 1400, 1000)
        found["errors"] = list(page.errors)
    return found
