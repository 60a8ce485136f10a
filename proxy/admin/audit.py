"""The audit trail of admin actions: who did what to which key or team, and when.

Each change is one JSON entry, stored by the key store in the same atomic write as the
change (so the trail and the keys never disagree; `GET /admin/audit` reads it back) and
logged as one line on the `proxy.admin.audit` logger (fields, as JSON with
`server.log_format = "json"`). An entry holds names, ids and policy values: never a secret,
never a digest.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from proxy.admin.access import Actor

audit_log = logging.getLogger("proxy.admin.audit")


def audit_entry(actor: Actor, action: str, **target: Any) -> dict[str, Any]:
    """`action`: "key.create", "key.update", "key.rotate", "key.revoke",
    "key.revoke_secret", "team.put", "team.delete". `target`: key_id, team, secret_id,
    changes (the policy fields set, by name)."""
    when = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    entry = {"time": when, "actor": actor.name, "client": actor.client, "action": action}
    entry.update({name: value for name, value in target.items() if value is not None})
    return entry


def log_entry(entry: dict[str, Any]) -> None:
    fields = {f"audit_{name}": value for name, value in entry.items() if name != "time"}
    audit_log.info("admin %s", entry["action"], extra=fields)
