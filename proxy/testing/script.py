"""What a test scripts the fake upstream to answer (proxy/testing/fake_openai.py): a reply's
text and tool calls, an HTTP error, a stream that breaks off. Plain values, shared by the
chat and the Responses API fakes."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_REPLY = "Hello from the fake upstream."


@dataclass(frozen=True)
class ToolCall:
    """A function call the assistant makes; `arguments` as a dict (sent as JSON) or a string."""

    name: str
    arguments: Mapping[str, Any] | str = field(default_factory=dict)
    id: str | None = None

    def arguments_json(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(dict(self.arguments))


@dataclass(frozen=True)
class Reply:
    """An assistant reply: text and/or tool calls, after an optional delay."""

    content: str | None = None
    tool_calls: Sequence[ToolCall] = ()
    finish_reason: str | None = None  # default: "tool_calls" with tool calls, else "stop"
    delay_s: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)
    usage: Mapping[str, Any] | None = None  # reported as given; default: counted
    # On the Responses API: a `reasoning` item (with `encrypted_content`) before the output.
    reasoning: str | None = None


@dataclass(frozen=True)
class Error:
    """An HTTP error reply; `body` defaults to an OpenAI-style error envelope."""

    status: int = 500
    body: Any = None
    message: str = "The fake upstream was told to fail."
    delay_s: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)

    def json_body(self) -> Any:
        if self.body is not None:
            return self.body
        code = "rate_limit_exceeded" if self.status == 429 else "fake_error"
        return {
            "error": {"message": self.message, "type": "server_error", "param": None, "code": code}
        }


@dataclass(frozen=True)
class BrokenStream:
    """A 200 whose body breaks off: after `after_chunks` SSE events, or half-way for JSON."""

    reply: Reply | str = DEFAULT_REPLY
    after_chunks: int = 1


Item = str | Reply | ToolCall | Error | BrokenStream
