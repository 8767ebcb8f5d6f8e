"""The one account of an admitted request: metrics, the admission release and the log line.

However a request ends (complete, failed, cancelled, refused while it waited), `Ledger`
closes it exactly once: the admission queue gets its capacity back, the trace span ends,
the router's metrics count it and one `request_done` line is logged.
"""

from __future__ import annotations

import logging

from pdserve_common.logs import kv
from pdserve_worker.api.admission import AdmissionQueue, Ticket
from pdserve_worker.api.generation import Generation
from pdserve_worker.api.metrics import RouterMetrics

log = logging.getLogger(__name__)


class Ledger:
    """Accounts one admitted request exactly once in metrics and in the log, however it ends."""

    def __init__(
        self,
        metrics: RouterMetrics,
        gen: Generation,
        endpoint: str,
        admission: AdmissionQueue | None = None,
        ticket: Ticket | None = None,
    ) -> None:
        self._metrics = metrics
        self._gen = gen
        self._endpoint = endpoint
        self._admission = admission
        self.ticket = ticket
        self.closed = False

    @property
    def request_id(self) -> str:
        return self._gen.request_id

    def completed(self) -> None:
        if self._close("ok"):
            self._metrics.observe_completed(self._gen.timing(), self._gen.prompt_tokens, self._gen.info)

    def failed(self, reason: str) -> None:
        if self._close(reason):
            self._metrics.observe_failed(reason, self._gen.timing(), self._gen.prompt_tokens)

    def rejected(self, reason: str) -> None:
        """The admission queue refused the request while it waited (its deadline passed)."""
        if self._close(reason):
            self._metrics.observe_rejected(429)

    def _close(self, outcome: str) -> bool:
        if self.closed:
            return False
        self.closed = True
        if self._admission is not None and self.ticket is not None:
            # The one release of the request's admission, however it ended.
            self._admission.release(self.ticket, self._gen.completion_tokens)
        self._gen.end_trace(outcome)
        if not log.isEnabledFor(logging.INFO):
            return True
        gen, timing = self._gen, self._gen.timing()
        info = gen.info
        log.info(
            kv(
                event="request_done",
                request_id=gen.request_id,
                endpoint=self._endpoint,
                outcome=outcome,
                prompt_tokens=gen.prompt_tokens,
                completion_tokens=gen.completion_tokens,
                finish_reason=gen.finish_reason,
                ttft_ms=None if timing.ttft_s is None else round(timing.ttft_s * 1000, 2),
                e2e_ms=round(timing.e2e_s * 1000, 2),
                disaggregated=info is not None and info.disaggregated,
                kv_bytes=0 if info is None else info.kv_bytes,
            )
        )
        return True
