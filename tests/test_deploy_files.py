"""What ships in deploy/ and the Dockerfile, checked against the proxy itself.

The Grafana dashboard and the Prometheus alert rules name only metrics (and labels) that a
running proxy exports; promtool checks the rules, their unit tests, the scrape config and
every dashboard query's syntax where it is installed. The image's health check follows the
configured port; deploy/check.sh says when it could not run instead of passing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.testing import Error, FakeOpenAI, make_app, serve

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
# Labels Prometheus adds to every scraped series (target labels), not the proxy.
TARGET_LABELS = {"instance", "job", "replica"}
# Grafana's variables, replaced by values PromQL parses.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "6h", "$instance": ".*"}

KEY_A, KEY_B = "pk-deploy-team-a", "pk-deploy-team-b"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"]]


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """Each proxy metric an expression reads, with the labels its selector names."""
    found = []
    for name, braces in re.findall(r"\b(compaction_proxy_[a-z_]+)(\{[^}]*\})?", expr):
        labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", braces))
        found.append((name, labels))
    return found


async def exported_metrics() -> dict[str, set[str] | None]:
    """Every sample name /metrics declares after some traffic -> the labels seen on it
    (None: declared, no sample yet)."""
    fake = FakeOpenAI()
    app = make_app(
        compaction={"budget_tokens": 400, "summarizer": {"retries": 0}},
        auth={
            "keys": [
                {"id": "team-a", "key_sha256": sha(KEY_A)},
                {"id": "team-b", "key_sha256": sha(KEY_B), "requests_per_minute": 1},
            ]
        },
        upstream={"base_url": fake.base_url},
    )
    long_history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "words " * 60}
        for i in range(10)
    ]
    with fake.mock():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
                a = {"authorization": f"Bearer {KEY_A}"}
                b = {"authorization": f"Bearer {KEY_B}"}
                short = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
                long = {"model": "gpt-4o-mini", "messages": long_history}
                assert (await client.post("/v1/chat/completions", json=short, headers=a)).is_success
                compacted = await client.post("/v1/chat/completions", json=long, headers=a)
                assert compacted.headers["x-compaction-status"] == "compacted"
                fake.summaries = [Error(500)]
                failed = await client.post("/v1/chat/completions", json=long, headers=b)
                assert failed.headers["x-compaction-status"] == "failed"
                refused = await client.post("/v1/chat/completions", json=short, headers=b)
                assert refused.status_code == 429
                assert (await client.get("/v1/models", headers=a)).is_success
                text = (await client.get("/metrics")).text
    declared: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total", "_created"),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",),
        }.get(family.type, ("",))
        for suffix in suffixes:
            declared.setdefault(family.name + suffix, None)
        for sample in family.samples:
            seen = declared.get(sample.name) or set()
            declared[sample.name] = seen | set(sample.labels)
    return declared


@pytest.fixture(scope="module")
def metrics() -> dict[str, set[str] | None]:
    import asyncio

    return asyncio.run(exported_metrics())


def test_the_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    data = dashboard()
    assert data["uid"] == "compaction-proxy"
    names = {v["name"] for v in data["templating"]["list"]}
    assert {"datasource", "instance"} <= names
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in data["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
        if panel.get("targets"):
            assert panel["datasource"]["uid"] == "${datasource}"
            for target in panel["targets"]:
                assert '{instance=~"$instance"' in target["expr"], target["expr"]


def test_every_metric_the_dashboard_and_alerts_read_is_exported(
    metrics: dict[str, set[str] | None],
) -> None:
    queries = dashboard_queries() + [rule["expr"] for rule in alert_rules()]
    used = [found for expr in queries for found in selectors(expr)]
    assert len({name for name, _ in used}) >= 20  # the families docs/operations.md lists
    for name, labels in used:
        assert name in metrics, f"{name} is not in /metrics"
        seen = metrics[name]
        if seen is not None:
            unknown = labels - seen - TARGET_LABELS
            assert not unknown, f"{name} has no label {unknown} (it has {sorted(seen)})"


def test_the_documented_alert_expressions_are_in_the_rules() -> None:
    readme = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    rules = ALERTS.read_text(encoding="utf-8")
    for metric in (
        "compaction_proxy_requests_total",
        "compaction_proxy_summarizer_breaker_state",
        "compaction_proxy_store_errors_total",
        "compaction_proxy_upstream_ttfb_seconds",
        "compaction_proxy_overhead_seconds",
    ):
        assert metric in readme and metric in rules


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return found


def run_promtool(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_checks_the_rules_their_unit_tests_and_the_scrape_config() -> None:
    here = DEPLOY / "prometheus"
    run_promtool("check", "rules", "alerts.yml", cwd=here)
    run_promtool("test", "rules", "alerts.test.yml", cwd=here)
    run_promtool("check", "config", "prometheus.yml", cwd=here)


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    rules = []
    for index, expr in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{index}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool("check", "rules", str(path), cwd=tmp_path)


def healthcheck_command() -> list[str]:
    text = (REPO / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    match = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])\s*$", text, re.MULTILINE)
    assert match is not None, "no HEALTHCHECK ... CMD [...] in the Dockerfile"
    command: list[str] = json.loads(match.group(1))
    return command


def test_the_images_health_check_follows_the_configured_port() -> None:
    command = healthcheck_command()
    assert command[0] == "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTION_PROXY_")}
    fake = FakeOpenAI()
    with fake.mock(), serve(make_app(upstream={"base_url": fake.base_url})) as url:
        port = url.rsplit(":", 1)[1]
        fake.router.route(url__startswith=url).pass_through()  # type: ignore[union-attr]
        here = subprocess.run(
            [sys.executable, *command[1:]],
            env={**env, "COMPACTION_PROXY_SERVER__PORT": port},
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert here.returncode == 0, here.stderr
        # The image's default, 8080, is not where this server listens: unhealthy.
        elsewhere = subprocess.run(
            [sys.executable, *command[1:]],
            env={**env, "COMPACTION_PROXY_SERVER__PORT": str(closed_port())},
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert elsewhere.returncode != 0


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_compose_keeps_redis_on_a_volume_and_secrets_in_an_env_file() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    redis = compose["services"]["redis"]
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert "redis-data" in compose["volumes"]
    redis_image = (DEPLOY / "redis.Dockerfile").read_text(encoding="utf-8")
    assert '"--appendonly", "yes"' in redis_image and '"--dir", "/data"' in redis_image
    for name in ("proxy-1", "proxy-2"):
        service = compose["services"][name]
        assert service["env_file"] == ["${PROXY_ENV_FILE:-.env}"]
        assert not any("KEY" in k or "TOKEN" in k for k in service["environment"])
    # One metrics port per replica, on the loopback only.
    ports = compose["services"]["lb"]["ports"]
    assert sum(port.startswith("127.0.0.1:") for port in ports) == 2
    production = (DEPLOY / "proxy.production.toml").read_text(encoding="utf-8")
    assert 'token_env = "PROXY_ADMIN_TOKEN"' in production


def test_the_env_file_example_holds_no_secret() -> None:
    example = (DEPLOY / ".env.example").read_text(encoding="utf-8")
    values = dict(
        line.split("=", 1) for line in example.splitlines() if line and not line.startswith("#")
    )
    assert set(values) >= {"PROXY_ADMIN_TOKEN", "PROXY_KEY_TEAM_A", "PROXY_KEY_TEAM_B"}
    for name, value in values.items():
        if "KEY" in name or "TOKEN" in name:
            assert value == "", f"{name} has a value in .env.example"
    assert "deploy/.env" in (REPO / ".gitignore").read_text(encoding="utf-8").splitlines()


def test_deploy_check_exits_non_zero_when_it_cannot_run(tmp_path: Path) -> None:
    # A PATH with the script's basic tools and no podman.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "python3"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run(
        [bash, str(DEPLOY / "check.sh")],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "NOT RUN: podman is not installed" in done.stderr
