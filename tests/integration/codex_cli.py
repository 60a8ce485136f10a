"""Codex CLI for the tests: installed from npm (the package ships its native binary) into a
cache outside the repository, once; None with a reason where node or npm is absent."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

VERSION = "0.171.0"
PACKAGE = f"@openai/codex@{VERSION}"
INSTALL_S = 600


def codex_binary(config: pytest.Config, tmp_root: Path) -> Path:
    """The `codex` launcher, installing it first if needed; skips the test without npm."""
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.skip("Codex CLI needs node and npm (npm install @openai/codex)")
    prefix = _cache_dir(config, tmp_root)
    launcher = prefix / "node_modules" / ".bin" / "codex"
    if not launcher.exists():
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix), PACKAGE],
            capture_output=True,
            text=True,
            timeout=INSTALL_S,
            check=False,
        )
        if done.returncode != 0 or not launcher.exists():
            pytest.fail(f"npm install {PACKAGE} failed:\n{done.stdout}\n{done.stderr}")
    return launcher


def _cache_dir(config: pytest.Config, tmp_root: Path) -> Path:
    """COMPACTION_PROXY_CODEX_DIR, else pytest's cache folder (.pytest_cache, ignored by
    git), else this run's temporary folder."""
    chosen = os.environ.get("COMPACTION_PROXY_CODEX_DIR")
    if chosen:
        path = Path(chosen)
    elif getattr(config, "cache", None) is not None:
        path = config.cache.mkdir(f"codex-{VERSION}")
    else:
        path = tmp_root / f"codex-{VERSION}"
    path.mkdir(parents=True, exist_ok=True)
    return path
