"""What one app instance holds for its lifetime (built by create_app, closed by its lifespan)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.compactor import Compactor, PromptCounter
from proxy.settings import Settings
from proxy.upstream import Upstream


@dataclass
class ProxyState:
    settings: Settings
    upstream: Upstream
    counter: PromptCounter
    compactor: Compactor
