"""The AIBrix runtime sidecar's side of :mod:`lorasync.engines.aibrix`: its routes, its HTTP client
(which holds no key and says what a refusal it relays means), and the readings of its answers and
of the adapter a refused load named."""

from __future__ import annotations

import json
import os
import stat
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from lorasync.engines._http import Call, HTTPEngine, Operation, body_json
from lorasync.engines.vllm._errors import dig
from lorasync.errors import AuthenticationError

__all__ = ["SIDECAR_LOAD", "SIDECAR_PORT", "SIDECAR_READY", "SIDECAR_UNLOAD", "Sidecar", "bases", "config_rank", "default_sidecar"]

SIDECAR_PORT = 8080  # aibrix_runtime's default --port
SIDECAR_LOAD = "/v1/lora_adapter/load"
SIDECAR_UNLOAD = "/v1/lora_adapter/unload"
SIDECAR_READY = "/ready"
def default_sidecar(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return urlunsplit((parts.scheme or "http", f"{host}:{SIDECAR_PORT}", "", "", ""))


class Sidecar(HTTPEngine):
    """The sidecar's HTTP client: one request at a time, its answer handed back unread. It holds
    no key: the sidecar asks none, and reaches vLLM with its own (``INFERENCE_ENGINE_API_KEY``)."""

    kind = "aibrix-sidecar"

    def _ask(self, method: str, path: str, body: Any = None, *, retry: bool = True) -> Operation[httpx.Response]:
        return (yield Call(method, path, json=body, retry=retry))

    def _checked(self, response: httpx.Response, call: Call, adapter: str | None, attempts: int) -> httpx.Response:
        if response.status_code in (401, 403):  # vLLM's refusal, relayed: the sidecar sent vLLM no key, or another
            raise AuthenticationError(
                f"the AIBrix sidecar at {self.url} was refused by its vLLM (HTTP {response.status_code}): start "
                "aibrix_runtime with INFERENCE_ENGINE_API_KEY set to the server's --api-key (the sidecar sends vLLM its "
                "own key, never the caller's)",
                **self.error_context(call.path, adapter, response),
            )
        return super()._checked(response, call, adapter, attempts)


def config_rank(path: str) -> int | None:
    """The largest rank ``adapter_config.json`` in ``path`` names (``r``, ``rank_pattern``), if it is
    a regular file readable here; never blocks (a FIFO there is not read) and never raises."""
    try:
        fd = os.open(os.path.join(path, "adapter_config.json"), os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            config = json.loads(f.read(1 << 20))
        ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
        return max(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None
    finally:
        os.close(fd)


def bases(response: httpx.Response) -> set[tuple[Any, Any]]:
    """(id, root) of the base models (cards without a parent) of a ``/v1/models`` answer."""
    cards = dig(body_json(response), "data") if response.status_code == 200 else None
    # As text: a card may carry any JSON there (an object is not hashable).
    return {(str(c.get("id")), str(c.get("root"))) for c in cards or [] if isinstance(c, dict) and not c.get("parent")}
