"""What one app instance holds for its lifetime (built by create_app, closed by its lifespan)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.audit import AuditTrail
from proxy.auth import Gate
from proxy.compactor import Compactor, PromptCounter
from proxy.quota import Quotas
from proxy.settings import Settings
from proxy.turnmemo import TurnMemo
from proxy.upstream import Upstream
from proxy.usage import Meter


@dataclass
class ProxyState:
    settings: Settings
    upstream: Upstream
    counter: PromptCounter
    compactor: Compactor
    gate: Gate  # who may call (proxy keys)
    quotas: Quotas
    meter: Meter  # usage accounting
    turns: TurnMemo  # recent chat bodies' parsed state, per tenant
    audit: AuditTrail | None = None  # the compactions' audit trail (proxy/audit)
