"""The chat-completions adapter: how the compaction core reads and writes chat messages.

A message's entry (proxy/compaction/conversation.py): its `role`; the ids of its
`tool_calls` (a legacy `function_call` is a call without id); the `tool_call_id` a `tool`
message answers (a legacy `function` message answers by position); and whether a user
message is a real ask, not one an agent injects itself when it cannot parse the model's
reply ("Tool call error: reply with exactly one tool call"): those match
`compaction.injected_user_patterns` and are summarized like tool output.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from typing import Any

from proxy.compaction.conversation import Entry
from proxy.compaction.render import content_text
from proxy.report import Message

# Messages agents inject themselves when they cannot parse the model's reply.
DEFAULT_INJECTED = (
    r"(?i)^\s*tool call error\b",
    r"(?i)\breply with exactly one tool call\b",
    r"(?i)^\s*your (last |previous )?(reply|response|output|message) (was|is) not "
    r"(correctly |properly )?(formatted|valid|parseable)",
)
# Only the start of a user message is matched against the injected patterns.
_MATCH_CHARS = 400
_SEEN_TEXTS = 4096  # answers remembered by text (~2 MB at most)
_UNKNOWN = Entry("unknown")


class ChatFormat:
    """The chat adapter. One per process (it remembers which texts matched the patterns:
    an agent's history asks about the same user messages every turn)."""

    def __init__(self, injected: tuple[str, ...] = ()) -> None:
        self.injected = injected
        self._seen: dict[str, bool] = {}

    @cached_property
    def key(self) -> str:
        return json.dumps(["chat", *self.injected])

    @cached_property
    def _patterns(self) -> list[re.Pattern[str]]:
        return [re.compile(p) for p in self.injected]

    def is_injected(self, message: Message) -> bool:
        if not self.injected:
            return False
        content = message.get("content")
        if isinstance(content, str):  # what content_text would give, without copying it all
            head = content[:_MATCH_CHARS] if content.strip() else ""
        else:
            head = content_text(content)[:_MATCH_CHARS]
        seen = self._seen.get(head)
        if seen is None:
            if len(self._seen) >= _SEEN_TEXTS:  # texts are client input
                self._seen.clear()
            seen = self._seen[head] = any(p.search(head) for p in self._patterns)
        return seen

    def entry(self, message: Message) -> Entry:
        if not isinstance(message, dict):
            return _UNKNOWN
        role = message.get("role")
        if not isinstance(role, str) or not role:
            role = "unknown"
        calls: tuple[str, ...] = ()
        tool_calls = message.get("tool_calls")
        if tool_calls and isinstance(tool_calls, list):
            calls = tuple(_call_id(call) for call in tool_calls)
        if isinstance(message.get("function_call"), dict):
            calls = (*calls, "")
        result_of: str | None = None
        if role == "tool":
            call_id = message.get("tool_call_id")
            result_of = call_id if isinstance(call_id, str) else ""
        elif role == "function":
            result_of = ""
        if role == "user":
            return Entry(role, calls, result_of, ask=not self.is_injected(message))
        if not calls and result_of is None:
            return Entry(role)
        return Entry(role, calls, result_of)

    def masked(self, message: Message, stub: str) -> Message:
        return {**message, "content": stub}

    def output_chars(self, message: Message) -> int:
        content = message.get("content")
        if isinstance(content, str):
            return len(content)
        return len(content_text(content))

    def call_of(self, message: Message, call_id: str, index: int) -> tuple[str, str]:
        calls = message.get("tool_calls")
        functions: list[Any] = []
        if isinstance(calls, list):
            if call_id:
                functions = [
                    c.get("function")
                    for c in calls
                    if isinstance(c, dict) and c.get("id") == call_id
                ]
            elif index < len(calls) and isinstance(calls[index], dict):
                functions = [calls[index].get("function")]
        legacy = message.get("function_call")
        if not functions and isinstance(legacy, dict):
            functions = [legacy]
        function = functions[-1] if functions and isinstance(functions[-1], dict) else {}
        name = function.get("name")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = "" if arguments is None else json.dumps(arguments, default=str)
        return (name if isinstance(name, str) and name else "?"), arguments


def _call_id(call: Any) -> str:
    call_id = call.get("id") if isinstance(call, dict) else None
    return call_id if isinstance(call_id, str) else ""
