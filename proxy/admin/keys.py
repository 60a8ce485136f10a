"""The key lifecycle API: create, list, get, update, rotate and revoke keys; team quotas.

    GET    /admin/keys                          every key (config, keys file, API) and policy
    POST   /admin/keys                          create: the secret is in this answer only
    GET    /admin/keys/{id}
    PATCH  /admin/keys/{id}                     change policy fields (team, limits, models...)
    POST   /admin/keys/{id}/rotate              a new secret; the old ones expire later
    DELETE /admin/keys/{id}/secrets/{secret}    revoke one secret
    DELETE /admin/keys/{id}                     revoke the key (kept, marked revoked)
    GET    /admin/teams, PUT|DELETE /admin/teams/{name}
    GET    /admin/audit?limit=N                 the newest admin actions

Only keys and teams made through the API change here; a configured one (config, keys file)
answers 409 naming where to change it. Every change is a compare-and-set on the stored
record (retried on a conflict), audited in the same write, and applied to this replica's
keys before the answer, so the next request here already sees it; other replicas see it
within a second (proxy/auth/source.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.admin.access import check_admin
from proxy.admin.audit import audit_entry, log_entry
from proxy.auth.keys import ProxyKey, policy_key
from proxy.auth.keystore import KeyStore
from proxy.auth.records import (
    Conflict,
    Kind,
    Record,
    Snapshot,
    StoredKey,
    StoredTeam,
    StoreUnavailable,
    new_secret,
)
from proxy.auth.source import KeySource
from proxy.errors import ProxyError, bad_request
from proxy.settings import (
    KEY_ID_PATTERN,
    ConfigError,
    LimitSettings,
    PolicySettings,
    format_validation_error,
)
from proxy.state import ProxyState

DEFAULT_OLD_EXPIRES_IN_S = 3600  # a rotation's grace: old secrets keep working for an hour
_WRITE_TRIES = 5


class KeyCreate(PolicySettings):
    id: str | None = Field(None, pattern=KEY_ID_PATTERN)  # None: one is made up
    expires_in_s: int | None = Field(None, gt=0)
    expires_at: dt.datetime | None = None


class Rotate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # How long the secrets live now keep working (0: revoked at once).
    old_expires_in_s: int = Field(DEFAULT_OLD_EXPIRES_IN_S, ge=0)
    expires_in_s: int | None = Field(None, gt=0)  # the new secret's life (None: no end)


def _source(state: ProxyState) -> KeySource:
    return state.gate.source


def _store(state: ProxyState) -> KeyStore:
    store = _source(state).store
    if store is None:
        raise ProxyError(
            409,
            "Keys cannot be made through the API here: set auth.api_keys = true (keys then "
            "live in Redis with a Redis quota backend, else in auth.api_keys_file).",
            code="api_keys_off",
        )
    return store


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad_request("The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The body must be a JSON object.", code="invalid_json")
    return data


def _validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problem = exc.errors()[0]
        param = ".".join(str(part) for part in problem["loc"]) or None
        message = format_validation_error(exc, "(in the request body)")
        raise bad_request(message.replace("invalid config ", "invalid "), param=param) from None


def _expiry(in_s: int | None, at: dt.datetime | None) -> float | None:
    if in_s is not None:
        return time.time() + in_s
    if at is not None:
        return (at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)).timestamp()
    return None


def _configured_key(state: ProxyState, key_id: str) -> ProxyKey | None:
    key = _source(state).ring.get(key_id)
    return key if key is not None and key.origin != "api" else None


def _check_buildable(state: ProxyState, record: StoredKey) -> None:
    """400 unless this replica can serve the key (its strategy loads, its upstream
    credential's variable is set)."""
    try:
        policy_key(record, record.id, b"", "key", os.environ, _source(state).teams(), origin="api")
    except ConfigError as exc:
        raise bad_request(str(exc)) from None


def _not_managed(key_id: str, origin: str) -> ProxyError:
    where = "the proxy's config ([[auth.keys]])" if origin == "config" else "auth.keys_file"
    return ProxyError(
        409,
        f"The key {key_id!r} comes from {where}: change it there, not through the API.",
        code="key_not_managed",
    )


def _no_key(key_id: str) -> ProxyError:
    return ProxyError(404, f"No key {key_id!r}.", param="id", code="key_not_found")


async def _change(
    state: ProxyState,
    kind: Kind,
    name: str,
    change: Callable[[Snapshot], tuple[Record | None, dict[str, Any]] | None],
) -> Snapshot:
    """Read, `change` (the new record or None to delete, and the audit entry; or None: no
    such record), write over the revision read; again on a conflict. The snapshot after."""
    store = _store(state)
    for _ in range(_WRITE_TRIES):
        try:
            snapshot = await store.load()
        except StoreUnavailable as exc:
            raise _unavailable(exc) from None
        found: Record | None = (snapshot.keys if kind == "key" else snapshot.teams).get(name)
        result = change(snapshot)
        if result is None:
            raise _no_key(name) if kind == "key" else _no_team(name)
        record, entry = result
        if record is not None:
            record.rev = (found.rev if found is not None else 0) + 1
        try:
            await store.write(kind, name, None if found is None else found.rev, record, entry)
        except Conflict:
            continue
        except StoreUnavailable as exc:
            raise _unavailable(exc) from None
        log_entry(entry)
        source = _source(state)
        with contextlib.suppress(StoreUnavailable):  # (else the watcher applies it later)
            await source.refresh_store()
        return source.snapshot or snapshot
    raise ProxyError(409, f"{name!r} kept changing under this request; try again.", code="conflict")


def _unavailable(exc: Exception) -> ProxyError:
    return ProxyError(
        503,
        f"The key store is unavailable ({exc}); try again shortly.",
        type="server_error",
        code="key_store_unavailable",
        headers={"retry-after": "1"},
    )


def _answer(call: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        try:
            return await call(request)
        except ProxyError as exc:
            return exc.response()

    route.__name__ = call.__name__
    route.__doc__ = call.__doc__
    return route


def _key_json(state: ProxyState, key_id: str) -> dict[str, Any] | None:
    """A key as the API shows it (no secret, no digest), from the API's store or the ring."""
    source = _source(state)
    snapshot = source.snapshot
    now = time.time()
    if snapshot is not None and key_id in snapshot.keys:
        record = snapshot.keys[key_id]
        return {**record.public(now), "in_force": source.ring.get(key_id) is not None}
    key = source.ring.get(key_id)
    if key is None:
        return None
    return {**key.policy(), "in_force": True}


def _with_secret(
    state: ProxyState, key_id: str, secret: str, secret_id: str, status: int = 200
) -> Response:
    """The answer that shows a new secret: the only place it ever appears."""
    body = {"object": "key", "key": _key_json(state, key_id), "secret": secret}
    return JSONResponse({**body, "secret_id": secret_id}, status_code=status)


# Routes.


@_answer
async def list_keys(request: Request) -> Response:
    """Every key in force and every API-made one (revoked too); never key material."""
    state, _ = check_admin(request)
    source = _source(state)
    configured = [key for key in source.ring.proxy_keys() if key.origin != "api"]
    data = [{**key.policy(), "in_force": True} for key in configured]
    snapshot = source.snapshot
    if snapshot is not None:
        data += [_key_json(state, key_id) or {} for key_id in sorted(snapshot.keys)]
    return JSONResponse({"object": "list", "data": data})


@_answer
async def get_key(request: Request) -> Response:
    state, _ = check_admin(request)
    key_id = request.path_params["key_id"]
    found = _key_json(state, key_id)
    if found is None:
        raise _no_key(key_id)
    return JSONResponse(found)


@_answer
async def create_key(request: Request) -> Response:
    """A new key and its first secret, shown in this answer and never again."""
    state, actor = check_admin(request)
    _store(state)
    asked: KeyCreate = _validated(KeyCreate, await _body(request))
    key_id = asked.id or f"key_{os.urandom(6).hex()}"
    if _configured_key(state, key_id) is not None:
        raise ProxyError(
            409, f"A configured key has the id {key_id!r}.", param="id", code="key_exists"
        )
    secret, stored = new_secret(_expiry(asked.expires_in_s, asked.expires_at))
    policy = asked.model_dump(exclude={"id", "expires_in_s", "expires_at"}, exclude_unset=True)
    now = time.time()
    record = StoredKey(id=key_id, secrets=[stored], created_at=now, updated_at=now, **policy)
    _check_buildable(state, record)

    def create(snapshot: Snapshot) -> tuple[Record, dict[str, Any]]:
        if key_id in snapshot.keys:
            raise ProxyError(
                409, f"A key {key_id!r} exists already.", param="id", code="key_exists"
            )
        entry = audit_entry(
            actor, "key.create", key_id=key_id, team=record.team, secret_id=stored.id,
            changes=policy,
        )  # fmt: skip
        return record, entry

    await _change(state, "key", key_id, create)
    return _with_secret(state, key_id, secret, stored.id, status=201)


def _stored(snapshot: Snapshot, state: ProxyState, key_id: str) -> StoredKey | None:
    configured = _configured_key(state, key_id)
    if configured is not None:
        raise _not_managed(key_id, configured.origin)
    return snapshot.keys.get(key_id)


@_answer
async def update_key(request: Request) -> Response:
    """Set policy fields (any of `[[auth.keys]]`'s but the key material); others unchanged."""
    state, actor = check_admin(request)
    key_id = request.path_params["key_id"]
    data = await _body(request)
    asked: PolicySettings = _validated(PolicySettings, data)
    changes = asked.model_dump(exclude_unset=True)

    def update(snapshot: Snapshot) -> tuple[Record, dict[str, Any]] | None:
        found = _stored(snapshot, state, key_id)
        if found is None:
            return None
        record = found.model_copy(update={**changes, "updated_at": time.time()}, deep=True)
        record = StoredKey.model_validate(record.model_dump())
        _check_buildable(state, record)
        entry = audit_entry(actor, "key.update", key_id=key_id, team=record.team, changes=changes)
        return record, entry

    await _change(state, "key", key_id, update)
    return JSONResponse(_key_json(state, key_id))


@_answer
async def rotate_key(request: Request) -> Response:
    """A new secret; the live ones keep working `old_expires_in_s` more (default an hour),
    so clients move over without a gap."""
    state, actor = check_admin(request)
    key_id = request.path_params["key_id"]
    asked: Rotate = _validated(Rotate, await _body(request))
    secret, stored = new_secret(_expiry(asked.expires_in_s, None))

    def rotate(snapshot: Snapshot) -> tuple[Record, dict[str, Any]] | None:
        found = _stored(snapshot, state, key_id)
        if found is None:
            return None
        if found.revoked_at is not None:
            raise ProxyError(409, f"The key {key_id!r} is revoked.", code="key_revoked")
        now = time.time()
        until = now + asked.old_expires_in_s
        old = [
            secret.model_copy(update={"expires_at": min(secret.expires_at or until, until)})
            for secret in found.live_secrets(now)
        ]
        record = found.model_copy(update={"secrets": [*old, stored], "updated_at": now})
        entry = audit_entry(
            actor, "key.rotate", key_id=key_id, team=record.team, secret_id=stored.id,
            changes={"old_secrets_expire_at": until, "old_secrets": [s.id for s in old]},
        )  # fmt: skip
        return record, entry

    await _change(state, "key", key_id, rotate)
    return _with_secret(state, key_id, secret, stored.id)


@_answer
async def revoke_key(request: Request) -> Response:
    """Every secret of the key stops working now (the record stays, marked revoked)."""
    state, actor = check_admin(request)
    key_id = request.path_params["key_id"]

    def revoke(snapshot: Snapshot) -> tuple[Record, dict[str, Any]] | None:
        found = _stored(snapshot, state, key_id)
        if found is None:
            return None
        now = time.time()
        record = found.model_copy(update={"revoked_at": found.revoked_at or now, "updated_at": now})
        return record, audit_entry(actor, "key.revoke", key_id=key_id, team=record.team)

    await _change(state, "key", key_id, revoke)
    return JSONResponse(_key_json(state, key_id))


@_answer
async def revoke_secret(request: Request) -> Response:
    """One secret stops working now (the key's others go on)."""
    state, actor = check_admin(request)
    key_id = request.path_params["key_id"]
    secret_id = request.path_params["secret_id"]

    def revoke(snapshot: Snapshot) -> tuple[Record, dict[str, Any]] | None:
        found = _stored(snapshot, state, key_id)
        if found is None:
            return None
        if not any(secret.id == secret_id for secret in found.secrets):
            raise ProxyError(
                404, f"The key {key_id!r} has no secret {secret_id!r}.", code="secret_not_found"
            )
        now = time.time()
        secrets = [
            secret.model_copy(update={"expires_at": now})
            if secret.id == secret_id and secret.live(now)
            else secret
            for secret in found.secrets
        ]
        record = found.model_copy(update={"secrets": secrets, "updated_at": now})
        entry = audit_entry(
            actor, "key.revoke_secret", key_id=key_id, team=record.team, secret_id=secret_id
        )
        return record, entry

    await _change(state, "key", key_id, revoke)
    return JSONResponse(_key_json(state, key_id))


# Teams.


def _no_team(name: str) -> ProxyError:
    return ProxyError(404, f"No team {name!r} made through the API.", code="team_not_found")


def _team_json(source: KeySource, name: str) -> dict[str, Any]:
    limits = source.teams().get(name)
    keys = sorted(key.id for key in source.ring.proxy_keys() if key.team == name)
    origin = "config" if source.configured_team(name) else "api"
    return {
        "name": name,
        "origin": origin if limits is not None else None,
        **(limits.as_dict() if limits is not None else {}),
        "keys": keys,
    }


@_answer
async def list_teams(request: Request) -> Response:
    """Every team with quotas (config, keys file, API) or with keys."""
    state, _ = check_admin(request)
    source = _source(state)
    names = set(source.teams()) | {k.team for k in source.ring.proxy_keys() if k.team is not None}
    return JSONResponse(
        {"object": "list", "data": [_team_json(source, name) for name in sorted(names)]}
    )


@_answer
async def put_team(request: Request) -> Response:
    """Set a team's quotas (created if new): the whole set, unset fields unlimited."""
    state, actor = check_admin(request)
    name = request.path_params["team"]
    source = _source(state)
    if source.configured_team(name):
        raise ProxyError(
            409,
            f"The team {name!r} is configured (auth.teams or the keys file): change it there.",
            code="team_not_managed",
        )
    limits: LimitSettings = _validated(LimitSettings, await _body(request))
    _validated(StoredTeam, {"name": name})

    def put(snapshot: Snapshot) -> tuple[Record, dict[str, Any]]:
        now = time.time()
        found = snapshot.teams.get(name)
        record = StoredTeam(
            name=name,
            created_at=found.created_at if found is not None else now,
            updated_at=now,
            **limits.model_dump(),
        )
        changes = limits.model_dump(exclude_none=True)
        return record, audit_entry(actor, "team.put", team=name, changes=changes)

    await _change(state, "team", name, put)
    return JSONResponse(_team_json(source, name))


@_answer
async def delete_team(request: Request) -> Response:
    """The team's quotas go (its keys keep the team name, without team limits)."""
    state, actor = check_admin(request)
    name = request.path_params["team"]

    def delete(snapshot: Snapshot) -> tuple[Record | None, dict[str, Any]] | None:
        if name not in snapshot.teams:
            return None
        return None, audit_entry(actor, "team.delete", team=name)

    await _change(state, "team", name, delete)
    return JSONResponse({"name": name, "deleted": True})


@_answer
async def audit_trail(request: Request) -> Response:
    """The newest admin actions first (`limit`, default 100, at most 1000)."""
    state, _ = check_admin(request)
    store = _store(state)
    raw = request.query_params.get("limit", "100")
    if not raw.isdigit() or not 0 < int(raw) <= 1000:
        raise bad_request(f"Invalid limit={raw!r}: 1 to 1000.", param="limit")
    try:
        entries = await store.audit_log(int(raw))
    except StoreUnavailable as exc:
        raise _unavailable(exc) from None
    return JSONResponse({"object": "list", "data": entries})
