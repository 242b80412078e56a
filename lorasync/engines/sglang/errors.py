"""SGLang's answers, translated once into typed ``lorasync.errors``.

SGLang's LoRA routes answer ``{"success", "error_message", "loaded_adapters"}`` with 200 or 400,
its weight routes ``{"success", "message"}``; the error text is the only discriminator, so it is
matched here, in one place. Every function returns the error (the caller raises it), with the
``context`` the client built for the response (engine, url, adapter, attempts, status).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    AdapterRejectedError,
    CapabilityError,
    CapacityError,
    EngineError,
    EngineProtocolError,
    IncompatibleAdapterError,
    LoraNotEnabledError,
    RankTooLargeError,
)

__all__ = [
    "NeedsRankCheck",
    "generate_error",
    "lora_error",
    "rank_or_modules",
    "stream_error",
    "unexpected",
    "weight_error",
]

# A load past --max-loaded-loras: 0.5.4's refusal, and SGLang main's for a new streamed name
# (PR #36384: eviction would lose the only copy of a streamed adapter, so it refuses instead).
_CAP_TEXTS = ("Maximum number of loaded LoRA adapters", "max_loaded_loras", "max-loaded-loras")
_NOT_FOUND_TEXTS = ("No such file or directory", "Repo id must be", "Cannot find any model weights", "is not a local folder")


class NeedsRankCheck(EngineError):
    """Internal: the "incompatible" text covers rank and modules; ``/server_info`` decides which."""


def lora_error(message: str, *, url: str, name: str, context: dict[str, Any]) -> EngineError:
    """The typed error for a LoRA route's ``error_message`` (``NeedsRankCheck``: ask
    ``/server_info`` and call :func:`rank_or_modules`)."""
    where = f"sglang at {url}"
    if "LoRA is not enabled" in message:
        return LoraNotEnabledError(
            f"{where} was started without LoRA: {message} (also pass --max-lora-rank and --lora-target-modules)",
            **context,
        )
    if "already loaded" in message:
        return AdapterAlreadyLoadedError(
            f"{where} already serves an adapter named {name!r}; SGLang has no in-place reload, so "
            f"unload it first or load under a new versioned name ({message})",
            **context,
        )
    if "does not exist" in message and "Loaded LoRAs" in message:
        return AdapterNotFoundError(f"{where} serves no adapter named {name!r}: {message}", **context)
    if "is incompatible with the current LoRA memory pool" in message:
        return NeedsRankCheck(message)
    if "doesn't support DoRA" in message or "add tokens to the vocabulary" in message or "target module" in message:
        return IncompatibleAdapterError(f"{where} cannot serve adapter {name!r}: {message}", **context)
    if any(text in message for text in _CAP_TEXTS):
        return CapacityError(
            f"{where} holds as many adapters as --max-loaded-loras allows and refuses a new one ({name!r}): "
            f"{message}; unload a version first, keep fewer versions (keep=) or restart it with a larger "
            "--max-loaded-loras (SGLang never evicts a streamed adapter to make room)",
            **context,
        )
    if "as a pinned adapter" in message:
        return CapacityError(f"{where} has no slot left to pin adapter {name!r}: {message}", **context)
    if "incomplete unload" in message:
        return EngineError(f"{where}: {message} (call unload_adapter({name!r}) again)", **context)
    if "[LORA-CHECK]" in message:
        return AdapterRejectedError(
            f"{where} received adapter {name!r} corrupted (checksums differ): {message}; retry the load",
            **context,
        )
    if any(text in message for text in _NOT_FOUND_TEXTS):
        return AdapterNotFoundError(
            f"{where} found no PEFT adapter for {name!r} at the path it was given: {message}; the path "
            "must exist on the server's host and hold adapter_config.json and *.safetensors",
            **context,
        )
    return AdapterRejectedError(f"{where} refused adapter {name!r}: {message}", **context)


def rank_or_modules(message: str, *, url: str, name: str, info: Mapping[str, Any], context: dict[str, Any]) -> EngineError:
    """Which of rank or target modules made the memory pool refuse, from ``/server_info``."""
    match = re.search(r"with rank (\d+)", message)
    rank = int(match.group(1)) if match else None
    max_rank = info.get("max_lora_rank")
    if rank is not None and isinstance(max_rank, int) and rank > max_rank:
        return RankTooLargeError(
            f"adapter {name!r} has rank {rank} but sglang at {url} was started with "
            f"--max-lora-rank {max_rank}; restart it with a larger --max-lora-rank or train r <= {max_rank}",
            rank=rank,
            max_rank=max_rank,
            **context,
        )
    return IncompatibleAdapterError(
        f"adapter {name!r} targets modules sglang at {url} was not started for "
        f"(--lora-target-modules {info.get('lora_target_modules')}); restart it with those modules: {message}",
        **context,
    )


def weight_error(message: str, *, url: str, path: str, context: dict[str, Any]) -> EngineError:
    """A weight route's refusal, with what to do about the known ones."""
    hint = ""
    if "must run between" in message:
        hint = " (the server is 0.5.23 or newer: use version='0.5.23' or 'auto')"
    elif "session is already open" in message:
        hint = " (another client is updating weights, or a previous update died; retry later)"
    return EngineError(f"sglang at {url}{path} refused the weight update: {message}{hint}", **context)


def stream_error(message: str, *, url: str, path: str, name: str, context: dict[str, Any]) -> EngineError:
    """A refusal while streaming adapter ``name``'s tensors (``/update_weights_from_tensor``) or
    applying them (``/end_weight_update``): SGLang main's stash checks, else the weight-route text."""
    where = f"sglang at {url}{path}"
    if "[LORA-CHECK]" in message or "partial stream" in message or "different tensor set" in message:
        return AdapterRejectedError(
            f"{where} refused the tensors streamed for adapter {name!r}: {message}; it was unregistered, "
            "publish again",
            **context,
        )
    if "require --enable-lora" in message or "LoRA is not enabled" in message:
        return LoraNotEnabledError(f"{where} was started without LoRA: {message}", **context)
    return weight_error(message, url=url, path=path, context=context)


def generate_error(message: str, *, url: str, lora_name: str | None, context: dict[str, Any]) -> EngineError:
    """A ``/generate`` refusal (SGLang's OpenAI-style ``{"error": {"message"}}``)."""
    if "never been loaded" in message:
        return AdapterNotFoundError(f"sglang at {url} serves no adapter named {lora_name!r}: {message}", **context)
    if "LoRA is not enabled" in message:
        return LoraNotEnabledError(f"sglang at {url} was started without LoRA: {message}", **context)
    return EngineError(f"sglang at {url} refused /generate: {message}", **context)


def unexpected(status: int, text: str, *, url: str, path: str, version: str, context: dict[str, Any]) -> EngineError:
    """An answer that is not SGLang's envelope (a 404 route, a 5xx, a foreign body)."""
    if status == 404:
        return CapabilityError(
            f"sglang at {url} has no route {path} (HTTP 404); the server is older than this "
            f"client assumes (version={version}) or not SGLang",
            **context,
        )
    if status >= 500:
        return EngineError(
            f"sglang at {url}{path} failed with HTTP {status}: {text!r}; SGLang asserts "
            "dp_size == 1 for LoRA updates (start with --dp-size 1), otherwise check its log",
            **context,
        )
    return EngineProtocolError(
        f"sglang at {url}{path} answered HTTP {status} with {text!r}, which this client "
        "cannot interpret; check version= against the server's version",
        **context,
    )
