"""The request path's one call into the audit trail, after the compaction step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.compactor import Control, model_of
from proxy.report import Outcome

if TYPE_CHECKING:
    from proxy.auth import Caller
    from proxy.state import ProxyState


def audit(
    state: ProxyState,
    request_id: str,
    caller: Caller,
    body: dict[str, Any],
    outcome: Outcome,
    control: Control,
) -> str | None:
    """Queue the audit record of this request's compaction when the trail wants it; its id
    (for `x-compaction-audit`), or None. Never waits, never raises."""
    trail = state.audit
    if trail is None or not trail.wants(caller.key):
        return None
    strategy = control.strategy or state.settings.compaction.strategy
    try:
        return trail.record(
            request_id=request_id,
            key=caller.key,
            body=body,
            outcome=outcome,
            strategy=strategy,
            fingerprint=lambda: state.compactor.fingerprint(model_of(body), control.strategy),
        )
    except Exception as exc:  # a record that cannot be taken never fails its request
        trail.failed(exc)
        return None
