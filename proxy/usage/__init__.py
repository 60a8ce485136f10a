"""Usage accounting: the upstream's reported usage per key, model and day, and its price."""

from __future__ import annotations

from proxy.usage.meter import COST_HEADER, ChatTap, Meter, end_user
from proxy.usage.pricing import DEFAULT_PRICES, Price, Pricing
from proxy.usage.tap import ReportedUsage, StreamTap, usage_of_body

__all__ = [
    "COST_HEADER",
    "DEFAULT_PRICES",
    "ChatTap",
    "Meter",
    "Price",
    "Pricing",
    "ReportedUsage",
    "StreamTap",
    "end_user",
    "usage_of_body",
]
