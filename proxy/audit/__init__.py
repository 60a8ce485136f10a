"""The audit trail of compactions: records written off the event loop, read back by the
`compaction-proxy audit` commands (show, export for `replay`)."""

from proxy.audit.trail import AuditTrail

__all__ = ["AuditTrail"]
