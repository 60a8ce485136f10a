"""Running a user's test file in a pytest of its own, as a user's project would."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_SECTION = "## Testing your application with compaction-proxy"


def readme_example(index: int = 0) -> str:
    """A Python code block of the README's testing section (the first by default)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) > index, "the README's testing section has too few python blocks"
    return str(blocks[index])


def run_pytest(
    python: str, folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """pytest in `folder` (its own rootdir: no pyproject, asyncio strict mode) with a clean
    environment: no inherited addopts, plugins or proxy settings; then `env`."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "COMPACTION_PROXY_")) and k != "PYTHONPATH"
    }
    return subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
