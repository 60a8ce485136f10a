"""LiteLLM's proxy as a benchmark target: its own venv, its own config, one worker.

LiteLLM is a peer to compare against, never a dependency of this project: it is installed
from PyPI into a venv of its own (by default under ~/.cache/compaction-proxy-bench/, reused
when the pinned version is already there), so its hundreds of packages never meet ours.

The config is written as JSON (a subset of YAML, which LiteLLM reads), so writing it needs
nothing from that venv. What it sets, and why:
- one `model_list` entry: `gpt-4o-mini` (what bench/loadgen.py asks for) routed to the bench
  upstream as an OpenAI-compatible `api_base`, the way one fronts any OpenAI-like server;
- `master_key: sk-bench` (the key the load generator sends): LiteLLM refuses to start without
  a master key, and checking it on every request is what its users pay too;
- no database (no `database_url`), spend and error logs off, no callbacks, `LITELLM_LOG=ERROR`
  (its production advice), and the bundled model cost map instead of a fetch at start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# 1.108.7: what the published comparison outside this repo measured. Later releases (1.110.x)
# move the `proxy` extra into a separate `litellm-proxy` distribution not on PyPI as of
# 2026-12-01, so `litellm[proxy]==1.110.2` does not install.
PINNED_VERSION = "1.108.7"
# The key bench/loadgen.py sends (`Authorization: Bearer sk-bench`).
MASTER_KEY = "sk-bench"
MODEL = "gpt-4o-mini"


def default_venv(version: str = PINNED_VERSION) -> Path:
    """Where the venv for `version` lives unless a path is given: a per-user cache."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "compaction-proxy-bench" / f"litellm-{version}"


def config(upstream_base_url: str) -> dict[str, Any]:
    """LiteLLM's proxy config: one model routed to `upstream_base_url` (ends in /v1)."""
    return {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": upstream_base_url,
                    "api_key": "sk-bench-upstream",
                },
            }
        ],
        "litellm_settings": {"set_verbose": False, "drop_params": True, "callbacks": []},
        "general_settings": {
            "master_key": MASTER_KEY,
            "disable_spend_logs": True,
            "disable_error_logs": True,
        },
    }


def write_config(path: Path, upstream_base_url: str) -> Path:
    path.write_text(json.dumps(config(upstream_base_url), indent=2) + "\n")
    return path


def server_env() -> dict[str, str]:
    """Environment for the LiteLLM server: quiet, no network at start-up, no feedback box."""
    return {
        "LITELLM_LOG": "ERROR",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true",
    }


def command(venv: Path, config_path: Path, port: int) -> list[str]:
    """`litellm --config ... --num_workers 1`: one uvicorn process, like each server here."""
    return [
        str(venv / "bin" / "litellm"), "--config", str(config_path),
        "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1",
    ]  # fmt: skip


def installed_version(venv: Path) -> str | None:
    """The litellm version in `venv`, or None when it is not a usable LiteLLM venv."""
    python = venv / "bin" / "python"
    if not (python.exists() and (venv / "bin" / "litellm").exists()):
        return None
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def ensure_venv(venv: Path, version: str = PINNED_VERSION) -> Path:
    """Create `venv` with `litellm[proxy]==version` unless it already has that version."""
    if installed_version(venv) == version:
        return venv
    print(f"installing litellm[proxy]=={version} into {venv} (about a minute)", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"litellm[proxy]=={version}"], check=True)
    found = installed_version(venv)
    if found != version:
        raise RuntimeError(f"{venv} has litellm {found}, wanted {version}")
    return venv
