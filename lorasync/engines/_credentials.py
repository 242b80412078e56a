"""Credentials of an engine URL and API key, checked before use and never shown or pickled.

Used by :mod:`lorasync.engines._http`; nothing here logs or formats a secret into a message.

One :class:`Credentials` object per HTTP client holds every secret it sends: the API key
(``Authorization: Bearer``), the URL's ``user:password@`` (``Authorization: Basic``) and the URL's
query parameters (``?token=``, ``?key=``... sent with every request). It also knows every form a
secret takes on the wire, so an engine quoting a request back (its path, its ``Authorization``
header, JSON-escaped) is scrubbed as thoroughly as the literal value.

A pickled ``Credentials`` carries no secret. A key read from an environment variable is read
again, from that variable, where it is unpickled; anything given literally (``api_key=``, a URL
password or query) is withheld, and the client refuses its first request with a message saying
how to pass the secret in that process.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
import weakref
from typing import Any
from urllib.parse import quote, unquote

import httpx

from lorasync.errors import ConfigError

__all__ = ["Credentials", "clean_key", "split_userinfo"]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def clean_key(key: str | None, origin: str) -> str | None:
    """The API key without the whitespace a key file or ``echo`` leaves around it.

    Raises:
        ConfigError: control or non-ASCII characters inside the key (the key is not shown).
    """
    if key is None:
        return None
    key = key.strip()
    if any(not (0x21 <= ord(c) <= 0x7E) for c in key):
        raise ConfigError(
            f"the API key from {origin} contains spaces, control or non-ASCII characters inside it (not shown); "
            "pass the exact key the server was started with (--api-key), one line, no quotes"
        )
    return key or None


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """``(url without credentials, user, password)``; user/password percent-decoded.

    The credentials end at the last ``@`` of the authority, so a password may hold ``#``, ``/``,
    ``?`` or ``@`` unencoded (a standard parser would end the authority early and take part of the
    password for a host or port). A URL with ``@`` in its path is not supported.

    Raises:
        ConfigError: a URL that is still invalid once the credentials are out (never shown
            with them).
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"engine URL must be a non-empty string such as 'http://127.0.0.1:8000', got {url!r}")
    scheme, sep, rest = url.partition("://")
    user = password = None
    if sep and "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        name, colon, secret = userinfo.partition(":")
        user, password = unquote(name), (unquote(secret) if colon else "")
        url = f"{scheme}://{rest}"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        shown = str(exc).replace(password, "***") if password else str(exc)
        raise ConfigError(
            f"invalid engine URL {_without_query(url)!r} ({_without_query(shown)}); "
            "use http://host:port (credentials, if any, as user:password@)"
        ) from None
    if parsed.userinfo:  # only possible without "://" handling above: keep it out of the URL
        user, password = parsed.username, parsed.password
        parsed = parsed.copy_with(userinfo=b"")
    # httpx takes these and fails only at the first request, with an error that names none of it.
    shown = _without_query(str(parsed))
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"engine URL {shown!r} needs a scheme and a host, like 'http://127.0.0.1:8000' (http:// or https://)")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ConfigError(f"engine URL {shown!r} has port {parsed.port}, outside 1-65535; use the port the server listens on")
    return str(parsed), user, password


def _without_query(text: str) -> str:
    # For messages about a URL that did not parse: its query may hold a token.
    head, mark, _ = text.partition("?")
    return head + ("?***" if mark else "")


class Credentials:
    """Every secret one HTTP engine client sends, and every form it may be quoted back in.

    Build it with :meth:`from_url`. ``repr`` shows none of it; ``copy``/``deepcopy`` share it
    (same process); pickling drops it (see the module docstring).
    """

    def __init__(
        self,
        *,
        key: str | None = None,
        key_env: str | None = None,
        key_required: bool = False,
        key_literal: bool = False,
        user: str | None = None,
        password: str | None = None,
        params: list[tuple[str, str]] | None = None,
        lost: tuple[str, ...] = (),
        problem: str | None = None,
    ) -> None:
        self._key = key
        self._key_env = key_env  # where the key is read again after unpickling (None: literal)
        self._key_required = key_required  # api_key_env= named it, or the key came from it
        self._key_literal = key_literal
        self._user = user
        self._password = password
        self._params = list(params or ())
        self._lost = lost  # literal secrets a pickle left behind (kept through further pickles)
        missing = () if key or not (key_env and key_required) else (problem or f"${key_env} is not set in this process",)
        #: What this process lacks, each entry saying what; non-empty: the client sends nothing.
        self.withheld: tuple[str, ...] = (*missing, *lost)
        self.forms = self._wire_forms()
        if self._params:
            _LogScrub.watch(self)

    @classmethod
    def from_url(cls, url: str, *, api_key: str | None, api_key_env: str | None, default_env: str) -> tuple[str, Credentials]:
        """``(url without userinfo or query, credentials)``.

        Args:
            url (`str`): the engine URL, perhaps with ``user:password@`` and ``?name=value``.
            api_key (`str`, *optional*): a literal key (never pickled).
            api_key_env (`str`, *optional*): the environment variable holding the key; a key
                is then required, and read again from that variable where the client is unpickled.
            default_env (`str`): the client's standard variable (``VLLM_API_KEY``...), read
                when neither of the above is given.

        Raises:
            ConfigError: both ``api_key`` and ``api_key_env``, an invalid variable name, an
                invalid URL, or a key with characters no server accepts.
        """
        if api_key is not None and api_key_env is not None:
            raise ConfigError("pass api_key= or api_key_env= (the name of a variable holding it), not both")
        if api_key_env is not None and (not isinstance(api_key_env, str) or not _ENV_NAME.fullmatch(api_key_env)):
            raise ConfigError(f"api_key_env must name an environment variable (e.g. 'VLLM_API_KEY'), got {api_key_env!r}")
        bare, user, password = split_userinfo(url)
        parsed = httpx.URL(bare)
        params = parsed.params.multi_items()  # a repeated name keeps each of its values
        if parsed.query or parsed.fragment:
            # A query is sent with every request, never left in the URL: routes are appended
            # to the URL, and the URL is shown in reprs, errors, reports and logs.
            bare = str(parsed.copy_with(query=None, fragment=None))
        if api_key is not None:
            key = clean_key(api_key, "api_key=")
            return bare, cls(key=key, key_literal=key is not None, user=user, password=password, params=params)
        env = api_key_env or default_env
        key = clean_key(os.environ.get(env), f"${env}") if env else None
        credentials = cls(
            key=key, key_env=env or None, key_required=api_key_env is not None, user=user, password=password, params=params
        )
        return bare, credentials

    # -- what the client sends ------------------------------------------------------------------

    @property
    def headers(self) -> dict[str, str]:
        """``Authorization: Bearer`` for the API key (a URL's user:password takes precedence, as
        httpx applies ``auth`` after default headers)."""
        return {"Authorization": f"Bearer {self._key}"} if self._key else {}

    @property
    def auth(self) -> httpx.BasicAuth | None:
        """Basic auth from the URL's userinfo."""
        return httpx.BasicAuth(self._user, self._password or "") if self._user is not None else None

    @property
    def params(self) -> list[tuple[str, str]]:
        """The URL's query parameters, sent with every request."""
        return list(self._params)

    def __bool__(self) -> bool:
        return bool(self._key or self._user is not None or self._params or self.withheld)

    # -- what must never show -------------------------------------------------------------------

    def _wire_forms(self) -> tuple[str, ...]:
        values = [v for v in (self._key, self._password, *(value for _, value in self._params)) if v]
        forms: set[str] = set()
        for value in values:
            forms.add(value)
            forms.add(quote(value, safe=""))  # percent-encoded (a quoted URL)
            forms.add(str(httpx.QueryParams({"k": value}))[2:])  # as httpx puts it in the query
            forms.add(json.dumps(value)[1:-1])  # JSON-escaped (a JSON error body)
        if self._user is not None and self._password:
            # The Authorization header an engine may echo: base64(user:password), as httpx builds it.
            forms.add(base64.b64encode(f"{self._user}:{self._password}".encode()).decode())
        # Longest first, so a form containing another is replaced whole.
        return tuple(sorted((f for f in forms if f), key=len, reverse=True))

    def scrub(self, text: str) -> str:
        """``text`` with every form of every secret replaced by ``***``."""
        for form in self.forms:
            text = text.replace(form, "***")
        return text

    def shows_in(self, text: str) -> bool:
        """Whether any form of any secret appears in ``text``."""
        return any(form in text for form in self.forms)

    def scrub_response(self, response: httpx.Response) -> None:
        """Scrub a (read) response body in place, before any operation quotes or parses it: a
        hostile or buggy engine may echo the request (path, query, headers) in any answer."""
        content = response.content
        changed = content
        for form in self.forms:
            changed = changed.replace(form.encode(), b"***")
        if changed != content:
            response._content = changed  # httpx keeps the read body there; no public setter

    def __repr__(self) -> str:
        return "Credentials(***)" if self else "Credentials()"

    # -- copies and pickles -------------------------------------------------------------------------

    def __copy__(self) -> Credentials:
        return self  # immutable, same process: a copy may use the secret

    def __deepcopy__(self, memo: dict[int, Any]) -> Credentials:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # No secret in the pickle: only where to read the key again, and what was left behind.
        lost = list(self._lost)
        if self._key_literal:
            lost.append("the API key given as api_key=")
        if self._user is not None:
            lost.append("the user:password in the engine URL")
        if self._params:
            lost.append("the query of the engine URL (?name=value)")
        required = bool(self._key_env and (self._key or self._key_required))
        return (_unpickled, (self._key_env, required, tuple(dict.fromkeys(lost))))


def _unpickled(key_env: str | None, key_required: bool, lost: tuple[str, ...]) -> Credentials:
    """Rebuild credentials where they were unpickled: the key from its variable, nothing else."""
    key = problem = None
    if key_env:
        try:
            key = clean_key(os.environ.get(key_env), f"${key_env}")
        except ConfigError as exc:  # a broken variable here: refused at first use, not in pickle.loads
            key_required, problem = True, exc.message
    return Credentials(key=key, key_env=key_env, key_required=key_required, lost=lost, problem=problem)


class _LogScrub(logging.Filter):
    """Scrubs query secrets from httpx's own request log (``HTTP Request: GET <url with query>``),
    which lorasync does not write but a user's INFO logging shows."""

    _live: weakref.WeakSet[Credentials] = weakref.WeakSet()
    _lock = threading.Lock()
    _installed = False

    @classmethod
    def watch(cls, credentials: Credentials) -> None:
        with cls._lock:
            cls._live.add(credentials)
            if not cls._installed:
                logging.getLogger("httpx").addFilter(cls())
                cls._installed = True

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            live = list(self._live)
        if not live:
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's business, not ours
            return True
        scrubbed = text
        for credentials in live:
            scrubbed = credentials.scrub(scrubbed)
        if scrubbed != text:
            record.msg, record.args = scrubbed, None
        return True
