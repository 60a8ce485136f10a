"""The Responses API's formula: what `instructions`, `tools` and each `input` item cost.

Counted as the chat formula counts the same content (proxy/tokens/chat.py), item by item:

- a `message` item: 3 tokens of framing, its role and its content (string or parts:
  `input_text` / `output_text` texts, `input_image` and `input_file` as the chat formula
  prices images and files);
- a call (`function_call`, `custom_tool_call`, `local_shell_call`, any `*_call`): framing,
  `TOOL_CALL_OVERHEAD`, its name and arguments (a custom tool's `input`, a shell call's
  `action`); a call's output (`*_output`): framing and the output (a string, content
  parts, or any other value by its strings);
- an `additional_tools` item (tools sent as an input item): its tools, as `tools` are;
- `instructions`: framing and its text (or its items, when it is a list of them);
- `tools`: as the chat formula counts definitions (the flat Responses style included);
- ids, `type`, `status` and `call_id` are not counted: the model does not read them.

What cannot be read is estimated, and the request's count says so (`estimated`): the
`encrypted_content` of `reasoning` items and of OpenAI `compaction` items counts one token
per 4 bytes of what it decodes to (3/4 of its base64 length), the rate used for any text
counted without a tokenizer; an `item_reference` (an item stored upstream) counts its
framing only. Readable parts of a reasoning item (its `summary` and `content` texts) are
counted as texts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from proxy.settings import Settings
from proxy.tokens import chat
from proxy.tokens.chat import TOKENS_PER_MESSAGE, TOOL_CALL_OVERHEAD, Media, content_tokens
from proxy.tokens.counter import OFFLOAD_MESSAGES, TooManyTokens
from proxy.tokens.images import GPT_4O, GPT_4O_MINI
from proxy.tokens.memo import Memo, content_key
from proxy.tokens.models import is_gpt_4o_mini
from proxy.tokens.tools import CL100K_TOOLS, O200K_TOOLS, tools_tokens

TextCount = Callable[[str], int]

# Bytes of decoded ciphertext per estimated token (the tokenizer-less rate for texts).
OPAQUE_BYTES_PER_TOKEN = 4
_SKIPPED = frozenset({"id", "type", "status", "call_id"})
_OPAQUE = frozenset({"reasoning", "compaction", "item_reference"})
_SALT = hash("responses item")


class TextCounter(Protocol):
    """What this counter needs from the proxy's token counter (proxy.tokens.TokenCounter)."""

    @property
    def estimated(self) -> bool: ...

    def count_text(self, model: str, text: str) -> int: ...

    def profile_key(self, model: str) -> str: ...


def opaque_tokens(encrypted: object) -> int:
    """The documented estimate for encrypted content (see the module docstring)."""
    if not isinstance(encrypted, str) or not encrypted:
        return 0
    decoded = len(encrypted) * 3 // 4
    return (decoded + OPAQUE_BYTES_PER_TOKEN - 1) // OPAQUE_BYTES_PER_TOKEN


def has_opaque(items: object) -> bool:
    """Whether counting `items` estimates something (encrypted content, a stored item)."""
    if not isinstance(items, list):
        return False
    for item in items:
        if type(item) is dict and item.get("type") in _OPAQUE:
            kind = item["type"]
            if kind == "item_reference" or item.get("encrypted_content"):
                return True
    return False


def item_tokens(item: object, text: TextCount, media: Media) -> int:
    """One `input` item (see the module docstring)."""
    if not isinstance(item, dict):
        return TOKENS_PER_MESSAGE + chat.strings(item, text)
    kind = item.get("type")
    if kind is None or kind == "message":
        total = TOKENS_PER_MESSAGE
        role = item.get("role")
        if isinstance(role, str):
            total += text(role)
        return total + content_tokens(item.get("content"), text, media)
    if not isinstance(kind, str):
        return TOKENS_PER_MESSAGE + _strings(item, text)
    if kind == "reasoning":
        return (
            TOKENS_PER_MESSAGE
            + chat.strings(item.get("summary"), text)
            + chat.strings(item.get("content"), text)
            + opaque_tokens(item.get("encrypted_content"))
        )
    if kind == "compaction":
        return TOKENS_PER_MESSAGE + opaque_tokens(item.get("encrypted_content"))
    if kind == "item_reference":
        return TOKENS_PER_MESSAGE
    if kind == "additional_tools":
        tools = item.get("tools")
        defs = tools if isinstance(tools, list) else []
        costs = O200K_TOOLS  # the formula's constants; the encoding's own are close
        return TOKENS_PER_MESSAGE + tools_tokens(defs, text, costs)
    if kind.endswith("_output") or kind == "mcp_approval_response":
        output = item.get("output")
        if isinstance(output, str | list):
            return TOKENS_PER_MESSAGE + content_tokens(output, text, media)
        return TOKENS_PER_MESSAGE + _strings(item, text)
    if kind.endswith("_call"):
        return TOKENS_PER_MESSAGE + TOOL_CALL_OVERHEAD + _strings(item, text)
    return TOKENS_PER_MESSAGE + _strings(item, text)


def _strings(item: dict[str, Any], text: TextCount) -> int:
    """The strings of an item's fields the model reads (not its ids, type or status)."""
    return sum(chat.strings(value, text) for key, value in item.items() if key not in _SKIPPED)


def instructions_tokens(instructions: object, text: TextCount, media: Media) -> int:
    if isinstance(instructions, str):
        return TOKENS_PER_MESSAGE + text(instructions) if instructions else 0
    if isinstance(instructions, list):
        return sum(item_tokens(item, text, media) for item in instructions)
    return 0


def _model_and_items(body: object) -> tuple[str, list[Any]]:
    """A request's model and its `input` as items (a string is one user message)."""
    if not isinstance(body, dict):
        return "", []
    model = body.get("model")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list):
        items = []
    return (model if isinstance(model, str) else ""), items


class ResponsesCounter:
    """Counts Responses API requests with the proxy's token counter's texts (and its memo for
    long texts); each item's count is kept in a memo of its own, by the item's byte key when
    the request path knows it (proxy.jsonspans) or its content's. A `PromptCounter` for the
    compaction step (proxy/compactor.py)."""

    def __init__(self, counter: TextCounter, settings: Settings) -> None:
        self.counter = counter
        self._limit = settings.tokenizer.max_request_tokens
        self._remote_images = settings.tokenizer.remote_image_tokens
        self._memo = Memo(max(2, settings.tokenizer.memo_max_entries // 4))
        self._media: dict[str, Media] = {}

    # -- what the compaction step asks -------------------------------------------------------

    @property
    def estimated(self) -> bool:
        return self.counter.estimated

    def profile_key(self, model: str) -> str:
        return "responses:" + self.counter.profile_key(model)

    def count_text(self, model: str, text: str) -> int:
        return self.counter.count_text(model, text)

    def count_message(self, model: str, message: Any, key: int | None = None) -> int:
        return self.count_each(model, [message], None if key is None else [key])[0]

    def count_each(
        self, model: str, messages: Sequence[Any], keys: Sequence[int | None] | None = None
    ) -> list[int]:
        salted = self._salted(model, messages, keys)
        found = self._memo.get_many(salted)
        if None not in found:
            return found  # type: ignore[return-value]
        text, media = self._text(model), self._media_for(model)
        counts: list[int] = []
        for item, key, count in zip(messages, salted, found, strict=True):
            if count is None:
                count = item_tokens(item, text, media)
                if key is not None:
                    self._memo.put(key, count)
            counts.append(count)
        return counts

    async def acount_each(
        self,
        model: str,
        messages: Sequence[Any],
        keys: Sequence[int | None] | None = None,
        *,
        counted: int = 0,
    ) -> list[int]:
        """`count_each`, in a worker thread for long lists; TooManyTokens once reply priming,
        `counted` and these pass `tokenizer.max_request_tokens`."""
        if len(messages) > OFFLOAD_MESSAGES:
            counts = await asyncio.to_thread(self.count_each, model, messages, keys)
        else:
            counts = self.count_each(model, messages, keys)
        self._checked(chat.REPLY_PRIMING + counted + sum(counts))
        return counts

    def request_tokens(self, message_tokens: int, tools: int) -> int:
        return self._checked(chat.REPLY_PRIMING + message_tokens + tools)

    def count_messages(self, model: str, messages: list[Any]) -> int:
        return sum(self.count_each(model, messages))

    def count_tools(self, model: str, body: dict[str, Any]) -> int:
        """What the request costs besides its `input` items: `tools` and `instructions`."""
        text = self._text(model)
        defs = body.get("tools")
        cl100k = self.counter.profile_key(model).startswith("cl100k")
        costs = CL100K_TOOLS if cl100k else O200K_TOOLS
        tools = tools_tokens(defs, text, costs) if isinstance(defs, list) else 0
        return tools + instructions_tokens(body.get("instructions"), text, self._media_for(model))

    def count_request(self, body: dict[str, Any], keys: Sequence[int | None] | None = None) -> int:
        """The input tokens of a whole request; TooManyTokens past `max_request_tokens`."""
        model, items = _model_and_items(body)
        counts = self.count_each(model, items, keys)
        return self.request_tokens(sum(counts), self.count_tools(model, body))

    async def acount_request(
        self, body: dict[str, Any], keys: Sequence[int | None] | None = None
    ) -> int:
        """`count_request`, long lists counted in a worker thread."""
        model, items = _model_and_items(body)
        counts = await self.acount_each(model, items, keys)
        return self.request_tokens(sum(counts), self.count_tools(model, body))

    def close(self) -> None:
        """The token counter this one reads is closed by its owner."""

    # -- internals ---------------------------------------------------------------------------

    def _text(self, model: str) -> TextCount:
        count = self.counter.count_text
        return lambda text: count(model, text)

    def _media_for(self, model: str) -> Media:
        media = self._media.get(model)
        if media is None:
            if len(self._media) >= 256:  # model names are client input
                self._media.clear()
            images = GPT_4O_MINI if is_gpt_4o_mini(model) else GPT_4O
            media = self._media[model] = Media(images, self._remote_images)
        return media

    def _salted(
        self, model: str, items: Sequence[Any], keys: Sequence[int | None] | None
    ) -> list[int | None]:
        salt = hash(self.profile_key(model)) ^ _SALT
        if keys is None or len(keys) != len(items):
            keys = [None] * len(items)
        return [
            (None if (d := content_key(item)) is None else d ^ salt) if k is None else k ^ salt
            for item, k in zip(items, keys, strict=True)
        ]

    def _checked(self, total: int) -> int:
        if self._limit and total > self._limit:
            raise TooManyTokens(self._limit)
        return total
