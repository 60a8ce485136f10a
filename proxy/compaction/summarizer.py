"""The summarizer: one non-streaming chat completion against an OpenAI-compatible upstream
(or one Responses API request, `compaction.summarizer.api = "responses"`).

It must never make a client's request much worse than no compaction: one deadline bounds the
whole call including retries, only transient failures are retried (a bad request stays bad),
and a circuit breaker shared by the app stops calling a summarizer that keeps failing, so a
dead summarizer costs a fast failure instead of a timeout per request.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from proxy import jsonbytes
from proxy.compaction.protocol import Message, SummarizerError, Summary, Usage
from proxy.compaction.render import content_text, strip_reasoning
from proxy.headers import as_bytes

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

# Reasoning families reject max_tokens and want max_completion_tokens.
log = logging.getLogger("proxy.compaction")
_REASONING_MODEL = re.compile(r"^(o[1-9]\d*(?![a-z0-9])|gpt-5(?!\d))", re.IGNORECASE)
_ERROR_SNIPPET_CHARS = 200
_MAX_BACKOFF_S = 30.0


def uses_max_completion_tokens(model: str) -> bool:
    """o1/o3/o4/gpt-5 and variants (`o3-mini`, `gpt-5.1`, `openai/o4-mini`...)."""
    return bool(_REASONING_MODEL.match(model.rsplit("/", 1)[-1]))


class CircuitBreaker:
    """Closed -> (N consecutive failures) open -> (cool-down) one trial -> closed or open again.

    One per app, shared by every request's summarizer. Not thread-safe; the event loop is
    single-threaded and no method awaits.
    """

    def __init__(
        self,
        failure_threshold: int = 5,
        cooldown_s: float = 30.0,
        *,
        clock: Clock = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        """`on_change(state)`: told each time the state changes (metrics)."""
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_started: float | None = None

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half_open" if self._trial_started is not None else "open"

    def allow(self) -> bool:
        """May a call go out now? In the open state, lets exactly one trial through per cool-down.

        A trial that never reports back (a bug, a lost task) blocks others for one cool-down only.
        """
        if self._opened_at is None:
            return True
        now = self._clock()
        since = self._trial_started if self._trial_started is not None else self._opened_at
        if now - since < self.cooldown_s:
            return False
        self._trial_started = now
        self._changed("open")
        return True

    def record_success(self) -> None:
        before = self.state
        self._failures = 0
        self._opened_at = self._trial_started = None
        self._changed(before)

    def record_failure(self) -> None:
        before = self.state
        self._failures += 1
        if self._opened_at is not None or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
            self._trial_started = None
            log.warning(
                "summarizer circuit breaker open after %d consecutive failures: summaries "
                "paused, requests forwarded uncompacted; next trial in %gs",
                self._failures, self.cooldown_s,
            )  # fmt: skip
        self._changed(before)

    def release(self) -> None:
        """A call ended without a verdict (cancelled): let the next caller run the trial."""
        if self._trial_started is not None:
            self._trial_started = None
            self._opened_at = self._clock() - self.cooldown_s
            self._changed("half_open")

    def _changed(self, before: str) -> None:
        state = self.state
        if state == before:
            return
        if state == "closed":
            log.info("summarizer circuit breaker closed: the summarizer answers again")
        if self._on_change is not None:
            self._on_change(state)


class _Transient(Exception):
    """An attempt failed in a way worth retrying; carries the error to raise if none is left."""

    def __init__(self, error: SummarizerError, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


class UpstreamSummarizer:
    """Satisfies `proxy.compaction.protocol.Summarizer` via `POST {base_url}/chat/completions`
    (`api="responses"`: `POST {base_url}/responses`, the system prompt as `instructions`).

    Built per request (base URL, model and auth headers depend on it) around the app's shared
    client and breaker. `timeout_s` bounds the whole call, retries and backoff included.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        base_url: str,
        model: str,
        headers: Mapping[str, str] | None = None,
        max_tokens: int = 2000,
        timeout_s: float = 120.0,
        retries: int = 2,
        backoff_base_s: float = 0.5,
        breaker: CircuitBreaker | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
        on_result: Callable[[float | None, str | None], None] | None = None,
        api: str = "chat",
    ) -> None:
        """`on_result(seconds, failure reason)` after each call (metrics); seconds is None
        when the breaker refused the call."""
        self.client = client
        self.api = api
        path = "/responses" if api == "responses" else "/chat/completions"
        self.url = base_url.rstrip("/") + path
        self.model = model
        self.headers = dict(headers or {})
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_base_s = backoff_base_s
        self.breaker = breaker
        self._clock = clock
        self._sleep = sleep
        self._jitter = jitter
        self._on_result = on_result

    def request_body(self, system_prompt: str, messages: list[Message]) -> dict[str, Any]:
        """No tools, no streaming, a hard cap on the summary's length."""
        if self.api == "responses":  # chat messages are valid `input` items as they are
            return {
                "model": self.model,
                "instructions": system_prompt,
                "input": messages,
                "stream": False,
                "store": False,
                "max_output_tokens": self.max_tokens,
            }
        cap_key = (
            "max_completion_tokens" if uses_max_completion_tokens(self.model) else "max_tokens"
        )
        return {
            "model": self.model,
            "messages": [{"role": "system", "content": system_prompt}, *messages],
            "stream": False,
            cap_key: self.max_tokens,
        }

    async def summarize(self, system_prompt: str, messages: list[Message]) -> Summary:
        breaker = self.breaker
        if breaker is not None and not breaker.allow():
            if self._on_result is not None:
                self._on_result(None, "circuit_open")
            raise SummarizerError("circuit_open", "summarizer disabled after repeated failures")
        started = self._clock()
        try:
            summary = await self._call_with_retries(self.request_body(system_prompt, messages))
        except SummarizerError as error:
            if self._on_result is not None:
                self._on_result(self._clock() - started, error.reason)
            if breaker is not None:
                # A 4xx means the summarizer is up and the request was at fault.
                if _is_client_error(error.reason):
                    breaker.record_success()
                else:
                    breaker.record_failure()
            raise
        except BaseException:
            if breaker is not None:
                breaker.release()
            raise
        if self._on_result is not None:
            self._on_result(self._clock() - started, None)
        if breaker is not None:
            breaker.record_success()
        return summary

    async def _call_with_retries(self, body: dict[str, Any]) -> Summary:
        deadline = self._clock() + self.timeout_s
        attempt = 0
        while True:
            try:
                return await self._attempt(body, deadline - self._clock())
            except _Transient as failure:
                delay = self._backoff(attempt, failure.retry_after)
                if attempt >= self.retries or self._clock() + delay >= deadline:
                    raise failure.error from None
            attempt += 1
            await self._sleep(delay)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        """Exponential with jitter (50-100% of the step), at least what Retry-After asked."""
        step = self.backoff_base_s * 2.0**attempt
        delay = step * (0.5 + 0.5 * self._jitter())
        if retry_after is not None:
            delay = max(delay, retry_after)
        return min(delay, _MAX_BACKOFF_S)

    async def _attempt(self, body: dict[str, Any], remaining: float) -> Summary:
        if remaining <= 0:
            raise SummarizerError("summarizer_timeout", f"no reply within {self.timeout_s:g}s")
        try:
            async with asyncio.timeout(remaining):  # httpx's read timeout is per chunk, not total
                response = await self.client.post(
                    self.url,
                    content=jsonbytes.cleaned(body),  # httpx's json= fails on lone surrogates
                    # The client's header bytes as sent (latin-1 text here, see proxy.headers).
                    headers=as_bytes([*self.headers.items(), ("content-type", "application/json")]),
                    timeout=httpx.Timeout(remaining),
                )
        except (httpx.TimeoutException, TimeoutError):
            raise SummarizerError(
                "summarizer_timeout", f"no reply within {self.timeout_s:g}s"
            ) from None
        except httpx.TransportError as exc:
            error = SummarizerError("summarizer_unreachable", f"{type(exc).__name__}: {exc}")
            raise _Transient(error) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise SummarizerError("summarizer_unreachable", str(exc)) from None
        status = response.status_code
        if status != 200:
            error = SummarizerError(
                f"summarizer_http_{status}",
                f"summarizer answered {status}: {response.text[:_ERROR_SNIPPET_CHARS]}",
            )
            if status == 429 or status >= 500:
                raise _Transient(error, _retry_after(response))
            raise error
        if self.api == "responses":
            return _parse_response(response)
        return _parse_reply(response)


def _is_client_error(reason: str) -> bool:
    prefix = "summarizer_http_"
    if not reason.startswith(prefix):
        return False
    status = reason[len(prefix) :]
    return status.isdigit() and 400 <= int(status) < 500 and int(status) != 429


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(float(value), 0.0) if isinstance(value, str) else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


def _parse_reply(response: httpx.Response) -> Summary:
    """The reply's text without reasoning (`reasoning_content` fields are never read)."""
    try:
        payload = response.json()
        message = payload["choices"][0]["message"]
        content = message.get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise SummarizerError(
            "summarizer_bad_response",
            f"not a chat completion: {response.text[:_ERROR_SNIPPET_CHARS]}",
        ) from None
    text = strip_reasoning(content_text(content)) if content is not None else ""
    if not text:
        usage = _usage(payload.get("usage")) if isinstance(payload, dict) else None
        if isinstance(message, dict) and (
            message.get("tool_calls") or message.get("function_call")
        ):
            # It was sent no tools, yet answered with a call (a model or gateway that adds its
            # own): there is no summary in it.
            raise SummarizerError(
                "summarizer_tool_call", "the summarizer answered with a tool call", usage
            )
        raise SummarizerError("summarizer_empty", "the summarizer's reply had no text", usage)
    choice = payload["choices"][0]
    if isinstance(choice, dict) and choice.get("finish_reason") == "length":
        # Kept (a cut summary beats none), but worth knowing: raise summary_max_tokens.
        log.warning("summary cut off at compaction.summary_max_tokens (finish_reason=length)")
    return Summary(text, _usage(payload.get("usage")))


def _parse_response(response: httpx.Response) -> Summary:
    """A Response's text: its `message` output items' `output_text` parts, reasoning and
    everything else left out."""
    try:
        payload = response.json()
        output = payload["output"]
        if not isinstance(output, list):
            raise TypeError(output)
    except (ValueError, KeyError, TypeError):
        raise SummarizerError(
            "summarizer_bad_response",
            f"not a Response: {response.text[:_ERROR_SNIPPET_CHARS]}",
        ) from None
    usage = _usage(payload.get("usage"))
    messages = [i for i in output if isinstance(i, dict) and i.get("type") == "message"]
    text = strip_reasoning("\n".join(content_text(m.get("content")) for m in messages))
    if not text:
        if any(isinstance(i, dict) and str(i.get("type", "")).endswith("_call") for i in output):
            raise SummarizerError(
                "summarizer_tool_call", "the summarizer answered with a tool call", usage
            )
        raise SummarizerError("summarizer_empty", "the summarizer's reply had no text", usage)
    details = payload.get("incomplete_details")
    if isinstance(details, dict) and details.get("reason") == "max_output_tokens":
        log.warning("summary cut off at compaction.summary_max_tokens (max_output_tokens)")
    return Summary(text, usage)


def _usage(usage: Any) -> Usage:
    """Chat's `prompt_tokens`/`completion_tokens`, or the Responses API's `input_tokens`/
    `output_tokens`."""
    if not isinstance(usage, dict):
        return Usage()
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    return Usage(
        prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else 0,
        completion if isinstance(completion, int) and not isinstance(completion, bool) else 0,
    )
