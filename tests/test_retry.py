"""RetryPolicy decisions and schedule, exercised without any I/O."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import httpx
import pytest
import tenacity

from lorasync import RetryPolicy
from lorasync.runtime._retry import RetryableStatus
from lorasync.errors import ConfigError, EngineUnavailableError

REQUEST = httpx.Request("POST", "http://127.0.0.1:8000/v1/load_lora_adapter")


def status(code: int) -> RetryableStatus:
    return RetryableStatus(httpx.Response(code, request=REQUEST))


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused", request=REQUEST),
        httpx.ConnectTimeout("slow connect", request=REQUEST),
        httpx.ReadTimeout("slow answer", request=REQUEST),
        httpx.WriteTimeout("slow upload", request=REQUEST),
        httpx.PoolTimeout("pool full", request=REQUEST),
        httpx.ReadError("reset", request=REQUEST),
        httpx.WriteError("broken pipe", request=REQUEST),
        httpx.RemoteProtocolError("server closed without a response", request=REQUEST),
        status(502),
        status(503),
        status(504),
    ],
    ids=lambda e: type(e).__name__ + (str(e) if isinstance(e, RetryableStatus) else ""),
)
def test_transient_failures_are_retried(error: BaseException) -> None:
    assert RetryPolicy().should_retry(error)


@pytest.mark.parametrize(
    "error",
    [
        httpx.UnsupportedProtocol("ftp://", request=REQUEST),
        httpx.LocalProtocolError("illegal header", request=REQUEST),
        httpx.HTTPStatusError("404", request=REQUEST, response=httpx.Response(404, request=REQUEST)),
        httpx.InvalidURL("no host"),
        httpx.DecodingError("bad gzip", request=REQUEST),
        httpx.TooManyRedirects("loop", request=REQUEST),
        status(500),
        status(501),
        status(400),
        status(429),
        ValueError("a bug"),
        EngineUnavailableError("already translated"),
        KeyboardInterrupt(),
    ],
    ids=lambda e: type(e).__name__ + (str(e) if isinstance(e, RetryableStatus) else ""),
)
def test_other_failures_are_final(error: BaseException) -> None:
    assert not RetryPolicy().should_retry(error)


def test_status_decisions_follow_statuses() -> None:
    policy = RetryPolicy(statuses=frozenset({500, 503}))
    codes = (200, 400, 401, 404, 409, 429, 500, 502, 503, 504)
    assert [s for s in codes if policy.should_retry_status(s)] == [500, 503]
    assert policy.should_retry(status(500)) and not policy.should_retry(status(502))


@pytest.mark.parametrize("statuses", [{429}, {503, 408}, {400, 499}])
def test_4xx_statuses_are_refused(statuses: set[int]) -> None:
    with pytest.raises(ConfigError, match="4xx statuses are never retried") as info:
        RetryPolicy(statuses=frozenset(statuses))
    assert str(min(s for s in statuses if s < 500)) in str(info.value)


@pytest.mark.parametrize("statuses", [{"503"}, {True}, {700}, {99}])
def test_non_status_values_are_refused(statuses: set[object]) -> None:
    with pytest.raises(ConfigError, match="HTTP status ints"):
        RetryPolicy(statuses=frozenset(statuses))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"attempts": 0}, {"backoff": -1.0}, {"backoff_max": -0.1}, {"jitter": -0.01}]
)
def test_bad_numbers_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_from_value_normalises() -> None:
    custom = RetryPolicy(attempts=2)
    assert RetryPolicy.from_value(None) == RetryPolicy()
    assert RetryPolicy.from_value(custom) is custom
    assert RetryPolicy.from_value(0).attempts == 1  # no retry
    assert RetryPolicy.from_value(3).attempts == 4  # three retries after the first try
    for bad in (True, "3", 2.5, -1):
        with pytest.raises(ConfigError):
            RetryPolicy.from_value(bad)  # type: ignore[arg-type]


def _bounds(policy: RetryPolicy, retry: int) -> tuple[float, float]:
    base = min(policy.backoff_max, policy.backoff * 2 ** (retry - 1))
    return base, base + policy.jitter


def _wait(policy: RetryPolicy, retry: int) -> float:
    """Seconds tenacity (what the HTTP drivers run) waits before retry ``retry`` (1-based)."""
    state = tenacity.RetryCallState(retry_object=policy.retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = retry
    return float(policy.retrying().wait(state))


def test_wait_schedule_is_exponential_capped_and_jittered() -> None:
    policy = RetryPolicy(backoff=0.1, backoff_max=1.0, jitter=0.05)
    random.seed(0)
    for retry in range(1, 40):
        low, high = _bounds(policy, retry)
        waits = [_wait(policy, retry) for _ in range(20)]
        assert all(low <= w <= high <= 1.05 for w in waits), retry
        assert len(set(waits)) > 1  # jittered: concurrent clients do not retry in lockstep
    assert _wait(policy, 5000) <= 1.05  # huge retry numbers neither overflow nor grow
    exact = RetryPolicy(backoff=0.1, backoff_max=1.0, jitter=0.0)
    assert [_wait(exact, n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def _flaky(failures: list[BaseException]) -> tuple[Callable[[], str], list[int]]:
    calls: list[int] = []

    def attempt() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return "ok"

    return attempt, calls


def test_tenacity_executes_the_policy() -> None:
    policy = RetryPolicy(attempts=4, backoff=0.1, backoff_max=0.3, jitter=0.05)
    sleeps: list[float] = []
    retrying = policy.retrying().copy(sleep=sleeps.append)

    attempt, calls = _flaky([httpx.ConnectError("refused", request=REQUEST)] * 10)
    with pytest.raises(httpx.ConnectError):  # reraise: the caller sees the last real error
        retrying(attempt)
    assert len(calls) == 4 and len(sleeps) == 3
    for retry, slept in enumerate(sleeps, start=1):
        low, high = _bounds(policy, retry)
        assert low <= slept <= high

    sleeps.clear()
    attempt, calls = _flaky([status(503), status(502)])
    assert retrying(attempt) == "ok" and len(calls) == 3 and len(sleeps) == 2

    sleeps.clear()
    attempt, calls = _flaky([status(500)])
    with pytest.raises(RetryableStatus):
        retrying(attempt)
    assert len(calls) == 1 and sleeps == []


def test_async_tenacity_executes_the_policy() -> None:
    policy = RetryPolicy(attempts=3, backoff=0.0, jitter=0.0)
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    calls: list[int] = []

    async def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise httpx.ReadTimeout("slow", request=REQUEST)
        return "ok"

    retrying = policy.async_retrying().copy(sleep=fake_sleep)
    assert asyncio.run(retrying(attempt)) == "ok"
    assert len(calls) == 3 and sleeps == [0.0, 0.0]
