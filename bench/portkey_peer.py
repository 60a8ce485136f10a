"""Portkey's open-source AI gateway as a benchmark target: npm, its own folder, one process.

Like LiteLLM (bench/litellm_peer.py), a peer to compare against, never a dependency: it is
installed from npm into a folder of its own (by default under ~/.cache/compaction-proxy-bench/,
reused when the pinned version is there), never into this repository.

- `@portkey-ai/gateway` pinned, with `@hono/node-server` held at 1.13.5 by an npm `overrides`
  entry, as Portkey's own lockfile does (1.19 answers every stream with a 500);
- started headless (`--headless`: no UI), listening on the port given;
- routed per request, as Portkey's docs show for an OpenAI-compatible server: the request
  headers `x-portkey-provider: openai` and `x-portkey-custom-host: <upstream>/v1`; the
  client's Authorization goes on to the upstream.

By design it waits 25 ms before relaying a stream's first event (so its added p50 on
streams is at least that); nothing here changes that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

PINNED_VERSION = "1.15.2"
HONO_NODE_SERVER = "1.13.5"
_ENTRY = Path("node_modules/@portkey-ai/gateway/build/start-server.js")


def default_dir(version: str = PINNED_VERSION) -> Path:
    """Where the install for `version` lives unless a path is given: a per-user cache."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "compaction-proxy-bench" / f"portkey-{version}"


def package_json(version: str = PINNED_VERSION) -> dict[str, object]:
    return {
        "name": "portkey-bench-peer",
        "private": True,
        "dependencies": {"@portkey-ai/gateway": version},
        "overrides": {"@hono/node-server": HONO_NODE_SERVER},
    }


def installed_version(folder: Path) -> str | None:
    """The gateway version installed in `folder`, or None."""
    manifest = folder / "node_modules/@portkey-ai/gateway/package.json"
    hono = folder / "node_modules/@hono/node-server/package.json"
    try:
        if json.loads(hono.read_text())["version"] != HONO_NODE_SERVER:
            return None
        return str(json.loads(manifest.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def ensure_installed(folder: Path, version: str = PINNED_VERSION) -> Path:
    """`npm install` the pinned gateway into `folder` unless it is there already."""
    if installed_version(folder) == version:
        return folder
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("the portkey target needs node and npm")
    print(f"installing @portkey-ai/gateway@{version} into {folder} (about a minute)", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "package.json").write_text(json.dumps(package_json(version), indent=2) + "\n")
    subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=folder, check=True
    )
    found = installed_version(folder)
    if found != version:
        raise RuntimeError(f"{folder} has @portkey-ai/gateway {found}, wanted {version}")
    return folder


def command(folder: Path, port: int) -> list[str]:
    return ["node", str(folder / _ENTRY), f"--port={port}", "--headless"]


def request_headers(upstream_base_url: str) -> list[str]:
    """`name: value` lines the load generator adds to each request (routing, see above)."""
    return ["x-portkey-provider: openai", f"x-portkey-custom-host: {upstream_base_url}"]
