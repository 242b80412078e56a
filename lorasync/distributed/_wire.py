"""Wire formats of the distributed publisher: no pickle anywhere.

* An Adapter travels as one flat ``uint8`` tensor in safetensors layout (the layout code of
  :mod:`lorasync.wire.layout`); its config, content hash and optional probe ride in the
  safetensors metadata as JSON strings. The receiver parses it with bounds checks and recomputes
  the content hash, so a corrupt or truncated buffer is refused, never served.
* Engine results, errors and setup roles travel as JSON. Errors are rebuilt by class name from
  :mod:`lorasync.errors` only; context values that are not plain JSON are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from lorasync import errors
from lorasync.adapter._adapter import Adapter
from lorasync.runtime._collectives import decode_json, encode_json
from lorasync.adapter._config import AdapterConfig
from lorasync.adapter._probe import Probe
from lorasync.publisher._report import EngineResult
from lorasync.errors import LoraSyncError, PublishError, TransportError
from lorasync.wire.layout import plan
from lorasync.wire.reading import read

__all__ = [
    "decode_adapter",
    "decode_error",
    "decode_json",
    "decode_result",
    "encode_adapter",
    "encode_error",
    "encode_json",
    "encode_result",
]

CONFIG_KEY = "lorasync.config"
HASH_KEY = "lorasync.content_hash"
PROBE_KEY = "lorasync.probe"


def encode_adapter(adapter: Adapter, *, probe: Probe | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Serialise ``adapter`` once into a 1-D ``uint8`` tensor on ``device`` (safetensors layout).

    Tensors are copied straight from where they live (a CUDA adapter into a CUDA buffer moves no
    bytes through the host).

    Returns:
        `torch.Tensor`: ``safetensors.torch.load(bytes(buffer.cpu().numpy()))`` reads it.
    """
    metadata = {
        "format": "pt",
        CONFIG_KEY: json.dumps(adapter.config.to_dict()),  # not sorted: pattern order is meaning
        HASH_KEY: adapter.content_hash,
    }
    if probe is not None:
        metadata[PROBE_KEY] = json.dumps(
            {
                "prompt_ids": list(probe.prompt_ids),
                "expected_ids": list(probe.expected_ids),
                "expected_logprobs": None if probe.expected_logprobs is None else list(probe.expected_logprobs),
                "atol": probe.atol,
            }
        )
    layout = plan(adapter.tensors, metadata, grouped=False)
    out = torch.empty(layout.total, dtype=torch.uint8, device=device)
    layout.write_into(out, list(adapter.tensors.values()))
    return out


def decode_adapter(buffer: torch.Tensor) -> tuple[Adapter, Probe | None]:
    """Rebuild the Adapter (and probe) :func:`encode_adapter` wrote; CPU tensors.

    Raises:
        TransportError: a malformed buffer, or content whose hash differs from the sender's.
        AdapterError: content that fails Adapter validation.
    """
    cpu = buffer.detach().to("cpu").contiguous()
    try:
        tensors, metadata = read(memoryview(cpu.numpy()), what="received adapter buffer")
        config = AdapterConfig.from_peft(json.loads(metadata[CONFIG_KEY]))
        expected = metadata[HASH_KEY]
        raw_probe = json.loads(metadata[PROBE_KEY]) if PROBE_KEY in metadata else None
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise TransportError(
            f"the adapter buffer received over torch.distributed is malformed ({type(exc).__name__}: {exc}); "
            "every rank must run the same lorasync version"
        ) from exc
    adapter = Adapter(tensors, config)
    if adapter.content_hash != expected:
        raise TransportError(
            f"the adapter received over torch.distributed hashes to {adapter.content_hash[:12]}, the sender's "
            f"to {expected[:12]}: the bytes were corrupted in transit; nothing was published on this node"
        )
    probe = None
    if raw_probe is not None:
        probe = Probe(
            tuple(raw_probe["prompt_ids"]),
            tuple(raw_probe["expected_ids"]),
            None if raw_probe["expected_logprobs"] is None else tuple(raw_probe["expected_logprobs"]),
            float(raw_probe["atol"]),
        )
    return adapter, probe


def encode_error(exc: BaseException) -> dict[str, Any]:
    """Class name, message and the JSON-safe part of a lorasync error's context."""
    context = getattr(exc, "context", None) or {}
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "context": {k: v for k, v in context.items() if _plain(v)},
    }


def decode_error(data: Mapping[str, Any], **extra: Any) -> LoraSyncError:
    """Rebuild an error from :func:`encode_error`: the same ``lorasync.errors`` class when it is
    one (else ``PublishError``), same message and context, plus ``extra`` context."""
    cls = getattr(errors, str(data.get("type", "")), None)
    if not (isinstance(cls, type) and issubclass(cls, LoraSyncError)):
        cls = PublishError
    context = {k: v for k, v in dict(data.get("context") or {}).items() if k not in ("message", "context")}
    context.update(extra)
    return cls(str(data.get("message", "")), **context)


def encode_result(result: EngineResult) -> dict[str, Any]:
    """An EngineResult as JSON-safe data (its error through :func:`encode_error`)."""
    data = result.to_dict()
    data.pop("ok", None)
    data["error"] = None if result.error is None else encode_error(result.error)
    return data


def decode_result(data: Mapping[str, Any], **error_context: Any) -> EngineResult:
    """Inverse of :func:`encode_result`; ``error_context`` is added to a rebuilt error."""
    error = data.get("error")
    return EngineResult(
        engine=str(data["engine"]),
        url=str(data["url"]),
        status=str(data["status"]),
        transport=data.get("transport"),
        reason=str(data.get("reason", "")),
        served_name=data.get("served_name"),
        bytes_moved=int(data.get("bytes_moved", 0)),
        timings={str(k): float(v) for k, v in dict(data.get("timings") or {}).items()},
        retired=[str(n) for n in data.get("retired") or []],
        error=None if error is None else decode_error(error, **error_context),
    )


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
