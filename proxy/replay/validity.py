"""Would a provider accept this history? The checks a compaction can break.

OpenAI answers 400 (and the agent's session is wedged) when a `tool` message does not answer
a call of the assistant message right before its run of tool messages, when a call is left
unanswered before the next other message, or when a role is unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def problem(messages: Sequence[Any]) -> str | None:
    """The first reason the history is invalid, or None."""
    if not messages:
        return "no messages"
    open_calls: set[str] = set()  # calls of the last assistant message not yet answered
    in_tool_run = False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} is not an object"
        role = message.get("role")
        if role not in ROLES:
            return f"message {index} has role {role!r}"
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not in_tool_run or call_id not in open_calls:
                return f"message {index}: tool result {call_id!r} answers no call before it"
            open_calls.discard(call_id)
            continue
        if open_calls:
            return f"message {index}: calls {sorted(open_calls)} left unanswered"
        in_tool_run = False
        if role == "assistant":
            ids = [
                call.get("id") for call in message.get("tool_calls") or () if isinstance(call, dict)
            ]
            if ids:
                open_calls = {i for i in ids if isinstance(i, str)}
                in_tool_run = True
    if open_calls:
        return f"the request ends with calls {sorted(open_calls)} unanswered"
    return None
