"""What the proxy holds in memory: no unused imports (httpx's CLI, the Redis client when no
backend needs it), an idle memo costs no RSS."""

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


# A `serve` start as users run it with the default (in-memory) stores, lifespan included: what
# it imports stays resident for the process's life (the Redis client alone is ~4.5 MB of RSS).
_PLAIN_START = """
import asyncio, os, sys
os.environ["COMPACTION_PROXY_UPSTREAM__BASE_URL"] = "http://127.0.0.1:9/v1"
from proxy.app import create_app
from proxy.settings import load_settings
import proxy.cli
app = create_app(load_settings())
async def start() -> None:
    async with app.router.lifespan_context(app):
        pass
asyncio.run(start())
redis = ("redis", "hiredis")
print(sorted(m for m in sys.modules if m.split(".")[0] in redis or m.endswith(".redis")))
print(sorted(app.state.proxy.counter.loaded))
"""


def test_a_plain_start_imports_no_redis_client_and_builds_one_encoding() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PLAIN_START], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "['o200k_base']"]


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


def _faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="Linux only")
def test_a_new_memo_entry_touches_one_page_of_the_table() -> None:
    """A key's two slots and their counts sit in one page, so remembering a new count costs
    one first-touch page fault (~15 us on a VM), not one in each of four arrays: a start's
    first requests and every new message pay that until the table's pages are all in use."""
    import random

    memo = Memo(4_000_000)  # 2M sets over 16k pages: 1000 random keys hit ~1000 pages
    pick = random.Random(7)
    keys = [pick.getrandbits(63) for _ in range(1000)]
    before = _faults()
    for key in keys:
        memo.get(key)
        memo.put(key, 12)
    assert memo.get_many(keys) == [12] * len(keys)
    assert _faults() - before < 1500  # (four separate arrays: ~4000)
