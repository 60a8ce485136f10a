"""Running a user's test file in a pytest of its own, as a user's project would."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "testing-kit.md"


def kit_example(index: int = 0) -> str:
    """A Python code block of the testing kit's page, docs/testing-kit.md (the first by default)."""
    text = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) > index, "docs/testing-kit.md has too few python blocks"
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
