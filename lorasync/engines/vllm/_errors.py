"""How vLLM's answers become typed ``lorasync.errors``: every message vLLM 0.32 sends, in one place.

vLLM's load failures come back as 400/404/500 whose only stable part is the message text, in one
of several envelopes (nested ``{"error": {...}}`` from 0.10.1, flat ``{"message": ...}`` before,
FastAPI's ``{"detail": ...}``, the auth middleware's bare string). The functions here read those
bodies and map status plus substring to the error class and a message that says what to do.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import httpx

from lorasync.engines._http import body_json, body_text
from lorasync.engines.vllm._protocol import LOAD_ROUTE, RUNTIME_ENV
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    AdapterRejectedError,
    EngineDeadError,
    EngineError,
    IncompatibleAdapterError,
    LoraNotEnabledError,
    RankTooLargeError,
    RuntimeLoraDisabledError,
)

if TYPE_CHECKING:
    from lorasync.engines._http import HTTPEngine

__all__ = [
    "dig",
    "disabled",
    "engine_dead",
    "generic",
    "load_error",
    "message_of",
    "route_missing",
    "unexpected",
    "worker_message",
]

RANK_REFUSAL = re.compile(r"LoRA rank (\d+) is greater than max_lora_rank (\d+)")
# Multiprocess executors wrap the worker's message: "... Worker failed with error '<msg>', please check ..."
WORKER_WRAPPER = re.compile(r"Worker failed with error '(.*)', please check", re.DOTALL)

# Substrings of vLLM's refusals of an adapter's content (peft_helper.py, lora_model.py, utils.py),
# each with what the user should do about it.
INCOMPATIBLE: tuple[tuple[str, str], ...] = (
    ("unsupported LoRA weight", "save with Adapter.save or PEFT save_pretrained (keys without '.default')"),
    ("expected target modules", "target only modules this model supports (the list is in the message)"),
    ("support DoRA", "export a plain LoRA adapter (use_dora=False)"),
    ("bias is not supported", "train the adapter with bias='none'"),
    ("LoRA bias", "train the adapter with lora_bias=False"),
    ("Missing required configuration fields", "write adapter_config.json with r, lora_alpha and target_modules"),
    ("does not support", "export a plain LoRA adapter without that feature"),
    ("only supports modules_to_save", "drop modules_to_save from the adapter"),
    ("must be a positive integer", "fix r / rank_pattern in adapter_config.json"),
)


def load_error(engine: HTTPEngine, response: httpx.Response, name: str, path: str, message: str, *, route: str = LOAD_ROUTE) -> EngineError:
    """The typed error for a refused load of ``name`` from ``path`` (vLLM's ``/v1/load_lora_adapter``,
    or the ``route`` that forwarded it there)."""
    context = engine.error_context(route, name, response)
    status = response.status_code
    where = f"{engine.kind} at {engine.url}"
    detail = worker_message(message)
    if route_missing(response):
        return disabled(engine, response, route, name)
    if "has already been loaded" in message:
        return AdapterAlreadyLoadedError(
            f"{where} already serves an adapter named {name!r}; publish under a new versioned name, "
            "unload it first, or pass load_inplace=True (re-read from disk every step on vLLM 0.32 and before, swapped under running requests on every release; see docs/engines/vllm.md)",
            **context,
        )
    if "conflicts with a served base model" in message:
        return IncompatibleAdapterError(
            f"{where} serves its base model under the name {name!r}; choose another adapter name",
            **context,
        )
    if "No adapter found" in message or "doesn't contain tensors" in message:
        return AdapterNotFoundError(
            f"{where} found no adapter at {path} ({detail}); the directory must exist on the engine's "
            "host and hold adapter_config.json and adapter_model.safetensors",
            path=path,
            **context,
        )
    rank = RANK_REFUSAL.search(message)
    if rank is not None or "is greater than max_lora_rank" in message:
        r, max_r = (int(rank.group(1)), int(rank.group(2))) if rank else (None, None)
        return RankTooLargeError(
            f"{where} refused adapter {name!r}: {detail}; restart vLLM with a larger --max-lora-rank "
            f"or train/trim the adapter to r <= {max_r if max_r is not None else 'the max rank'}",
            rank=r,
            max_rank=max_r,
            **context,
        )
    if "LoRA is not enabled" in message:
        return LoraNotEnabledError(
            f"{where} runs without LoRA; restart it with --enable-lora (and --max-lora-rank >= the "
            "adapter's rank), or publish with transport='merged'",
            **context,
        )
    for needle, fix in INCOMPATIBLE:
        if needle in message:
            return IncompatibleAdapterError(
                f"{where} refused adapter {name!r} from {path}: {detail}; {fix}", reason=detail, **context
            )
    if status >= 500 and "Call to add_lora method failed" in message and not engine_dead(message):
        return AdapterRejectedError(
            f"{where} failed to load adapter {name!r} from {path}: {detail}; check the adapter and the "
            "server log",
            reason=detail,
            **context,
        )
    return generic(engine, response, route, name, message, f"load of adapter {name!r} from {path}")


def disabled(engine: HTTPEngine, response: httpx.Response, route: str, name: str | None) -> RuntimeLoraDisabledError:
    """The server has no runtime LoRA routes (FastAPI's own 404 on ``route``)."""
    return RuntimeLoraDisabledError(
        f"{engine.kind} at {engine.url} has no runtime LoRA routes (HTTP 404 on {route}); restart the server "
        f"with {RUNTIME_ENV}=1 in its environment and --api-server-count 1",
        **engine.error_context(route, name, response),
    )


def generic(
    engine: HTTPEngine, response: httpx.Response, route: str, name: str | None, message: str, what: str
) -> EngineError:
    """Any other failure of ``what``: unavailable when the engine process died, else ``EngineError``."""
    context = engine.error_context(route, name, response)
    text = f"{engine.kind} at {engine.url}{route}: {what} failed with HTTP {response.status_code}: {message}"
    if response.status_code >= 500 and engine_dead(message):
        return EngineDeadError(
            f"{text}; vLLM's engine core died, so every request to it fails: restart the server (its log says why "
            "it died); the next publish after the restart loads the current version again",
            **context,
        )
    return EngineError(f"{text}; check the request and the server log", **context)


def unexpected(
    engine: HTTPEngine, response: httpx.Response, route: str, name: str | None, cls: type[EngineError], what: str
) -> EngineError:
    """An answer of a shape vLLM does not send (a proxy, another server): ``cls`` with the body's start."""
    return cls(
        f"{engine.kind} at {engine.url}{route}: unexpected answer to {what} (HTTP {response.status_code}): "
        f"{body_text(response)[:300]!r}; is this a vLLM OpenAI server?",
        **engine.error_context(route, name, response),
    )


# -- reading vLLM's error bodies ------------------------------------------------------------


def dig(value: Any, *keys: str | int) -> Any:
    """``value[k0][k1]...`` or None when any step is missing or of the wrong type."""
    for key in keys:
        if isinstance(key, int):
            if not isinstance(value, list) or not -len(value) <= key < len(value):
                return None
        elif not isinstance(value, dict):
            return None
        value = value[key] if isinstance(key, int) else value.get(key)
    return value


def message_of(response: httpx.Response) -> str:
    """The error text of any vLLM envelope: nested (>= 0.10.1), flat (older), FastAPI's detail,
    the auth middleware's bare string, or the raw body."""
    data = body_json(response)
    for candidate in (dig(data, "error", "message"), dig(data, "message"), dig(data, "detail"), dig(data, "error")):
        if isinstance(candidate, str) and candidate:
            return candidate
    return body_text(response).strip()[:500]


def worker_message(message: str) -> str:
    """The worker's own message inside vLLM's "Call to ... failed: Worker failed with error '...'" wrappers."""
    match = WORKER_WRAPPER.search(message)
    inner = match.group(1) if match else message.split("method failed: ", 1)[-1]
    return inner.rstrip(".")


def route_missing(response: httpx.Response) -> bool:
    """FastAPI's own 404 (no vLLM envelope): the route is not registered."""
    return response.status_code == 404 and dig(body_json(response), "detail") == "Not Found"


def engine_dead(message: str) -> bool:
    return any(s in message for s in ("EngineCore encountered an issue", "EngineDeadError", "Engine loop has died"))
