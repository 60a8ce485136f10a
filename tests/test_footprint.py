"""What the proxy holds in memory: no unused imports, an idle memo costs no RSS."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.tokens.memo import Memo


def test_importing_the_app_leaves_out_httpxs_command_line_client() -> None:
    code = (
        "import sys, proxy.app, proxy.cli, httpx\n"
        "print(sorted(m for m in ('httpx._main', 'rich', 'pygments') if sys.modules.get(m)))\n"
        "print(callable(httpx.main), httpx.AsyncClient is not None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    assert out[:2] == ["[]", "True True"]


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_an_idle_memo_takes_no_memory_until_written() -> None:
    before = _rss_kb()
    memo = Memo(4_000_000)  # a 64 MB table
    assert _rss_kb() - before < 8 * 1024
    for key in range(1000):
        memo.put(key, key)
    assert memo.get_many(list(range(1000))) == list(range(1000))
    assert _rss_kb() - before < 8 * 1024  # 1000 entries touch at most 1000 pages per array
