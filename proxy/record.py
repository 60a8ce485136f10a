"""What one request leaves behind for the access log, the metrics and the admin API's recent
list: the `Record`, filled in as the request goes (proxy/exchange.py), never content or
secrets."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(slots=True)
class Record:
    """What the access log and the metrics know of one request; never content or secrets.

    Times are seconds (`started` on the perf_counter clock). `None`: not known or not
    applicable (no upstream call, no compaction step, the client left before an answer).
    """

    request_id: str
    method: str
    path: str  # without the query string
    client: str | None
    started: float
    route: str = ""  # the matched route's template ("/v1/{path:path}"): bounded, for labels
    status: int | None = None  # what the client was sent
    model: str | None = None
    stream: bool | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    compaction: str | None = None  # Outcome.status
    compaction_reason: str | None = None
    cache: str | None = None
    upstream_status: int | None = None
    upstream_ttfb_s: float | None = None
    overhead_s: float | None = None  # arrival -> the upstream request went out
    duration_s: float | None = None  # arrival -> last byte sent (or the client left)
    key_id: str | None = None  # the proxy key that authorised the request, when keys are on
    team: str | None = None  # that key's team
    limit: str | None = None  # the quota limit that refused it (a 429), e.g. "spend_usd_per_day"


# The record of the request the running task serves: set by the access middleware
# (proxy/exchange.py) for the request's whole life, read by log records and handlers.
CURRENT_RECORD: ContextVar[Record | None] = ContextVar("compaction_proxy_record", default=None)


def current_record() -> Record | None:
    """The record of the request this code runs for (None outside any request)."""
    return CURRENT_RECORD.get()
