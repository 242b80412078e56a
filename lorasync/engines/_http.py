"""Shared machinery of HTTP engine clients: one logic, sync and async I/O.

An engine operation is written once as a generator that yields :class:`Call` objects and
receives ``httpx.Response`` objects back (no I/O inside). ``HTTPEngine._run`` drives it with a
sync ``httpx.Client``; ``_arun`` with an ``httpx.AsyncClient``. Both apply the same
:class:`RetryPolicy` (through tenacity) and translate httpx errors into ``lorasync.errors``.

Responses are never assumed to be JSON: vLLM answers plain text with no content type, several
routes answer an empty 200. Use :func:`body_json` / :func:`body_text`.

``timeout=`` bounds a whole request (connect, send, headers and body together), not one socket
read: a peer trickling a byte at a time cannot stretch it. The async client runs each attempt
under ``asyncio.timeout``; the sync client's connections carry the attempt's deadline into
every socket read and write (:mod:`lorasync.engines._deadline`). With retries, a call therefore ends
within about ``attempts * timeout`` plus the back-off.

Secrets (the API key, a URL's password and query) live in one
:class:`~lorasync.engines._credentials.Credentials`: checked before use, scrubbed in every form
(base64 in an echoed ``Authorization`` header, percent-encoded in an echoed path) from every
response body before an operation reads it and from every error this module translates. A
foreign exception that held one is not chained (its text would show it). A pickled client carries
no secret (see ``_credentials``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import ssl
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from lorasync.runtime._retry import RetryableStatus, RetryPolicy
from lorasync.engines._engine import Engine
from lorasync.engines._credentials import Credentials
from lorasync.engines._deadline import DEADLINE as _DEADLINE
from lorasync.engines._deadline import DeadlineBackend as _DeadlineBackend
from lorasync.errors import (
    AuthenticationError,
    ConfigError,
    EngineError,
    EngineTimeoutError,
    EngineUnavailableError,
    IncompatibleAdapterError,
)

__all__ = ["Call", "HTTPEngine", "Operation", "body_json", "body_text"]

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One HTTP request an operation wants sent."""

    method: str
    path: str
    json: Any = None
    params: dict[str, Any] | None = None
    retry: bool = True  # False for requests that must not be repeated blindly


Operation = Generator[Call, httpx.Response, T]


def body_text(response: httpx.Response) -> str:
    """The body as text whatever the content type (empty string for an empty body)."""
    return response.content.decode("utf-8", errors="replace")


def body_json(response: httpx.Response) -> Any | None:
    """The body parsed as JSON, or None when it is empty or not JSON (plain-text 200s)."""
    if not response.content.strip():
        return None
    try:
        return json.loads(response.content)
    except ValueError:
        return None


class HTTPEngine(Engine):
    """What the engine clients that talk HTTP subclass.

    Args:
        url (`str`): the server's URL, e.g. ``http://127.0.0.1:8000``. ``user:password@`` is
            sent as basic auth and a ``?query`` with every request; both count as secrets.
        api_key (`str`, *optional*): sent as ``Authorization: Bearer``; never logged, shown in
            ``repr`` or pickled. Defaults to the env var named by the class's ``api_key_env``.
        api_key_env (`str`, *optional*): the environment variable holding the key instead; the
            key is then required, and a pickled client reads it again from that variable in
            the process that unpickles it.
        timeout (`float`): seconds per request (loads can take a while on big adapters).
        retries (`RetryPolicy | int | None`): retry policy (see ``RetryPolicy``).
        transport / async_transport (`httpx` transports, *optional*): for tests or custom I/O.
    """

    api_key_env: str = ""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        api_key_env: str | None = None,
        timeout: float = 60.0,
        retries: RetryPolicy | int | None = None,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        # Credentials in the URL travel only as an Authorization header and query parameters:
        # ``url`` (shown in reprs, errors, reports and logs) never holds them.
        bare, self._credentials = Credentials.from_url(
            url, api_key=api_key, api_key_env=api_key_env, default_env=type(self).api_key_env
        )
        if api_key_env is not None:
            self.api_key_env = api_key_env  # named in messages about the key
        self.url = bare.rstrip("/")
        self.retry = RetryPolicy.from_value(retries)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds per request, got {timeout!r}")
        self.timeout = float(timeout)
        self._transport = transport
        self._async_transport = async_transport
        self._client: httpx.Client | None = None
        self._aclient: httpx.AsyncClient | None = None
        self._aclient_loop: asyncio.AbstractEventLoop | None = None

    # -- drivers --------------------------------------------------------------------------------

    # A failed call is thrown into the operation (``op.throw``), so an operation that opened a
    # server-side session can close it in ``finally``; uncaught, it propagates unchanged.

    def _run(self, op: Operation[T], *, adapter: str | None = None) -> T:
        try:
            call = next(op)
            while True:
                try:
                    response = self._send(call, adapter)
                except EngineError as exc:
                    call = op.throw(exc)
                else:
                    call = op.send(response)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except EngineError as exc:  # the operation's own errors may quote a response body
            if self._credentials.shows_in(exc.message):
                raise self._scrubbed(exc, exc.__cause__) from None
            raise

    async def _arun(self, op: Operation[T], *, adapter: str | None = None) -> T:
        try:
            call = next(op)
            while True:
                try:
                    response = await self._asend(call, adapter)
                except EngineError as exc:
                    call = op.throw(exc)
                else:
                    call = op.send(response)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except EngineError as exc:  # the operation's own errors may quote a response body
            if self._credentials.shows_in(exc.message):
                raise self._scrubbed(exc, exc.__cause__) from None
            raise

    def _send(self, call: Call, adapter: str | None) -> httpx.Response:
        self._check_credentials(call, adapter)
        client = self._sync_client()
        policy = self.retry if call.retry else RetryPolicy(attempts=1)
        attempts = 0
        try:
            for attempt in policy.retrying():
                with attempt:
                    attempts += 1
                    _DEADLINE.at = time.monotonic() + self.timeout  # read by _DeadlineStream
                    try:
                        response = client.request(call.method, call.path, json=call.json, params=call.params)
                    finally:
                        _DEADLINE.at = None
                    self._credentials.scrub_response(response)  # before anything quotes it
                    self._raise_retryable(response)
        except Exception as exc:  # translated below
            raise self._scrubbed(self._translate(exc, call, adapter, attempts), exc)  # noqa: B904 - chained there
        return self._checked(response, call, adapter, attempts)

    async def _asend(self, call: Call, adapter: str | None) -> httpx.Response:
        self._check_credentials(call, adapter)
        client = self._async_client()
        policy = self.retry if call.retry else RetryPolicy(attempts=1)
        attempts = 0
        try:
            async for attempt in policy.async_retrying():
                with attempt:
                    attempts += 1
                    try:
                        async with asyncio.timeout(self.timeout) as limit:
                            response = await client.request(call.method, call.path, json=call.json, params=call.params)
                    except TimeoutError as exc:
                        if not limit.expired():
                            raise
                        # As httpx reports its own timeouts, so retries and errors treat it alike.
                        raise httpx.ReadTimeout(f"no complete answer within {self.timeout}s") from exc
                    self._credentials.scrub_response(response)  # before anything quotes it
                    self._raise_retryable(response)
        except Exception as exc:
            raise self._scrubbed(self._translate(exc, call, adapter, attempts), exc)  # noqa: B904 - chained there
        return self._checked(response, call, adapter, attempts)

    def _check_credentials(self, call: Call, adapter: str | None) -> None:
        """Refuse to send anything without the credentials this client was built with (a
        client unpickled in another process gets no literal secret).

        Raises:
            AuthenticationError: a secret is missing in this process; nothing was sent.
        """
        withheld = self._credentials.withheld
        if withheld:
            raise AuthenticationError(
                f"{self.kind} at {self.url}{call.path}: nothing was sent, this client lacks its credentials here "
                f"({'; '.join(withheld)}). Pass the key through the environment (api_key_env='NAME', or "
                f"${type(self).api_key_env}) and set it in this process, or build the engine in the process "
                "that uses it: secrets never travel in a pickle",
                **self._context(call, adapter, 0),
            )

    def _scrubbed(self, error: EngineError, cause: BaseException | None) -> EngineError:
        """``error`` with secrets removed from its message and context, chained to ``cause``
        only when no secret shows in the cause's text either."""
        if not self._credentials.forms:
            error.__cause__ = cause
            return error
        if self._credentials.shows_in(error.message):
            error.message = self._credentials.scrub(error.message)
            error.args = (error.message,)
        for key, value in list(error.context.items()):
            if isinstance(value, str) and value != self._credentials.scrub(value):
                error.context[key] = self._credentials.scrub(value)
                setattr(error, key, error.context[key])
        leaks = cause is not None and any(self._credentials.shows_in(text) for text in (str(cause), repr(cause.args)))
        error.__cause__ = None if leaks else cause
        error.__suppress_context__ = True
        return error

    def _raise_retryable(self, response: httpx.Response) -> None:
        if self.retry.should_retry_status(response.status_code):
            raise RetryableStatus(response)

    def _context(self, call: Call, adapter: str | None, attempts: int, status: int | None = None) -> dict[str, Any]:
        return {
            "engine": self.kind,
            "url": f"{self.url}{call.path}",
            "adapter": adapter,
            "attempts": attempts,
            "status": status,
        }

    def _translate(self, exc: Exception, call: Call, adapter: str | None, attempts: int) -> EngineError:
        where = f"{self.kind} at {self.url}{call.path}" + (f" (adapter {adapter!r})" if adapter else "")
        tries = f"after {attempts} attempt{'s' if attempts != 1 else ''}"
        if isinstance(exc, RetryableStatus):
            status = exc.response.status_code
            text = body_text(exc.response)[:300]
            return EngineUnavailableError(
                f"{where} kept answering HTTP {status} {tries}: {text!r}; check the engine's health and logs",
                **self._context(call, adapter, attempts, status),
            )
        if isinstance(exc, httpx.TimeoutException):
            return EngineTimeoutError(
                f"{where} did not answer within {self.timeout}s {tries}; raise timeout= or check the engine",
                **self._context(call, adapter, attempts),
            )
        if isinstance(exc, httpx.TransportError):
            return EngineUnavailableError(
                f"cannot reach {where} {tries}: {type(exc).__name__}: {exc}; is the server running and the URL right?",
                **self._context(call, adapter, attempts),
            )
        if isinstance(exc, EngineError):
            return exc
        return EngineError(f"{where} failed {tries}: {type(exc).__name__}: {exc}", **self._context(call, adapter, attempts))

    def _checked(self, response: httpx.Response, call: Call, adapter: str | None, attempts: int) -> httpx.Response:
        if response.status_code in (401, 403):
            raise AuthenticationError(
                f"{self.kind} at {self.url}{call.path} refused the credentials (HTTP {response.status_code}); "
                f"pass api_key= (or set {self.api_key_env or 'the API key'}) to match the server's --api-key",
                **self._context(call, adapter, attempts, response.status_code),
            )
        response.extensions["lorasync_attempts"] = attempts
        return response

    def refuse_extra_weights(self, name: str, path: str, route: str) -> None:
        """Refuse, before sending, a local adapter directory holding ``*.safetensors`` files
        besides ``adapter_model.safetensors``: SGLang loads them all, and no engine should get a
        directory lorasync itself would not load. Remote paths (not visible here) pass.

        Raises:
            IncompatibleAdapterError: extra weight files in ``path``.
        """
        from lorasync.adapter._adapter import extra_weight_files

        extras = extra_weight_files(path) if os.path.isdir(path) else []
        if extras:
            raise IncompatibleAdapterError(
                f"{path} holds weight files besides adapter_model.safetensors: {extras}; nothing was sent to "
                f"{self.kind} at {self.url}. Save the adapter to a directory of its own (Adapter.save)",
                engine=self.kind,
                url=f"{self.url}{route}",
                adapter=name,
                path=path,
            )

    def error_context(self, call_path: str, adapter: str | None, response: httpx.Response) -> dict[str, Any]:
        """Context for errors an engine raises after inspecting a response."""
        return {
            "engine": self.kind,
            "url": f"{self.url}{call_path}",
            "adapter": adapter,
            "attempts": response.extensions.get("lorasync_attempts", 1),
            "status": response.status_code,
        }

    # -- clients --------------------------------------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        """What the sync and async clients share."""
        return {
            "base_url": self.url,
            "headers": self._credentials.headers,
            "auth": self._credentials.auth,
            "params": self._credentials.params,
            "timeout": self.timeout,
            "verify": _ssl_context(),
        }

    def _sync_client(self) -> httpx.Client:
        if self._client is None:
            transport = self._transport
            if transport is None:
                # httpx's own transport, its connections given the attempt's total deadline.
                # A caller's transport= (tests, custom I/O) is used as it is.
                transport = httpx.HTTPTransport(verify=_ssl_context())
                pool = transport._pool  # httpx exposes no network_backend= option
                pool._network_backend = _DeadlineBackend(pool._network_backend)
            self._client = httpx.Client(transport=transport, **self._client_options())
        return self._client

    def _async_client(self) -> httpx.AsyncClient:
        # An AsyncClient is bound to the loop that first used it; a new loop (asyncio.run in the
        # caller's code) gets a new client. Publishers keep one loop, so theirs persist.
        loop = asyncio.get_running_loop()
        if self._aclient is not None and self._aclient_loop is not loop:
            self._aclient = None
        self._aclient_loop = loop
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(transport=self._async_transport, **self._client_options())
        return self._aclient

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def aclose(self) -> None:
        self.close()
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None

    def __repr__(self) -> str:
        auth = ", api_key=***" if self._credentials else ""
        return f"{type(self).__name__}(url={self.url!r}{auth})"

    @property
    def _auth(self) -> httpx.BasicAuth | None:
        """Basic auth from the URL's userinfo (what the clients send)."""
        return self._credentials.auth

    def __getstate__(self) -> dict[str, Any]:
        # Open connections stay with this process (a copy builds its own on first use); the
        # credentials pickle without their secrets (Credentials.__reduce__).
        state = self.__dict__.copy()
        state.update(_client=None, _aclient=None, _aclient_loop=None)
        return state


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """One default SSL context per process: building one loads the CA bundle (16-33 ms here),
    and every new event loop needs a new AsyncClient."""
    return httpx.create_ssl_context()
