"""An ASGI middleware for vLLM's server that puts its admin routes behind the API key.

Why: vLLM 0.32's ``--api-key`` checks only paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``). Everything
``VLLM_SERVER_DEV_MODE=1`` adds — ``/collective_rpc`` (runs any worker method by name, the
route lorasync's tensor and merged transports use), ``/server_info`` (the full config),
``/pause``, ``/resume``, ``/sleep``, ``/wake_up``, ``/reset_prefix_cache`` and the RL routes —
answers anyone who reaches the port. This guard refuses with 401, without the key, every path
except a short read-only allowlist, so routes added by later vLLM versions are guarded too.

Use (the key comes from the environment, since vLLM builds middleware classes without
arguments; vLLM itself also takes its ``--api-key`` from ``VLLM_API_KEY``)::

    VLLM_API_KEY=... VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 \\
    vllm serve MODEL --enable-lora --api-server-count 1 \\
        --worker-extension-cls lorasync.engines.vllm_worker.LoraSyncWorkerExtension \\
        --middleware lorasync.engines.vllm.guard.AdminRouteGuard

and ``connect("vllm", url, api_key=...)`` (or ``$VLLM_API_KEY``) on the trainer's side. The
module imports only the standard library: it runs inside vLLM's API server.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["KEY_ENV", "OPEN_PATHS", "AdminRouteGuard"]

#: Environment variables holding the key, first set wins (vLLM's own first).
KEY_ENV = ("VLLM_API_KEY", "LORASYNC_VLLM_ADMIN_KEY")
#: Read-only paths left open: health checks, version, Prometheus scraping.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load"})

_Receive = Callable[[], Awaitable[dict[str, Any]]]
_Send = Callable[[dict[str, Any]], Awaitable[None]]


class AdminRouteGuard:
    """Require ``Authorization: Bearer <key>`` on every path but :data:`OPEN_PATHS`.

    Args:
        app: the ASGI app (vLLM passes it).

    Raises:
        RuntimeError: no key in :data:`KEY_ENV` — starting an unguarded server by mistake is
            worse than not starting.
    """

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        key = next((os.environ[name] for name in KEY_ENV if os.environ.get(name)), "")
        if not key:
            raise RuntimeError(
                f"lorasync AdminRouteGuard needs the API key in ${KEY_ENV[0]} (or ${KEY_ENV[1]}); set it in the "
                "server's environment"
            )
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope: dict[str, Any], receive: _Receive, send: _Send) -> None:
        if scope.get("type") not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "") or ""))
        if path in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
