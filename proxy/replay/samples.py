"""The sample sessions shipped with the replay tool: made here, deterministically, from a seed.

    python -m proxy.replay.samples --out sessions/

Three agent shapes, each a chain of chat-completions requests as the agent sent them (every
line the whole request: model, tools, params, the history so far):

- `coding-agent`: one task, ~230 tool calls over 200 requests, some in parallel, file reads
  and test logs of up to ~7k tokens, an injected "Tool call error" user message;
- `support-chat`: 30 short customer turns, 14 tools, several empty results;
- `research-agent`: web searches and 24 long web pages, the answer built from facts on the
  first pages.

Later assistant messages name identifiers from early tool outputs (paths, functions, error
names, order numbers, URLs, figures), as agents do when they come back to something; that is
what the replay's needed-later recall measures. Nothing is copied from anywhere: every text
is put together from the word lists below. The same seed always gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Message = dict[str, Any]
Body = dict[str, Any]

SEED = 2024

# -- shared pieces -------------------------------------------------------------------------

_WORDS = (
    *("the", "a", "this", "each", "every", "that", "its", "our", "their", "one"),
    *("service", "request", "value", "result", "record", "table", "queue", "worker"),
    *("cache", "index", "batch", "version", "lock", "timeout", "retry", "field"),
    *("is", "was", "keeps", "returns", "checks", "reads", "writes", "holds", "moves"),
    *("before", "after", "while", "when", "unless", "because", "so", "and", "but"),
    *("quickly", "rarely", "twice", "again", "only", "still", "already", "never"),
)


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng, rng.randint(8, 18)) for _ in range(sentences))


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                "required": list(params),
            },
        },
    }


class Script:
    """A session being written: the history so far, and the requests sent."""

    def __init__(self, name: str, seed: int, model: str, tools: list[dict[str, Any]]) -> None:
        self.name = name
        self.rng = random.Random(f"{name}:{seed}")
        self.model = model
        self.tools = tools
        self.params: dict[str, Any] = {}
        self.messages: list[Message] = []
        self.requests: list[Body] = []
        self._calls = 0

    def say(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def send(self) -> None:
        """The agent sends its whole history (and what the model then says comes next)."""
        self.requests.append(
            {
                "model": self.model,
                "messages": list(self.messages),
                "tools": self.tools,
                **self.params,
            }
        )

    def call_id(self) -> str:
        self._calls += 1
        return f"call_{self._calls:04d}{self.rng.getrandbits(40):010x}"

    def act(
        self,
        calls: list[tuple[str, dict[str, Any], str]],
        content: str | None = None,
    ) -> None:
        """Send, then the assistant's tool calls (in parallel when several) and their results."""
        self.send()
        ids = [self.call_id() for _ in calls]
        self.messages.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": i,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                    for i, (name, args, _) in zip(ids, calls, strict=True)
                ],
            }
        )
        for i, (_, _, output) in zip(ids, calls, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": i, "content": output})

    def reply(self, content: str) -> None:
        """Send, then the assistant's text answer."""
        self.send()
        self.say("assistant", content)


# -- the coding agent ----------------------------------------------------------------------

CODING_SYSTEM = """\
You are a coding agent working in a Python repository on the developer's machine. You can
read files, list directories, search the tree, edit files and run shell commands through the
tools you are given; you may call several tools at once when the calls do not depend on each
other. Work in small, verified steps: read before you edit, run the relevant tests after
every change, and never claim a fix you have not seen pass. Keep edits minimal and in the
style of the surrounding code; do not reformat unrelated lines. When a command fails, read
the whole error before acting. Do not touch migrations that have already shipped. Ask the
developer only when the task is ambiguous or a change would be destructive. When you are
done, summarise what changed, in which files, and how you verified it."""

CODING_TASK = """\
The `stockroom` service double-books stock: when two orders reserve the last unit of a SKU
at the same moment, both succeed. `tests/test_reservations.py::test_concurrent_reserve`
fails about one run in five with

    stockroom.errors.ReservationConflictError: sku=SKU-48213 expected version 17, found 18

and staging had the same thing as incident INC-20931
(https://status.stockroom.example/incidents/20931). Find the cause in `reserve_stock()`
(`stockroom/reservations.py`), fix it without making `bulk_reserve()` slower, add a
regression test, and run `make check` until it is green."""

CODING_TOOLS = [
    _tool("read_file", "Read a file of the repository.", path="Path from the repo root."),
    _tool("list_dir", "List a directory.", path="Path from the repo root."),
    _tool(
        "grep",
        "Search files with a regular expression.",
        pattern="A Python regex.",
        path="Where to search.",
    ),
    _tool("run", "Run a shell command in the repository root.", cmd="The command line."),
    _tool(
        "edit_file",
        "Replace one exact snippet of a file.",
        path="Path from the repo root.",
        old="Exact text to replace.",
        new="Replacement text.",
    ),
    _tool(
        "write_file",
        "Create or overwrite a file.",
        path="Path from the repo root.",
        content="The whole new content.",
    ),
]

_MODULES = {
    "stockroom/reservations.py": (
        "reserve_stock",
        "bulk_reserve",
        "release_reservation",
        "_next_version",
        "Reservation",
    ),
    "stockroom/db/locks.py": (
        "acquire_row_lock",
        "release_row_lock",
        "LockTimeoutError",
        "LOCK_TIMEOUT_MS",
    ),
    "stockroom/models/sku.py": (
        "SkuRecord",
        "compare_and_swap_version",
        "load_sku",
        "StaleVersionWarning",
    ),
    "stockroom/api/orders.py": (
        "create_order",
        "OrderPayload",
        "place_order_handler",
        "ORDER_RATE_LIMIT",
    ),
    "stockroom/settings.py": ("RESERVATION_TTL_S", "DB_POOL_SIZE", "Settings", "load_settings"),
    "stockroom/errors.py": (
        "ReservationConflictError",
        "OutOfStockError",
        "StockroomError",
        "format_conflict",
    ),
    "stockroom/db/session.py": (
        "session_scope",
        "engine_for",
        "SERIALIZABLE_RETRIES",
        "retry_serializable",
    ),
    "stockroom/jobs/expiry.py": (
        "expire_reservations",
        "EXPIRY_BATCH",
        "ExpiryJob",
        "schedule_expiry",
    ),
    "tests/conftest.py": ("db_session", "sku_factory", "concurrent_clients", "frozen_clock"),
    "tests/test_reservations.py": (
        "test_concurrent_reserve",
        "test_bulk_reserve_order",
        "test_release_restores_stock",
        "test_ttl_expiry",
    ),
}

_CODE_WORDS = ("sku", "qty", "version", "row", "order", "session", "lock", "stock", "batch")


def _python_module(rng: random.Random, path: str, names: tuple[str, ...], lines: int) -> str:
    """A plausible Python module defining `names`, about `lines` lines long, line-numbered."""
    out = [f'"""{path}: {_sentence(rng, 9)}"""', "", "from __future__ import annotations", ""]
    out += ["import logging", "import time", "from dataclasses import dataclass", ""]
    out += ["log = logging.getLogger(__name__)", ""]
    filler = 0
    while len(out) < lines:
        name = names[filler % len(names)] if filler < len(names) else None
        filler += 1
        if name is not None and name.isupper():
            out += [f"{name} = {rng.choice((2500, 900, 32, 250, 5))}", ""]
            continue
        if name is not None and name[0].isupper():
            out += [f"class {name}:", f'    """{_sentence(rng, 10)}"""', ""]
            for _ in range(rng.randint(2, 4)):
                field = rng.choice(_CODE_WORDS)
                out.append(f"    {field}_{rng.randint(1, 9)}: int = {rng.randint(0, 99)}")
            out.append("")
            continue
        fn = name or f"_{rng.choice(_CODE_WORDS)}_{rng.choice(_CODE_WORDS)}_{filler}"
        arg = rng.choice(_CODE_WORDS)
        out += [f"def {fn}({arg}: int, *, session: Session | None = None) -> int:"]
        out += [f'    """{_sentence(rng, 12)}"""']
        for _ in range(rng.randint(5, 14)):
            a, b = rng.choice(_CODE_WORDS), rng.choice(_CODE_WORDS)
            out.append(
                rng.choice(
                    (
                        f"    {a} = {b}.{rng.choice(_CODE_WORDS)} + {rng.randint(1, 64)}",
                        f"    if {a} > {b}:",
                        f"        log.debug('{a} %s over {b} %s', {a}, {b})",
                        f"    {a}_seen = time.monotonic() - {b}_started",
                        f"    for {a} in {b}s:",
                        f"        total += {a}.qty",
                    )
                )
            )
        out += [f"    return {arg}", ""]
    body = out[:lines]
    return "\n".join(f"{n:>4}  {line}" for n, line in enumerate(body, 1))


def _pytest_log(rng: random.Random, passed: int, failure: str | None, tail: str) -> str:
    tests = list(_MODULES["tests/test_reservations.py"]) + [
        f"test_{rng.choice(_CODE_WORDS)}_{rng.choice(_CODE_WORDS)}_{i}" for i in range(60)
    ]
    lines = ["============================= test session starts =============================="]
    lines.append("platform linux -- Python 3.12.4, pytest-8.2.2, pluggy-1.5.0")
    lines.append("rootdir: /home/dev/stockroom")
    lines.append("plugins: xdist-3.6.1, cov-5.0.0, timeout-2.3.1")
    lines.append(f"collected {passed + (1 if failure else 0)} items")
    lines.append("")
    for i in range(passed):
        module = rng.choice(
            (
                "tests/test_reservations.py",
                "tests/test_orders.py",
                "tests/test_expiry.py",
                "tests/test_api.py",
            )
        )
        lines.append(f"{module}::{tests[i % len(tests)]} PASSED{' ' * 20}[{100 * i // passed:3d}%]")
    if failure:
        lines += [
            "",
            "=================================== FAILURES ===================================",
            f"___________________________ {failure.split(':')[0]} ___________________________",
            "",
        ]
        for depth in range(rng.randint(12, 22)):
            module = rng.choice(list(_MODULES))
            lines.append(f"{module}:{rng.randint(20, 400)}: in {rng.choice(_MODULES[module])}")
            lines.append(f"    {rng.choice(_CODE_WORDS)} = {rng.choice(_CODE_WORDS)}_{depth}(qty)")
        lines += ["", failure, ""]
    lines.append(tail)
    return "\n".join(lines)


def coding_agent(seed: int = SEED) -> list[Body]:
    s = Script("coding-agent", seed, "gpt-4.1", CODING_TOOLS)
    s.params = {"temperature": 0.2, "parallel_tool_calls": True, "tool_choice": "auto"}
    rng = s.rng
    s.say("system", CODING_SYSTEM)
    s.say("user", CODING_TASK)
    files = list(_MODULES)

    def read(path: str, lines: int | None = None) -> tuple[str, dict[str, Any], str]:
        size = lines or rng.randint(18, 55)
        return ("read_file", {"path": path}, _python_module(rng, path, _MODULES[path], size))

    def run(cmd: str, output: str) -> tuple[str, dict[str, Any], str]:
        return ("run", {"cmd": cmd}, output)

    def grep(pattern: str, hits: int) -> tuple[str, dict[str, Any], str]:
        lines = [
            f"{rng.choice(files)}:{rng.randint(5, 400)}:    {pattern}({rng.choice(_CODE_WORDS)})"
            for _ in range(hits)
        ]
        return ("grep", {"pattern": pattern, "path": "."}, "\n".join(lines) or "(no matches)")

    conflict = (
        "E   stockroom.errors.ReservationConflictError: sku=SKU-48213 expected version 17, "
        "found 18\nE   raised at stockroom/reservations.py:212 in reserve_stock"
    )
    # 1. Explore (parallel reads of the modules the task names).
    s.act(
        [
            (
                "list_dir",
                {"path": "."},
                "\n".join(
                    sorted({f.split("/")[0] for f in files} | {"Makefile", "pyproject.toml"})
                ),
            )
        ],
        "Let me look at the layout first.",
    )
    s.act([("list_dir", {"path": "stockroom"}, "\n".join(f for f in files if "stockroom/" in f))])
    s.act(
        [
            read("stockroom/reservations.py", 260),
            read("stockroom/db/locks.py", 140),
            read("stockroom/models/sku.py", 170),
        ],
        "Reading the reservation path and the two modules it depends on.",
    )
    s.act([grep("reserve_stock", 14), grep("compare_and_swap_version", 6)])
    s.act([read("tests/test_reservations.py", 210), read("tests/conftest.py", 120)])
    # 2. Reproduce: a long failing run.
    s.act(
        [
            run(
                "pytest tests/test_reservations.py -x -q -p no:randomly --count=20",
                _pytest_log(
                    rng, 160, conflict, "========= 1 failed, 160 passed in 41.87s ========="
                ),
            )
        ],
        "Reproducing the flaky failure with repeated runs.",
    )
    s.act([read("stockroom/errors.py", 90), read("stockroom/settings.py", 80)])
    s.act(
        [
            run(
                "git log --oneline -12 -- stockroom/reservations.py",
                "\n".join(f"{rng.getrandbits(28):07x} {_sentence(rng, 7)}" for _ in range(12)),
            )
        ]
    )
    s.act([read("stockroom/db/session.py", 150)])
    # 3. Investigate: many small steps with mid-size outputs.
    notes = [
        "`reserve_stock()` reads the SkuRecord, then calls `compare_and_swap_version()` outside "
        "the row lock taken by `acquire_row_lock()`; two writers can both read version 17.",
        "LOCK_TIMEOUT_MS is 2500 in stockroom/db/locks.py and DB_POOL_SIZE is 32, so the lock "
        "wait is not what races.",
        "`_next_version()` increments in Python instead of `version = version + 1` in SQL.",
    ]
    for step in range(61):
        kind = step % 6
        if kind == 0:
            s.act(
                [
                    grep(
                        rng.choice(
                            (
                                "acquire_row_lock",
                                "_next_version",
                                "session_scope",
                                "retry_serializable",
                                "SERIALIZABLE_RETRIES",
                            )
                        ),
                        rng.randint(3, 20),
                    )
                ]
            )
        elif kind == 1:
            s.act([read(rng.choice(files))])
        elif kind == 2:
            s.act(
                [
                    run(
                        f"python -m stockroom.tools.explain reserve {rng.randint(100, 999)}",
                        "\n".join(
                            f"  -> Index Scan using sku_pkey on sku (cost=0.{rng.randint(10, 99)}"
                            f"..{rng.randint(8, 90)}.{rng.randint(10, 99)} rows=1)"
                            for _ in range(rng.randint(20, 60))
                        ),
                    )
                ]
            )
        elif kind == 3:
            s.act([read(rng.choice(files)), read(rng.choice(files))])
        elif kind == 4:
            s.act(
                [
                    run(
                        "pytest tests/test_reservations.py::test_concurrent_reserve -q",
                        _pytest_log(
                            rng, 0, conflict if rng.random() < 0.5 else None, "1 failed in 2.31s"
                        ),
                    )
                ],
                notes[step % len(notes)] if step < 18 else None,
            )
        else:
            s.act([grep("version", rng.randint(10, 40))])
        if step == 20:
            # The model answered with prose instead of a call: the agent complains.
            s.send()
            s.say("assistant", "I think the issue is in the locking, let me check it...")
            s.say(
                "user",
                "Tool call error: your reply could not be parsed. Please reply with "
                "exactly one tool call, in the format described in the system prompt.",
            )
    # 4. The fix, with a detour.
    fix = (
        "    with acquire_row_lock(session, sku_id, timeout_ms=LOCK_TIMEOUT_MS):\n"
        "        record = load_sku(session, sku_id, for_update=True)\n"
        "        compare_and_swap_version(session, record, expected=record.version)"
    )
    s.act(
        [
            (
                "edit_file",
                {
                    "path": "stockroom/reservations.py",
                    "old": "    record = load_sku(session, sku_id)",
                    "new": fix,
                },
                "Edited stockroom/reservations.py (1 replacement).",
            )
        ],
        "Moving the read and the compare-and-swap inside the row lock in reserve_stock().",
    )
    lock_timeout = (
        "E   stockroom.db.locks.LockTimeoutError: lock on sku rows [SKU-48213, SKU-51007] not "
        "acquired within 2500 ms\nE   raised at stockroom/db/locks.py:88 in acquire_row_lock"
    )
    s.act(
        [
            run(
                "pytest tests -q -x",
                _pytest_log(
                    rng, 190, lock_timeout, "========= 1 failed, 190 passed in 63.02s ========="
                ),
            )
        ]
    )
    for step in range(30):
        if step % 3 == 0:
            s.act([read(rng.choice(files)), grep("bulk_reserve", rng.randint(4, 12))])
        elif step % 3 == 1:
            s.act(
                [
                    run(
                        f"pytest tests/test_reservations.py -q -k bulk --count={rng.randint(2, 9)}",
                        _pytest_log(rng, rng.randint(5, 30), None, "passed"),
                    )
                ]
            )
        else:
            s.act(
                [
                    grep(
                        rng.choice(("LockTimeoutError", "sorted(", "EXPIRY_BATCH")),
                        rng.randint(2, 10),
                    )
                ]
            )
    s.act(
        [
            (
                "edit_file",
                {
                    "path": "stockroom/reservations.py",
                    "old": "    for sku_id in sku_ids:",
                    "new": "    for sku_id in sorted(sku_ids):  # one lock order: no deadlock",
                },
                "Edited stockroom/reservations.py (1 replacement).",
            )
        ],
        "bulk_reserve() takes the row locks in request order; two bulk orders deadlock until "
        "the 2500 ms LOCK_TIMEOUT_MS fires. Sorting the SKU ids gives one lock order.",
    )
    regression = _python_module(
        rng, "tests/test_reservations.py", ("test_last_unit_reserved_once",), 60
    )
    s.act(
        [
            (
                "write_file",
                {"path": "tests/test_reserve_race.py", "content": regression},
                "Wrote tests/test_reserve_race.py (60 lines).",
            )
        ],
        "Adding a regression test that races two reserve_stock() calls for SKU-48213.",
    )
    # 5. Verify: many runs, a huge `make check`, and answers that name early identifiers.
    check_log = _pytest_log(rng, 230, None, "=========== 421 passed in 71.40s ===========")
    lint = "\n".join(f"ruff: {rng.choice(files)}:{rng.randint(1, 300)}: ok" for _ in range(60))
    s.act([run("make check", lint + "\n" + check_log)])
    backrefs = [
        "The ReservationConflictError for SKU-48213 (expected version 17, found 18) from the "
        "first run no longer appears in 20 repeated runs.",
        "INC-20931 (https://status.stockroom.example/incidents/20931) matches this race: two "
        "reserve_stock() calls read version 17 before either wrote.",
        "LockTimeoutError at stockroom/db/locks.py:88 came from bulk_reserve() locking in "
        "request order; sorted ids fixed it without a longer LOCK_TIMEOUT_MS than 2500.",
        "RESERVATION_TTL_S = 900 in stockroom/settings.py is untouched; "
        "expire_reservations() in stockroom/jobs/expiry.py still runs every EXPIRY_BATCH.",
        "compare_and_swap_version() in stockroom/models/sku.py is now called under "
        "acquire_row_lock(); _next_version() is no longer used.",
    ]
    for step in range(92):
        kind = step % 5
        if kind == 0:
            s.act(
                [
                    run(
                        f"pytest tests -q -p no:randomly --count={rng.randint(2, 5)}",
                        _pytest_log(rng, rng.randint(20, 70), None, "passed"),
                    )
                ],
                backrefs[(step // 5) % len(backrefs)],
            )
        elif kind == 1:
            s.act([read(rng.choice(files)), grep("reserve", 8)])
        elif kind == 2:
            s.act(
                [
                    grep(
                        rng.choice(
                            (
                                "reserve_stock",
                                "acquire_row_lock",
                                "SKU-48213",
                                "compare_and_swap_version",
                            )
                        ),
                        rng.randint(2, 16),
                    )
                ],
                backrefs[step % len(backrefs)] if step > 40 else None,
            )
        elif kind == 3:
            s.act(
                [
                    run(
                        "git diff --stat",
                        "\n".join(
                            f" {f} | {rng.randint(1, 40)} {'+' * rng.randint(1, 20)}"
                            for f in ("stockroom/reservations.py", "tests/test_reserve_race.py")
                        ),
                    )
                ]
            )
        else:
            s.act([read(rng.choice(files))])
    s.act(
        [run("make check", lint + "\n" + _pytest_log(rng, 230, None, "421 passed in 69.8s"))],
        "Final `make check` before summarising.",
    )
    s.reply(
        "Done. Cause: reserve_stock() in stockroom/reservations.py read the SkuRecord and "
        "called compare_and_swap_version() outside acquire_row_lock(), so two orders could "
        "both see version 17 of SKU-48213 (the ReservationConflictError 'expected version 17, "
        "found 18', and INC-20931). Fix: the read and the swap now run under the row lock. "
        "bulk_reserve() now locks SKUs in sorted order, which also removed the LockTimeoutError "
        "at stockroom/db/locks.py:88 (LOCK_TIMEOUT_MS stays 2500). Regression test: "
        "tests/test_reserve_race.py::test_last_unit_reserved_once. `make check`: 421 passed."
    )
    s.say("user", "Thanks. Is bulk_reserve() any slower now?")
    s.send()
    return s.requests


# -- the support chat ----------------------------------------------------------------------

SUPPORT_SYSTEM = """\
You are the support assistant of Harbourline, an online shop for outdoor gear. Be brief and
friendly. Always look things up with the tools before answering; never guess an order's
state, a refund amount or a delivery date. Refunds: items may be returned within 30 days of
delivery; refunds go back to the original payment method within 5 business days; shipping is
refunded only for damaged or wrong items. Address changes are possible until an order ships.
Subscriptions (the Trailbox) can be paused or cancelled any time before the 25th for the next
month. Escalate to a human (create_ticket) for damaged items over 200 EUR, suspected fraud,
or when the customer asks for one. Never reveal another customer's data. Quote order numbers,
ticket numbers and amounts exactly as the tools return them."""

SUPPORT_TOOLS = [
    _tool("lookup_customer", "Find a customer by email.", email="Email address."),
    _tool("list_orders", "List a customer's orders.", customer_id="Customer id."),
    _tool("get_order", "Get one order with its items.", order_id="Order number."),
    _tool("track_shipment", "Carrier tracking events.", tracking_number="Tracking number."),
    _tool("get_invoice", "An order's invoice.", order_id="Order number."),
    _tool(
        "refund_order",
        "Refund items of an order.",
        order_id="Order number.",
        items="Comma-separated SKUs.",
        reason="Why.",
    ),
    _tool(
        "update_address",
        "Change an unshipped order's address.",
        order_id="Order number.",
        address="The new address.",
    ),
    _tool("search_kb", "Search help-centre articles.", query="Search words."),
    _tool(
        "create_ticket",
        "Escalate to a human agent.",
        summary="What happened.",
        priority="low, normal or high.",
    ),
    _tool("get_ticket", "A ticket's state.", ticket_id="Ticket number."),
    _tool("list_subscriptions", "A customer's subscriptions.", customer_id="Customer id."),
    _tool("pause_subscription", "Pause a subscription.", subscription_id="Id.", months="1-3."),
    _tool("apply_coupon", "Apply a goodwill coupon.", customer_id="Customer id.", amount="EUR."),
    _tool("check_stock", "Stock of a product in a size.", sku="SKU.", size="Size."),
]

_PRODUCTS = (
    ("HL-TENT-2P", "Fjordline 2-person tent", "189.90"),
    ("HL-BOOT-W41", "Scree hiking boots, women's", "149.90"),
    ("HL-JKT-M-L", "Squall rain jacket, men's", "129.00"),
    ("HL-BAG-65", "Ridgeway 65 L backpack", "219.00"),
    ("HL-STV-TI", "Titanium camp stove", "64.50"),
)


def _kb_article(rng: random.Random, title: str) -> str:
    return f"# {title}\n\n" + "\n\n".join(_paragraph(rng, rng.randint(5, 8)) for _ in range(11))


def support_chat(seed: int = SEED) -> list[Body]:
    s = Script("support-chat", seed, "gpt-4o-mini", SUPPORT_TOOLS)
    s.params = {"temperature": 0.3}
    rng = s.rng
    s.say("system", SUPPORT_SYSTEM)
    order = {
        "order_id": "HB-100482",
        "status": "delivered",
        "delivered": "2024-05-02",
        "items": [
            {"sku": sku, "name": name, "price_eur": price, "qty": 1}
            for sku, name, price in _PRODUCTS[:3]
        ],
        "total_eur": "468.80",
        "tracking_number": "1Z999AA10123456784",
        "payment": "Visa ending 4417",
    }
    history = [
        {
            "order_id": f"HB-{rng.randint(100000, 100400)}",
            "status": "delivered",
            "total_eur": f"{rng.randint(20, 300)}.{rng.randint(0, 99):02d}",
            "lines": [_sentence(rng, 10) for _ in range(5)],
        }
        for _ in range(18)
    ]

    def turn(ask: str, calls: list[tuple[str, dict[str, Any], str]], answer: str) -> None:
        s.say("user", ask)
        for call in calls:
            s.act([call])
        s.reply(answer)

    j = json.dumps
    turn(
        "Hi, my boots arrived with a torn seam. Email is mara.lind@example.org",
        [
            (
                "lookup_customer",
                {"email": "mara.lind@example.org"},
                j({"customer_id": "CUS-77310", "name": "Mara Lind", "since": "2021-03-14"}),
            ),
            ("list_orders", {"customer_id": "CUS-77310"}, j([order, *history])),
        ],
        "Sorry about that, Mara. I see order HB-100482 (delivered 2024-05-02) with the Scree "
        "hiking boots, women's (HL-BOOT-W41, 149.90 EUR). Is that the pair?",
    )
    turn(
        "Yes that one",
        [
            (
                "search_kb",
                {"query": "damaged item return"},
                _kb_article(rng, "Returning damaged items"),
            )
        ],
        "Damaged items can be refunded in full, shipping included, within 30 days of delivery. "
        "Would you like a refund or a replacement pair?",
    )
    turn(
        "Is there a replacement in size 41?",
        [
            (
                "check_stock",
                {"sku": "HL-BOOT-W41", "size": "41"},
                j({"sku": "HL-BOOT-W41", "size": "41", "in_stock": 0, "restock": None}),
            )
        ],
        "Size 41 is out of stock with no restock date yet, so a refund is the quicker way.",
    )
    turn(
        "OK refund then",
        [
            (
                "refund_order",
                {"order_id": "HB-100482", "items": "HL-BOOT-W41", "reason": "damaged: torn seam"},
                j(
                    {
                        "refund_id": "RF-30917",
                        "amount_eur": "149.90",
                        "shipping_refunded_eur": "4.95",
                        "eta_business_days": 5,
                    }
                ),
            )
        ],
        "Done: refund RF-30917 of 149.90 EUR plus 4.95 EUR shipping to your Visa ending 4417, "
        "within 5 business days.",
    )
    small_talk = [
        (
            "Also, my tent order hasn't moved in days",
            "track_shipment",
            {"tracking_number": "1Z999AA10123456784"},
            "",
        ),
        (
            "Can you search for how to seam-seal a tent?",
            "search_kb",
            {"query": "seam sealing tent"},
            j({"results": []}),
        ),
        (
            "What about my Trailbox subscription?",
            "list_subscriptions",
            {"customer_id": "CUS-77310"},
            j(
                [
                    {
                        "subscription_id": "SUB-2291",
                        "plan": "Trailbox",
                        "next_box": "2024-06-01",
                        "price_eur": "39.00",
                    }
                ]
            ),
        ),
        (
            "Pause it for two months please",
            "pause_subscription",
            {"subscription_id": "SUB-2291", "months": "2"},
            j({"paused_until": "2024-08-01"}),
        ),
        (
            "Do you have the invoice for HB-100482?",
            "get_invoice",
            {"order_id": "HB-100482"},
            j({"invoice": "INV-2024-18833", "lines": [_sentence(rng, 12) for _ in range(30)]}),
        ),
        (
            "Any guide on caring for rain jackets?",
            "search_kb",
            {"query": "rain jacket care"},
            _kb_article(rng, "Caring for waterproof jackets"),
        ),
        (
            "Is the Ridgeway 65 in stock in size M?",
            "check_stock",
            {"sku": "HL-BAG-65", "size": "M"},
            j({"in_stock": 12}),
        ),
        (
            "What's the status of any ticket I have open?",
            "get_ticket",
            {"ticket_id": "latest"},
            j({"tickets": []}),
        ),
        (
            "Can I get something for the trouble?",
            "apply_coupon",
            {"customer_id": "CUS-77310", "amount": "10"},
            j({"coupon": "SORRY-10-QX4", "eur": 10}),
        ),
        (
            "Search the help centre for 'warranty stove'",
            "search_kb",
            {"query": "warranty stove"},
            j({"results": []}),
        ),
        (
            "What's your returns address?",
            "search_kb",
            {"query": "returns address"},
            _kb_article(rng, "Where to send returns"),
        ),
        (
            "Do I have other orders in transit?",
            "list_orders",
            {"customer_id": "CUS-77310"},
            j([order, *history]),
        ),
        (
            "Look up my husband's account, erik.lind@example.org",
            "lookup_customer",
            {"email": "erik.lind@example.org"},
            j({"customer_id": None}),
        ),
        (
            "Check stove stock, titanium one",
            "check_stock",
            {"sku": "HL-STV-TI", "size": "one"},
            j({"in_stock": 0, "restock": "2024-06-20"}),
        ),
        (
            "Any article on sizing boots?",
            "search_kb",
            {"query": "boot sizing"},
            _kb_article(rng, "Finding your boot size"),
        ),
    ]
    for ask, tool, args, output in small_talk:
        answer = (
            "I looked that up: nothing came back."
            if output in ("", j({"results": []}), j({"tickets": []}))
            else f"Here is what I found: {_sentence(rng, 14)}"
        )
        turn(ask, [(tool, args, output)], answer)
    turn(
        "The tracking still shows nothing. Can a human look at it?",
        [
            ("track_shipment", {"tracking_number": "1Z999AA10123456784"}, ""),
            (
                "create_ticket",
                {
                    "summary": "Tent order: tracking 1Z999AA10123456784 shows no "
                    "events; customer CUS-77310",
                    "priority": "normal",
                },
                j({"ticket_id": "T-55120", "queue": "logistics"}),
            ),
        ],
        "I opened ticket T-55120 with our logistics team for tracking 1Z999AA10123456784.",
    )
    for i in range(14):
        ask = rng.choice(
            (
                "Thanks",
                "ok",
                "And how long does that take?",
                "Sure",
                "Can you check again?",
                "Great, one more thing",
            )
        )
        if i % 3 == 0:
            turn(
                ask,
                [
                    (
                        "get_ticket",
                        {"ticket_id": "T-55120"},
                        j({"ticket_id": "T-55120", "state": "open", "updates": []}),
                    )
                ],
                "Ticket T-55120 is still open with logistics; no update yet.",
            )
        elif i % 3 == 1:
            turn(
                ask,
                [
                    (
                        "search_kb",
                        {"query": rng.choice(("delivery times", "carrier delays"))},
                        _kb_article(rng, "Delivery times"),
                    )
                ],
                f"Usually 2-4 business days. {_sentence(rng, 10)}",
            )
        else:
            turn(ask, [], "Happy to help with anything else.")
    turn(
        "Before I go: how much is coming back to me in total, and to which card?",
        [("get_order", {"order_id": "HB-100482"}, j(order))],
        "Refund RF-30917: 149.90 EUR for the HL-BOOT-W41 boots plus 4.95 EUR shipping, so "
        "154.85 EUR to the Visa ending 4417, within 5 business days. You also have coupon "
        "SORRY-10-QX4 (10 EUR), SUB-2291 is paused until 2024-08-01, and ticket T-55120 "
        "covers the tent tracking 1Z999AA10123456784.",
    )
    s.say("user", "Perfect, and the coupon code again?")
    s.send()
    return s.requests


# -- the research agent --------------------------------------------------------------------

RESEARCH_SYSTEM = """\
You are a research assistant. Use web_search to find sources and fetch_page to read them;
save_note keeps short notes for later. Prefer primary sources (reports, datasets, official
statistics) over news coverage. Every number in your answer must name the page it came from
(its URL). When sources disagree, say so and give both figures."""

RESEARCH_TASK = """\
How did the Norrvik congestion charge (introduced in 2019) change car traffic, air quality
and city-centre retail revenue? I need a short brief with numbers and sources, including
anything that contradicts the city's own figures."""

RESEARCH_TOOLS = [
    _tool("web_search", "Search the web.", query="Search words."),
    _tool("fetch_page", "Fetch a web page as text.", url="The URL."),
    _tool("save_note", "Keep a short note for later.", text="The note."),
]

_FACTS = (
    (
        "https://norrvik.example.gov/reports/congestion-2020.pdf",
        "Car trips across the charging cordon fell by 18.4 percent in the first twelve months, "
        "from 412,600 to 336,700 on an average weekday.",
    ),
    (
        "https://air.norrvik.example.gov/stations/kvarngatan",
        "Annual mean nitrogen dioxide at the Kvarngatan station fell from 41.2 to 33.9 "
        "micrograms per cubic metre between 2018 and 2020.",
    ),
    (
        "https://www.norrvik-chamber.example.org/retail-index-2020",
        "The chamber of commerce measured city-centre retail revenue up 2.1 percent in 2020, "
        "against 3.4 percent for the region.",
    ),
    (
        "https://journals.example.net/transport-policy/2021/norrvik-cordon",
        "A peer-reviewed study estimates the traffic effect at 14.9 percent once the 2020 "
        "pandemic months are excluded, below the city's 18.4 percent.",
    ),
    (
        "https://news.example.com/2019/06/norrvik-charge-starts",
        "The charge started on 3 June 2019 at 2.50 EUR per crossing, 4.00 EUR at peak hours, "
        "with a daily cap of 12 EUR.",
    ),
)


def _web_page(rng: random.Random, url: str, fact: str | None, paragraphs: int) -> str:
    nav = " | ".join(
        rng.choice(
            ("Home", "News", "About", "Contact", "Data", "Topics", "Subscribe", "Search", "Archive")
        )
        for _ in range(8)
    )
    parts = [f"URL: {url}", nav, "We use cookies to improve your experience. Accept all | Settings"]
    parts.append(f"# {_sentence(rng, 8)[:-1]}")
    for i in range(paragraphs):
        parts.append(_paragraph(rng, rng.randint(4, 8)))
        if fact is not None and i == paragraphs // 3:
            parts.append(fact)
        if i % 4 == 3:
            parts.append(
                f"Related: https://{url.split('/')[2]}/{rng.choice(_WORDS)}-"
                f"{rng.randint(1000, 9999)}"
            )
    parts.append("(c) 2021 " + url.split("/")[2] + " | Privacy | Terms | Accessibility")
    return "\n\n".join(parts)


def research_agent(seed: int = SEED) -> list[Body]:
    s = Script("research-agent", seed, "gpt-4.1-mini", RESEARCH_TOOLS)
    s.params = {"temperature": 0.1, "max_tokens": 4000}
    rng = s.rng
    s.say("system", RESEARCH_SYSTEM)
    s.say("user", RESEARCH_TASK)

    def results(query: str, urls: list[str]) -> str:
        return json.dumps(
            {
                "query": query,
                "results": [
                    {"url": u, "title": _sentence(rng, 7)[:-1], "snippet": _sentence(rng, 22)}
                    for u in urls
                ],
            }
        )

    fact_urls = [url for url, _ in _FACTS]
    s.act(
        [
            (
                "web_search",
                {"query": "Norrvik congestion charge evaluation traffic"},
                results("Norrvik congestion charge evaluation traffic", fact_urls[:3]),
            )
        ],
        "Starting with the city's own evaluation and the air-quality data.",
    )
    for url, fact in _FACTS:
        s.act([("fetch_page", {"url": url}, _web_page(rng, url, fact, rng.randint(26, 40)))])
        s.act([("save_note", {"text": f"{fact} ({url})"}, "saved")])
    others = [
        f"https://{rng.choice(('blog', 'www', 'news', 'data'))}.example-{i}.org/"
        f"{rng.choice(_WORDS)}/{rng.randint(100, 999)}"
        for i in range(23)
    ]
    for i, url in enumerate(others):
        if i % 4 == 0:
            s.act(
                [
                    (
                        "web_search",
                        {"query": f"Norrvik cordon {rng.choice(_WORDS)} {2019 + i % 4}"},
                        results("Norrvik", others[i : i + 4]),
                    )
                ]
            )
        s.act([("fetch_page", {"url": url}, _web_page(rng, url, None, rng.randint(22, 36)))])
        if i % 5 == 2:
            back = _FACTS[i % len(_FACTS)]
            s.act(
                [
                    (
                        "save_note",
                        {"text": f"Nothing new versus {back[0]}; {back[1].split(',')[0]}."},
                        "saved",
                    )
                ]
            )
    s.reply(
        "Draft brief:\n- Traffic: -18.4% across the cordon in year one, 412,600 to 336,700 "
        "weekday trips (https://norrvik.example.gov/reports/congestion-2020.pdf); a "
        "peer-reviewed study puts it at -14.9% without the pandemic months "
        "(https://journals.example.net/transport-policy/2021/norrvik-cordon).\n- Air: NO2 at "
        "Kvarngatan 41.2 -> 33.9 ug/m3, 2018-2020 (https://air.norrvik.example.gov/stations/"
        "kvarngatan).\n- Charge: 2.50 EUR, 4.00 EUR peak, 12 EUR daily cap from 3 June 2019."
    )
    s.say("user", "Good. Add the retail numbers and say whether they contradict the city.")
    s.act(
        [
            (
                "web_search",
                {"query": "Norrvik city centre retail 2020 chamber"},
                results("Norrvik retail", fact_urls[2:3] + others[:2]),
            )
        ]
    )
    s.act([("fetch_page", {"url": others[3]}, _web_page(rng, others[3], None, 30))])
    s.reply(
        "Retail: city-centre revenue +2.1% in 2020 versus +3.4% regionally "
        "(https://www.norrvik-chamber.example.org/retail-index-2020), so the centre grew but "
        "lagged the region. The city's -18.4% traffic figure is contested by the -14.9% "
        "estimate; the 41.2 -> 33.9 NO2 drop at Kvarngatan is not disputed."
    )
    s.say("user", "Which of these numbers would you trust least, and why?")
    s.send()
    return s.requests


# -- writing -------------------------------------------------------------------------------

SESSIONS: dict[str, Callable[[int], list[Body]]] = {
    "coding-agent": coding_agent,
    "support-chat": support_chat,
    "research-agent": research_agent,
}


def lines_of(requests: list[Body]) -> Iterator[bytes]:
    for body in requests:
        yield json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def write(name: str, out: Path, seed: int = SEED) -> Path:
    """`out/<name>.jsonl.xz`: xz finds each line in the one before it, so a session of
    ~40 MB of JSON Lines (the history resent every turn) takes well under 1 MB."""
    path = out / f"{name}.jsonl.xz"
    with lzma.open(path, "wb", preset=6) as file:
        file.writelines(lines_of(SESSIONS[name](seed)))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the sample sessions.")
    parser.add_argument("--out", default="sessions", help="folder (default: sessions)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("names", nargs="*", default=list(SESSIONS), help="which sessions")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        path = write(name, out, args.seed)
        print(f"{path} ({path.stat().st_size:,} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
