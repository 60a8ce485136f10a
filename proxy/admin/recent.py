"""Recent compactions, for the admin page: what the compaction step did to recent requests.

`RecentCompactions` is an exchange sink (proxy/exchange.py) that keeps the last `size`
requests of this replica whose compaction step ran with an outcome other than a plain
passthrough. The admin page reads rows through `app.state.recent_compactions`, an async
function of a limit; an app may point it at another source (an audit trail shared by the
replicas) by replacing that function: the page only needs these fields per row.
"""

from __future__ import annotations

import collections
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any

from proxy.record import Record

# limit -> rows, newest first: time (ISO 8601), request_id, key_id, team, model, status,
# reason, tokens_before, tokens_after.
RecentSource = Callable[[int], Awaitable[list[dict[str, Any]]]]

_SHOWN = frozenset({"compacted", "reused", "extended", "failed", "over_budget", "skipped"})


class RecentCompactions:
    def __init__(self, size: int = 200) -> None:
        self._rows: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)

    def started(self, record: Record) -> None:
        pass

    def responding(self, record: Record) -> None:
        pass

    def finished(self, record: Record) -> None:
        if record.compaction not in _SHOWN:
            return
        self._rows.append(
            {
                "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "request_id": record.request_id,
                "key_id": record.key_id,
                "team": record.team,
                "model": record.model,
                "status": record.compaction,
                "reason": record.compaction_reason,
                "tokens_before": record.tokens_before,
                "tokens_after": record.tokens_after,
            }
        )

    async def recent(self, limit: int) -> list[dict[str, Any]]:
        rows = list(self._rows)[-limit:]
        rows.reverse()
        return rows
