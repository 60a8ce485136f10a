"""The audit trail: records queued by the request path, written by one background thread.

Writing never delays or fails a request: the request path only decides (the key's switch,
the sample) and puts references on a bounded queue, which never blocks; the thread builds
each record, serializes it and hands it to the sink. A full queue (a slow sink) or a sink
that fails drops the record: counted in `compaction_proxy_audit_dropped_total{reason}`
(`queue_full`, `sink_error`; `record_error` for one the request path could not take), with
one warning a minute at most. The reply's `x-compaction-audit: <id>` names a record that
was queued while the sink's last write succeeded (a failing sink gets records, to notice
when it is back, but no header promises them); one the sink then fails to write is counted
as dropped.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from proxy.audit.record import Pending, build, pending
from proxy.audit.sinks import Sink, open_sink
from proxy.auth import ProxyKey
from proxy.report import Outcome
from proxy.settings import Settings

log = logging.getLogger("proxy.audit")
WARN_EVERY_S = 60.0
CLOSE_TIMEOUT_S = 5.0


class AuditTrail:
    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry | None = None,
        *,
        sink: Callable[[], Sink] | None = None,
    ) -> None:
        """`sink` makes the sink (default: as `audit.sink` says), in the writer thread."""
        self.config = settings.audit
        self._make_sink = sink if sink is not None else (lambda: open_sink(settings))
        self._queue: queue.Queue[Pending | None] = queue.Queue(self.config.queue_size)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.written = 0
        self.healthy = True  # the sink's last write succeeded (or none was tried)
        self.dropped: dict[str, int] = {"queue_full": 0, "sink_error": 0, "record_error": 0}
        self._unreported = 0
        self._warned_at = -WARN_EVERY_S
        self._records: Counter | None = None
        self._drops: Counter | None = None
        if registry is not None:
            self._records = Counter(
                "compaction_proxy_audit_records", "Audit records written.", registry=registry
            )
            self._drops = Counter(
                "compaction_proxy_audit_dropped",
                "Audit records dropped: queue_full (the sink is slower than requests), "
                "sink_error (the sink failed) or record_error (the record could not be taken).",
                ("reason",),
                registry=registry,
            )
            for reason in self.dropped:
                self._drops.labels(reason)

    # -- the request path --------------------------------------------------------------------

    def wants(self, key: ProxyKey | None) -> bool:
        if key is not None and key.audit is not None:
            return key.audit
        return self.config.enabled

    def record(
        self,
        *,
        request_id: str,
        key: ProxyKey | None,
        body: dict[str, Any],
        outcome: Outcome,
        strategy: Any,
        fingerprint: Callable[[], str | None],
    ) -> str | None:
        """Queue a record of this request's compaction; its id, or None (not recorded)."""
        if not self.wants(key):
            return None
        if outcome.messages is None and not self.config.record_passthrough:
            return None
        key_id = key.id if key is not None else None
        if self.config.sample_rate < 1.0 and not self._sampled(key_id, body):
            return None
        item = pending(
            request_id=request_id, key_id=key_id, body=body, outcome=outcome,
            strategy=strategy, fingerprint=fingerprint(),
        )  # fmt: skip
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._drop("queue_full")
            return None
        if self._thread is None:
            self._start()
        return item.id if self.healthy else None

    def failed(self, error: Exception) -> None:
        """A record the request path could not take (a bug): counted, warned, never raised."""
        self._drop("record_error", error)

    def _sampled(self, key_id: str | None, body: dict[str, Any]) -> bool:
        """The same answer for every request of a session (its first two messages)."""
        messages = body.get("messages")
        head = messages[:2] if isinstance(messages, list) else []
        try:
            data = orjson.dumps([key_id, head])
        except TypeError:
            return False
        digest = hashlib.blake2b(data, digest_size=8).digest()
        return int.from_bytes(digest, "big") < self.config.sample_rate * 2**64

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._write_all, name="audit-writer", daemon=True
                )
                self._thread.start()

    # -- the writer thread -------------------------------------------------------------------

    def _write_all(self) -> None:
        sink: Sink | None = None
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                break
            try:
                if sink is None:
                    sink = self._make_sink()
                sink.write(item.id, orjson.dumps(build(item)))
            except Exception as exc:
                self.healthy = False
                self._drop("sink_error", exc)
            else:
                self.healthy = True
                with self._lock:
                    self.written += 1
                if self._records is not None:
                    self._records.inc()
            finally:
                self._queue.task_done()
        if sink is not None:
            try:
                sink.close()
            except Exception as exc:
                log.warning("audit sink did not close cleanly: %s", type(exc).__name__)

    def _drop(self, reason: str, error: Exception | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            self.dropped[reason] += 1
            self._unreported += 1
            warn = now - self._warned_at >= WARN_EVERY_S
            if warn:
                self._warned_at, count, self._unreported = now, self._unreported, 0
        if self._drops is not None:
            self._drops.labels(reason).inc()
        if warn:
            cause = f" ({type(error).__name__}: {str(error)[:200]})" if error else ""
            log.warning(
                "audit trail dropped %d record(s): %s%s; requests are not affected",
                count,
                {"queue_full": "the sink is slower than the requests",
                 "sink_error": "the sink failed"}.get(reason, "a record could not be taken"),
                cause,
            )  # fmt: skip

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (for at most `timeout_s`), then stop the thread."""
        thread = self._thread
        if thread is None:
            return
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        thread.join(max(0.0, deadline - time.monotonic()))
        self._thread = None

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Wait until everything queued so far is written or dropped (tests, shutdown)."""
        done = self._queue.all_tasks_done
        with done:
            done.wait_for(lambda: not self._queue.unfinished_tasks, timeout_s)
