"""RetryPolicy: which failures are retried and how long to wait, as an immutable value.

The policy decides; tenacity executes (``policy.retrying()`` / ``policy.async_retrying()``).
Connection errors, timeouts and 502/503/504 are retried with bounded, jittered exponential
backoff; every 4xx and any other status is final. Tests exercise the decisions with no I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
import tenacity

from lorasync.errors import ConfigError

__all__ = ["RetryPolicy", "RetryableStatus"]

log = logging.getLogger(__name__)


def _log_retry(state: tenacity.RetryCallState) -> None:
    """tenacity ``before_sleep``: one INFO line per retry, naming the failure and the wait."""
    outcome = state.outcome
    error = outcome.exception() if outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    log.info("attempt %d failed (%s: %s); retrying in %.2f s", state.attempt_number, type(error).__name__, error, wait)


class RetryableStatus(Exception):
    """Raised inside an attempt when the engine answered a retryable status."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


@dataclass(frozen=True)
class RetryPolicy:
    """How an engine client retries one request.

    Args:
        attempts: total tries including the first (1 = no retry).
        backoff: first wait in seconds; doubles each retry.
        backoff_max: cap of one wait.
        jitter: up to this many seconds of random wait added to each.
        statuses: HTTP statuses retried (never 4xx).
    """

    attempts: int = 4
    backoff: float = 0.05
    backoff_max: float = 2.0
    jitter: float = 0.05
    statuses: frozenset[int] = field(default_factory=lambda: frozenset({502, 503, 504}))

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"attempts must be >= 1, got {self.attempts}")
        if self.backoff < 0 or self.backoff_max < 0 or self.jitter < 0:
            raise ConfigError("backoff, backoff_max and jitter must be >= 0")
        if any(not isinstance(s, int) or isinstance(s, bool) or not 100 <= s <= 599 for s in self.statuses):
            raise ConfigError(f"statuses must be HTTP status ints (100-599), got {sorted(map(repr, self.statuses))}")
        bad = sorted(s for s in self.statuses if 400 <= s < 500)
        if bad:
            raise ConfigError(f"4xx statuses are never retried (a retry cannot fix the request): {bad}")
        object.__setattr__(self, "statuses", frozenset(self.statuses))

    @classmethod
    def from_value(cls, value: RetryPolicy | int | None) -> RetryPolicy:
        """Normalise ``retries=`` arguments: a policy, a number of retries, or None (default)."""
        if value is None:
            return cls()
        if isinstance(value, RetryPolicy):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(attempts=value + 1)
        raise ConfigError(f"retries must be a RetryPolicy, an int or None, got {value!r}")

    def should_retry(self, error: BaseException) -> bool:
        """True when a failed attempt may be tried again."""
        if isinstance(error, RetryableStatus):
            return error.response.status_code in self.statuses
        # A bad URL scheme or a request this client itself cannot encode fails the same way again.
        final = (httpx.UnsupportedProtocol, httpx.LocalProtocolError)
        return isinstance(error, httpx.TransportError) and not isinstance(error, final)

    def should_retry_status(self, status: int) -> bool:
        return status in self.statuses

    def _kwargs(self) -> dict[str, Any]:
        return {
            "stop": tenacity.stop_after_attempt(self.attempts),
            "wait": tenacity.wait_exponential(multiplier=self.backoff, max=self.backoff_max)
            + tenacity.wait_random(0, self.jitter),
            "retry": tenacity.retry_if_exception(self.should_retry),
            "before_sleep": _log_retry,
            "reraise": True,
        }

    def retrying(self) -> tenacity.Retrying:
        """A tenacity ``Retrying`` that executes this policy (``reraise=True``)."""
        return tenacity.Retrying(**self._kwargs())

    def async_retrying(self) -> tenacity.AsyncRetrying:
        return tenacity.AsyncRetrying(**self._kwargs())
