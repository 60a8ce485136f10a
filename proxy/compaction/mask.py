"""Observation masking: old tool outputs give way to a one-line stub; no LLM call.

Tool results (`tool` messages, legacy `function` messages) older than the last `keep_last`
are replaced by a stub that names the tool, its arguments (abbreviated) and the size of
what it returned; every other message is kept as it is (the request path forwards the
client's own bytes for them), so tool pairs are intact by construction.

Masking advances in steps: the results that may be masked (older than the last
`keep_last`, their tool not in `exclude_tools`, their output longer than its stub) are
grouped oldest first into steps that each clear at least `clear_at_least` tokens, and only
whole steps are masked. The steps are a function of the history's prefix alone, so the
same history always gives the same bytes, and between two steps every turn forwards the
previous turn's request plus its new messages: the upstream's prompt cache keeps working,
with no store. When a step is taken, the prompt is new only from the first newly masked
result on, which is recent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.compaction.chat_format import ChatFormat
from proxy.compaction.conversation import Described, Format, describe
from proxy.compaction.protocol import LLM, fingerprint_of
from proxy.report import Message

# A stub's arguments are cut to this many characters.
ARGUMENT_CHARS = 80
STUB = "[tool output cleared to save context: {call} returned {size:,} characters]"
STUB_VERSION = "v1"

CountRange = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True)
class MaskOptions:
    """`compaction.mask`: see the module docstring."""

    keep_last: int = 5
    clear_at_least: int = 4000
    exclude_tools: tuple[str, ...] = ()


class MaskCompaction:
    """The `mask` strategy (a `Compaction`: `compact(messages, llm)`, which it never calls)."""

    name = "mask"

    def __init__(self, options: MaskOptions | None = None, format: Format | None = None) -> None:
        self.options = options or MaskOptions()
        self.format = format or ChatFormat()

    @property
    def fingerprint(self) -> str:
        options = self.options
        return fingerprint_of(
            strategy=self.name,
            stub=STUB_VERSION,
            keep_last=options.keep_last,
            clear_at_least=options.clear_at_least,
            exclude=sorted(options.exclude_tools),
        )

    async def compact(self, messages: list[Message], llm: LLM | None = None) -> list[Message]:
        """Mask `messages` on their own, tokens estimated at 4 characters each."""
        described = describe(self.format, messages)

        def estimate(start: int, end: int) -> list[int]:
            return [self.format.output_chars(m) // 4 + 4 for m in messages[start:end]]

        return self.mask(messages, described, estimate)[0]

    def mask(
        self, messages: list[Message], described: Described, count: CountRange
    ) -> tuple[list[Message], int]:
        """(the history with whole steps masked, how many results were masked)."""
        options = self.options
        results = [i for i, entry in enumerate(described.entries) if entry.result_of is not None]
        if options.exclude_tools:
            excluded = set(options.exclude_tools)
            results = [i for i in results if self._tool(messages, described, i)[0] not in excluded]
        older = results[: max(0, len(results) - options.keep_last)]
        if not older:
            return messages, 0
        counts = count(0, len(messages))
        stubs: dict[int, str] = {}
        masked: list[int] = []
        step: list[int] = []
        cleared = 0
        for index in older:
            stub = self.stub(messages, described, index)
            if len(stub) >= self.format.output_chars(messages[index]):
                continue  # no smaller than the output: never masked
            stubs[index] = stub
            step.append(index)
            cleared += counts[index] - (len(stub) // 3 + 4)
            if cleared >= options.clear_at_least:
                masked += step
                step, cleared = [], 0
        if not masked:
            return messages, 0
        result = list(messages)
        for index in masked:
            result[index] = self.format.masked(messages[index], stubs[index])
        return result, len(masked)

    def stub(self, messages: list[Message], described: Described, index: int) -> str:
        name, arguments = self._tool(messages, described, index)
        if len(arguments) > ARGUMENT_CHARS:
            arguments = arguments[: ARGUMENT_CHARS - 3] + "..."
        size = self.format.output_chars(messages[index])
        return STUB.format(call=f"{name}({arguments})", size=size)

    def _tool(self, messages: list[Message], described: Described, index: int) -> tuple[str, str]:
        """(name, arguments) of the call the result at `index` answers."""
        message = messages[index]
        own = message.get("name") if isinstance(message, dict) else None
        call = described.call_of[index]
        if call < 0:
            return (own if isinstance(own, str) and own else "?"), ""
        entry = described.entries[index]
        name, arguments = self.format.call_of(
            messages[call], entry.result_of or "", described.result_index[index]
        )
        if name == "?" and isinstance(own, str) and own:
            name = own
        return name, arguments
