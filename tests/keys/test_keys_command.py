"""`compaction-proxy keys` against a proxy served on a real socket (no respx: the CLI's own
requests go over the network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ADMIN_ENV = "TEST_KEYS_COMMAND_ADMIN_TOKEN"


def test_the_keys_command_on_a_served_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import httpx

    from proxy.cli import main
    from proxy.testing import FakeOpenAI, make_app, serve

    def run(*argv: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exited:
            main(["keys", *argv])
        out, err = capsys.readouterr()
        return int(exited.value.code or 0), out, err

    def chat_status(url: str, secret: str) -> int:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"authorization": f"Bearer {secret}"}
        return httpx.post(
            f"{url}/v1/chat/completions", json=body, headers=headers, trust_env=False
        ).status_code

    monkeypatch.setenv(ADMIN_ENV, "admin-command-token")
    monkeypatch.setenv("PROXY_ADMIN_TOKEN", "admin-command-token")
    with serve(FakeOpenAI()) as fake_url:
        app = make_app(
            upstream={"base_url": f"{fake_url}/v1"},
            auth={"api_keys": True, "api_keys_file": str(tmp_path / "keys.json")},
            admin={"token_env": ADMIN_ENV},
        )
        with serve(app) as url:
            monkeypatch.setenv("PROXY_ADMIN_URL", url)
            code, out, err = run("create", "--id", "cli", "--team", "platform", "--rpm", "50")
            assert code == 0 and "shown once" in err
            first = out.strip()
            assert first.startswith("sk-cp-") and "\n" not in first
            assert chat_status(url, first) == 200
            code, out, _ = run("list")
            [line] = [row for row in out.splitlines() if row.startswith("cli ")]
            assert "platform" in line and "active" in line and "requests_per_minute=50" in line
            code, out, _ = run("rotate", "cli", "--old-expires-in", "0")
            second = out.strip()
            assert chat_status(url, first) == 401 and chat_status(url, second) == 200
            code, out, _ = run("--json", "update", "cli", "--model", "gpt-4o*")
            assert json.loads(out)["allowed_models"] == ["gpt-4o*"]
            code, out, _ = run("revoke", "cli")
            assert code == 0 and "revoked" in out
            assert chat_status(url, second) == 401
            code, _, err = run("get", "nobody")
            assert code == 2 and "answered 404" in err
            monkeypatch.setenv("PROXY_ADMIN_TOKEN", "wrong")
            code, _, err = run("list")
            assert code == 2 and "answered 401" in err
    audit = (tmp_path / "keys.json.audit.jsonl").read_text()
    assert first not in audit and second not in audit
    assert '"actor":"' in audit and "@" in audit  # the CLI says who: user@host
