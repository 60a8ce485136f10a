"""`compaction-proxy keys`: the key lifecycle API from a shell.

    compaction-proxy keys create --id team-a --team platform --spend-day 50
    compaction-proxy keys list
    compaction-proxy keys rotate team-a --old-expires-in 3600
    compaction-proxy keys revoke team-a [--secret sec_...]

It talks to a running proxy's /admin/keys: the URL from `--url`, else $PROXY_ADMIN_URL, else
`server.host:server.port` of `--config`; the admin token from the env var `--token-env`
names, else the one `admin.token_env` names in `--config`, else $PROXY_ADMIN_TOKEN. A new
secret (create, rotate) is printed alone on stdout, once: the proxy keeps only its hash.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
import time
from typing import Any

import httpx

from proxy.settings import ConfigError, load_settings

URL_ENV = "PROXY_ADMIN_URL"
TOKEN_ENV = "PROXY_ADMIN_TOKEN"

# Policy flags: (flag, field, type).
_POLICY: tuple[tuple[str, str, type], ...] = (
    ("--team", "team", str),
    ("--budget-tokens", "budget_tokens", int),
    ("--mode", "mode", str),
    ("--strategy", "strategy", str),
    ("--rpm", "requests_per_minute", int),
    ("--tpm", "prompt_tokens_per_minute", int),
    ("--tpd", "prompt_tokens_per_day", int),
    ("--spend-day", "spend_usd_per_day", float),
    ("--spend-month", "spend_usd_per_month", float),
    ("--upstream-api-key-env", "upstream_api_key_env", str),
)


def register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = subparsers.add_parser(
        "keys",
        help="create, list, rotate and revoke proxy keys on a running proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    keys.add_argument("--url", help=f"the proxy's base URL (default ${URL_ENV}, or --config's)")
    keys.add_argument("--config", metavar="PATH", help="TOML config file (admin.token_env, port)")
    keys.add_argument("--token-env", metavar="VAR", help="env var holding the admin token")
    keys.add_argument("--json", action="store_true", help="print the API's JSON")
    verbs = keys.add_subparsers(dest="verb", required=True, metavar="VERB")

    create = verbs.add_parser("create", help="a new key; prints its secret once")
    create.add_argument("--id", help="the key id (default: made up)")
    _policy_flags(create)
    create.add_argument("--expires-in", type=int, metavar="S", help="the secret's life (seconds)")

    verbs.add_parser("list", help="every key and its policy (never key material)")
    get = verbs.add_parser("get", help="one key")
    get.add_argument("id")

    update = verbs.add_parser("update", help="change a key's policy")
    update.add_argument("id")
    _policy_flags(update)

    rotate = verbs.add_parser("rotate", help="a new secret; prints it once")
    rotate.add_argument("id")
    rotate.add_argument(
        "--old-expires-in", type=int, metavar="S",
        help="how long the current secrets keep working (default 3600; 0: revoked now)",
    )  # fmt: skip
    rotate.add_argument("--expires-in", type=int, metavar="S", help="the new secret's life")

    revoke = verbs.add_parser("revoke", help="revoke a key (or one of its secrets) now")
    revoke.add_argument("id")
    revoke.add_argument("--secret", metavar="SECRET_ID", help="only this secret")
    keys.set_defaults(func=keys_command)


def _policy_flags(parser: argparse.ArgumentParser) -> None:
    for flag, field, kind in _POLICY:
        parser.add_argument(flag, dest=field, type=kind, help=f"the key's {field}")
    parser.add_argument(
        "--model", dest="allowed_models", action="append", metavar="GLOB",
        help="an allowed model glob (repeat for more; default: any)",
    )  # fmt: skip


def _policy(args: argparse.Namespace) -> dict[str, Any]:
    fields = [field for _, field, _ in _POLICY] + ["allowed_models"]
    return {field: getattr(args, field) for field in fields if getattr(args, field) is not None}


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """(base URL, admin token)."""
    settings = load_settings(args.config) if args.config else None
    token_env = args.token_env or (settings.admin.token_env if settings else None) or TOKEN_ENV
    token = os.environ.get(token_env)
    if not token:
        raise ConfigError(f"no admin token: set {token_env} (or name another with --token-env)")
    url = args.url or os.environ.get(URL_ENV)
    if url is None:
        host, port = "127.0.0.1", 8080
        if settings is not None:
            host, port = settings.server.host, settings.server.port
            host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        url = f"http://{host}:{port}"
    return url.rstrip("/"), token


def _call(
    args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    base, token = _target(args)
    actor = f"{getpass.getuser()}@{socket.gethostname()}"
    headers = {"authorization": f"Bearer {token}", "x-admin-actor": actor}
    try:
        reply = httpx.request(
            method, f"{base}{path}", json=body, headers=headers, timeout=30, trust_env=False
        )
    except httpx.HTTPError as exc:
        raise ConfigError(f"could not reach the proxy at {base}: {type(exc).__name__}") from None
    if reply.status_code >= 400:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:200]
        raise ConfigError(f"{method} {path} answered {reply.status_code}: {message}")
    return reply.json()


def _when(at: float | None) -> str:
    if at is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at))


def _print_keys(keys: list[dict[str, Any]]) -> None:
    head = ("id", "team", "origin", "state", "secrets", "limits")
    rows = [head]
    for key in keys:
        limits = ", ".join(
            f"{name}={key[name]}"
            for name in (field for _, field, _ in _POLICY[4:9])
            if key.get(name) is not None
        )
        live = [s for s in key.get("secrets", []) if s.get("live")]
        state = "revoked" if key.get("revoked") else "active" if key.get("in_force") else "off"
        secrets = ", ".join(f"{s['id']} {s['hint']}" for s in live) if "secrets" in key else "-"
        rows.append(
            (key["id"], key.get("team") or "", key.get("origin", ""), state, secrets, limits)
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))


def keys_command(args: argparse.Namespace) -> int:
    verb = args.verb
    if verb == "list":
        answer = _call(args, "GET", "/admin/keys")
        if args.json:
            print(json.dumps(answer, indent=2))
        else:
            _print_keys(answer["data"])
        return 0
    if verb == "get":
        answer = _call(args, "GET", f"/admin/keys/{args.id}")
    elif verb == "create":
        body = _policy(args)
        if args.id:
            body["id"] = args.id
        if args.expires_in:
            body["expires_in_s"] = args.expires_in
        answer = _call(args, "POST", "/admin/keys", body)
    elif verb == "update":
        answer = _call(args, "PATCH", f"/admin/keys/{args.id}", _policy(args))
    elif verb == "rotate":
        body = {}
        if args.old_expires_in is not None:
            body["old_expires_in_s"] = args.old_expires_in
        if args.expires_in:
            body["expires_in_s"] = args.expires_in
        answer = _call(args, "POST", f"/admin/keys/{args.id}/rotate", body)
    else:  # revoke
        path = f"/admin/keys/{args.id}"
        if args.secret:
            path += f"/secrets/{args.secret}"
        answer = _call(args, "DELETE", path)
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    secret = answer.get("secret") if isinstance(answer, dict) else None
    if secret is not None:
        key = answer["key"]
        print(
            f"key {key['id']}: new secret {answer['secret_id']} (shown once: the proxy keeps "
            "only its hash)",
            file=sys.stderr,
        )
        print(secret)
        return 0
    _print_keys([answer])
    return 0
