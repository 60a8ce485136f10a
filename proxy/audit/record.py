"""One audit record: what a compaction did to one request, built off the event loop.

The request path only takes references (`Pending`: the message lists copied, nothing
serialized); the writer thread turns them into the record. A record holds the request as
the client sent it (`request`: every field but `messages`, which is `messages`), which of
those messages the compaction replaced (`span`: their indices), the summary's text, and the
forwarded history (`forwarded`: `{"index": i}` for a message sent as the client wrote it,
`{"message": {...}}` for one the proxy wrote, the summary). Never a credential: no header
is recorded, and a body field named like one is left out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from proxy.report import Outcome

# Body fields never recorded (names of credentials; clients should not send them, some do).
CREDENTIAL_FIELDS = frozenset({"api_key", "apikey", "api-key", "authorization", "password",
                               "secret", "token", "access_token"})  # fmt: skip


def new_id(now: float | None = None) -> str:
    """`aud_<unix ms>_<random>`: unique, and it tells when the record was made (a reader
    looks for it near that time)."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"aud_{ms:013d}_{os.urandom(6).hex()}"


def id_time(record_id: str) -> float | None:
    """When a record of this id was made (seconds), or None for an id not of `new_id`."""
    parts = record_id.split("_")
    if len(parts) != 3 or parts[0] != "aud" or not parts[1].isdigit():
        return None
    return int(parts[1]) / 1000


@dataclass(slots=True)
class Pending:
    """A record as the request path leaves it: references, nothing built yet."""

    id: str
    time: float
    request_id: str
    key_id: str | None
    body: dict[str, Any]  # the client's body without `messages`
    messages: list[Any]  # the client's messages (a copy of the list, the same objects)
    forwarded: list[Any] | None  # as forwarded; None: the client's own
    outcome: Outcome
    strategy: Any
    fingerprint: str | None


def pending(
    *,
    request_id: str,
    key_id: str | None,
    body: dict[str, Any],
    outcome: Outcome,
    strategy: Any,
    fingerprint: str | None,
) -> Pending:
    """Taken on the request path: shallow copies only (the lists are freed after sending)."""
    now = time.time()
    fields = {k: v for k, v in body.items() if k != "messages"}
    messages = body.get("messages")
    return Pending(
        id=new_id(now),
        time=now,
        request_id=request_id,
        key_id=key_id,
        body=fields,
        messages=list(messages) if isinstance(messages, list) else [],
        forwarded=None if outcome.messages is None else list(outcome.messages),
        outcome=outcome,
        strategy=strategy,
        fingerprint=fingerprint,
    )


def build(p: Pending) -> dict[str, Any]:
    """The record (JSON-ready), in the writer thread."""
    outcome = p.outcome
    index = {id(m): i for i, m in enumerate(p.messages)}
    forwarded: list[dict[str, Any]] = []
    span: list[int] = []
    summary: list[str] = []
    if p.forwarded is None:
        forwarded = [{"index": i} for i in range(len(p.messages))]
    else:
        sent = set()
        for message in p.forwarded:
            i = index.get(id(message))
            if i is None:
                forwarded.append({"message": message})
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, str):
                    summary.append(content)
            else:
                sent.add(i)
                forwarded.append({"index": i})
        span = [i for i in range(len(p.messages)) if i not in sent]
    request = {k: v for k, v in p.body.items() if k.lower() not in CREDENTIAL_FIELDS}
    model = request.get("model")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(p.time))
    after = outcome.tokens_after
    return {
        "id": p.id,
        "time": f"{stamp}.{int(p.time * 1000) % 1000:03d}Z",
        "ts": p.time,
        "request_id": p.request_id,
        "key_id": p.key_id,
        "model": model if isinstance(model, str) else None,
        "strategy": p.strategy,
        "fingerprint": p.fingerprint,
        "budget": outcome.budget,
        "tokens_before": outcome.tokens_before,
        "tokens_after": after if after is not None else outcome.tokens_before,
        "status": outcome.status,
        "reason": outcome.reason,
        "cache": outcome.cache,
        "messages_summarized": outcome.summarized,
        "summarizer_usage": {
            "input_tokens": outcome.usage.input_tokens,
            "output_tokens": outcome.usage.output_tokens,
        },
        "span": span,
        "summary": "\n".join(summary) if summary else None,
        "forwarded": forwarded,
        "request": request,
        "messages": p.messages,
    }


def original_request(record: dict[str, Any]) -> dict[str, Any]:
    """The request as the client sent it, rebuilt from a record."""
    return {**record.get("request", {}), "messages": record.get("messages", [])}


def forwarded_messages(record: dict[str, Any]) -> list[Any]:
    """The history as forwarded, rebuilt from a record."""
    messages = record.get("messages", [])
    return [
        messages[part["index"]] if "index" in part else part.get("message")
        for part in record.get("forwarded", [])
    ]
