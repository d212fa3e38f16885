"""One exception hierarchy: "this request is bad" (4xx) versus "we are broken" (5xx).

The server turns any `DStackError` into `{"error": message}` with `status_code`.
"""

from __future__ import annotations


class DStackError(Exception):
    status_code = 500
    reason = "internal"  # a short label, used in metrics
    rule: str | None = None  # a refusal: the rule that refused it (`{"reason": rule}`)
    retry_after_s: float | None = None  # when to retry: the server sends `Retry-After`
    stands_s: float = 0.0  # a refusal: how long it stands for the model's next requests
    hold_s: float = 0.0  # a refusal: how long the server waits before it answers it
    queued: bool = False  # a refusal of a request that had waited in its model's queue
    logged: bool = False  # logged where it arose, once per event: not again per request

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def refusal(self) -> bool:
        """A refusal: the request was fine but is not taken now (429, or 503 with a time
        to retry after), as a client's retry logic and the benchmarks count one."""
        return self.status_code == 429 or (self.status_code == 503
                                           and self.retry_after_s is not None)


class RequestError(DStackError):
    """The request is malformed or does not fit the model (400)."""

    status_code = 400
    reason = "rejected"


class ModelNotFound(RequestError):
    status_code = 404


class PayloadTooLarge(RequestError):
    status_code = 413


class Overloaded(DStackError):
    """The model's queue is full (429): retry later."""

    status_code = 429
    reason = "rejected"


class DeadlineRefused(DStackError):
    """The request can no longer be answered within its SLO, so it is refused now
    rather than served late (429)."""

    status_code = 429
    reason = "slo_refused"


class Unavailable(DStackError):
    """The server or model is not ready, or is shutting down (503)."""

    status_code = 503
    reason = "unavailable"


class BackendError(DStackError):
    """A worker failed or died while running the request (500)."""

    status_code = 500
    reason = "backend"
