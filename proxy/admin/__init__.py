"""/admin/*: operators' API and page, behind the admin token (`admin.token_env`).

`access` checks the token; `keys` is the key lifecycle API (and team quotas, and the audit
trail `audit` writes); `usage` and `quota` report usage and quota state; `ui` is the page,
drawn with `charts`, its recent compactions from `recent`. `routes()` is every route.
"""

from __future__ import annotations

from starlette.routing import Route

from proxy.admin import keys
from proxy.admin.quota import admin_quota
from proxy.admin.recent import RecentCompactions, RecentSource
from proxy.admin.ui import admin_ui
from proxy.admin.usage import admin_usage

__all__ = ["RecentCompactions", "RecentSource", "routes"]


def routes() -> list[Route]:
    return [
        Route("/admin/usage", admin_usage, methods=["GET"]),
        Route("/admin/quota", admin_quota, methods=["GET"]),
        Route("/admin/keys", keys.list_keys, methods=["GET"]),
        Route("/admin/keys", keys.create_key, methods=["POST"]),
        Route("/admin/keys/{key_id}", keys.get_key, methods=["GET"]),
        Route("/admin/keys/{key_id}", keys.update_key, methods=["PATCH"]),
        Route("/admin/keys/{key_id}", keys.revoke_key, methods=["DELETE"]),
        Route("/admin/keys/{key_id}/rotate", keys.rotate_key, methods=["POST"]),
        Route("/admin/keys/{key_id}/secrets/{secret_id}", keys.revoke_secret, methods=["DELETE"]),
        Route("/admin/teams", keys.list_teams, methods=["GET"]),
        Route("/admin/teams/{team}", keys.put_team, methods=["PUT"]),
        Route("/admin/teams/{team}", keys.delete_team, methods=["DELETE"]),
        Route("/admin/audit", keys.audit_trail, methods=["GET"]),
        Route("/admin/ui", admin_ui, methods=["GET"]),
    ]
