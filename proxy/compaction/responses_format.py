"""The Responses API adapter: how the compaction core reads and writes `input` items.

Each item's entry (proxy/compaction/conversation.py):

- `message` (or an item with a `role` and no `type`): its role. A user message is `context`
  (never the task, never an ask) when its text opens with a block an agent injects for the
  model's benefit: Codex's `<environment_context>`, `<user_instructions>`, `# AGENTS.md
  instructions`, ..., or Codex's own summary after it compacted by itself. A user message
  matching `compaction.injected_user_patterns` is not an ask (as for chat).
- a call: `function_call`, `custom_tool_call`, `local_shell_call` and any other `*_call`
  with a `call_id` makes that call; every `*_output` (`function_call_output`,
  `custom_tool_call_output`, `local_shell_call_output`, ...) with a `call_id` answers it, so
  the cut keeps them together. `mcp_approval_request` / `mcp_approval_response` pair by
  `approval_request_id` the same way. A `*_call` without `call_id` (a hosted tool's call,
  which carries its own result) is an assistant item.
- `reasoning`: `drop`, kept whole in the tail and never shown to a summarizer; the seam
  keeps it on the same side of any cut as the item after it (the output it led to).
- `compaction` (OpenAI's encrypted compaction item), `item_reference` (an item stored
  upstream) and any type this adapter does not know: barriers, kept verbatim in place with
  everything before them; only what follows the last one is ever compacted.
- `additional_tools` (tools sent as an input item): a pinned developer item and a barrier,
  counted as tools.

Masking replaces an output's `output` when it is text (a string, or content parts); other
outputs (a computer screenshot, an approval) are never masked.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

from proxy.compaction.chat_format import ChatFormat
from proxy.compaction.conversation import Entry
from proxy.compaction.render import content_text
from proxy.report import Message

# User messages that carry context an agent injects, not something the user asked.
CONTEXT_PREFIXES = (
    "<environment_context>",
    "<user_instructions>",
    "# AGENTS.md instructions",
    "<user_shell_command>",
    "<turn_aborted>",
    "<subagent_notification>",
    "<skill>",
    # Codex's summary message after it compacted the conversation itself.
    "Another language model started to solve this problem",
)
_PREFIX_CHARS = max(map(len, CONTEXT_PREFIXES))
BARRIERS = frozenset({"compaction", "item_reference"})
_REASONING = Entry("reasoning", span="drop")
_UNKNOWN = Entry("unknown", span="barrier")


class ResponsesFormat:
    """The Responses adapter. One per process (its chat adapter remembers which texts
    matched the injected patterns)."""

    def __init__(self, injected: tuple[str, ...] = ()) -> None:
        self.chat = ChatFormat(injected)

    @cached_property
    def key(self) -> str:
        return json.dumps(["responses", *self.chat.injected])

    def entry(self, item: Message) -> Entry:
        if not isinstance(item, dict):
            return _UNKNOWN
        kind = item.get("type")
        if kind is None or kind == "message":
            return self._message(item)
        if not isinstance(kind, str):
            return _UNKNOWN
        if kind == "reasoning":
            return _REASONING
        if kind == "additional_tools":
            return Entry("developer", span="barrier")
        if kind in BARRIERS:
            return Entry(kind, span="barrier")
        call_id = item.get("call_id")
        if kind.endswith("_output"):
            if isinstance(call_id, str) and call_id:
                return Entry("tool", result_of=call_id)
            return Entry(kind, span="barrier")  # an output we cannot pair: kept in place
        if kind.endswith("_call"):
            if isinstance(call_id, str) and call_id:
                return Entry("assistant", calls=(call_id,))
            return Entry("assistant")  # a hosted tool's call, its result inside it
        if kind == "mcp_approval_request":
            request_id = item.get("id")
            return Entry("assistant", calls=(request_id if isinstance(request_id, str) else "",))
        if kind == "mcp_approval_response":
            answered = item.get("approval_request_id")
            return Entry("tool", result_of=answered if isinstance(answered, str) else "")
        if kind == "mcp_list_tools":
            return Entry("assistant")
        return _UNKNOWN

    def _message(self, item: Message) -> Entry:
        role = item.get("role")
        if not isinstance(role, str) or not role:
            return _UNKNOWN
        if role != "user":
            return Entry(role)
        if is_context(item):
            return Entry(role, context=True)
        return Entry(role, ask=not self.chat.is_injected(item))

    def masked(self, item: Message, stub: str) -> Message:
        return {**item, "output": stub}

    def output_chars(self, item: Message) -> int:
        output = item.get("output")
        if isinstance(output, str):
            return len(output)
        if isinstance(output, list):
            return len(content_text(output))
        return 0  # not text: never masked

    def call_of(self, item: Message, call_id: str, index: int) -> tuple[str, str]:
        kind = item.get("type")
        name = item.get("name")
        if kind == "local_shell_call":
            action = item.get("action")
            command = action.get("command") if isinstance(action, dict) else None
            if isinstance(command, list):
                return "local_shell", " ".join(str(part) for part in command)
            return "local_shell", _json(action)
        arguments = item.get("arguments", item.get("input"))
        if not isinstance(arguments, str):
            arguments = "" if arguments is None else _json(arguments)
        if not isinstance(name, str) or not name:
            name = kind if isinstance(kind, str) else "?"
        return name, arguments


def is_context(item: Message) -> bool:
    """A user message whose text opens with a block an agent injects (see the module doc)."""
    content = item.get("content")
    if isinstance(content, str):
        head = content.lstrip()[:_PREFIX_CHARS]
    elif isinstance(content, list) and content:
        first = content[0]
        text = first.get("text") if isinstance(first, dict) else first
        head = text.lstrip()[:_PREFIX_CHARS] if isinstance(text, str) else ""
    else:
        return False
    return head.startswith(CONTEXT_PREFIXES)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        return str(value)
