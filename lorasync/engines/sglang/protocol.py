"""SGLang's wire protocol as this client speaks it: versions, routes' payloads, result types.

Pure functions and constants, no I/O: which server version has which field or route, the
``adapter_config.json`` dict the tensor route takes, the ``base64(pickle)`` payload SGLang's
allowlisting unpickler reads, SGLang's checksum, and bucketing of merged weight updates.
"""

from __future__ import annotations

import base64
import hashlib
import io
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorasync.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from lorasync.adapter._adapter import Adapter

__all__ = [
    "CHECKSUMS_SINCE",
    "DEFAULT_VERSION",
    "REGISTER_ROUTE",
    "STREAMED",
    "TENSOR_ROUTE",
    "TENSORS",
    "GenerateResult",
    "buckets",
    "config_dict",
    "cpu_copy",
    "parse_version",
    "serialize",
    "sha256",
]

DEFAULT_VERSION = "0.5.23"
TENSOR_ROUTE_SINCE = (0, 5, 10)
PER_RANK_FIELD_SINCE = (0, 5, 17)
# expected_checksums (sha256 per tensor), verified by TpModelWorker before the load; read in the 0.5.16
# and 0.5.17 wheels (0.5.15.post1 has no such field, and drops it unread like any unknown field).
CHECKSUMS_SINCE = (0, 5, 16)
SESSION_SINCE = (0, 5, 23)
MODELS_LIST_ADAPTERS_SINCE = (0, 5, 10)

# The two ways SGLang takes an adapter's tensors with no files, told apart by the server's routes
# (servers older than SESSION_SINCE can only speak TENSORS; see docs/engines/sglang.md):
TENSORS = "tensors"  # POST /load_lora_adapter_from_tensors (0.5.10 ... 0.5.23)
STREAMED = "streamed"  # /register_lora_adapter, then "{name}:{key}" tensors in a weight-update session (PR #36384)
TENSOR_ROUTE = "/load_lora_adapter_from_tensors"
REGISTER_ROUTE = "/register_lora_adapter"


def protocol_from_routes(paths: object) -> str | None:
    """The tensor protocol a server offers, from the paths of its ``/openapi.json`` (None: neither).

    A server with both routes (a build between the two) is driven the new way: that is the one
    its authors keep.
    """
    if not isinstance(paths, Mapping):
        return None
    if REGISTER_ROUTE in paths:
        return STREAMED
    if TENSOR_ROUTE in paths:
        return TENSORS
    return None


def streamed_tensors(name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"{name}:{key}": tensor}``: how a weight-update stream addresses an adapter's tensors
    (SGLang splits at the first colon, so ``name`` itself must have none).

    Raises:
        ConfigError: ``name`` contains a colon.
    """
    if ":" in name:
        raise ConfigError(
            f"SGLang's streamed adapters are addressed as '{{name}}:{{tensor key}}' and split at the first "
            f"colon, so the served name {name!r} cannot be streamed; choose a name without ':'"
        )
    return {f"{name}:{key}": tensor for key, tensor in tensors.items()}


@dataclass(frozen=True)
class GenerateResult:
    """What ``/generate`` returned for one prompt (greedy)."""

    output_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None  # per output token, when ``return_logprob=True``


def parse_version(value: str) -> tuple[int, ...]:
    """``"0.5.23"`` (or ``"v0.5"``) -> ``(0, 5, 23)``.

    Raises:
        ConfigError: not a version.
    """
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(value).strip())
    if not match:
        raise ConfigError(f"SGLang version must look like '0.5.23' (or 'auto'), got {value!r}")
    return tuple(int(part or 0) for part in match.groups())


def generate_body(input_ids: list[int], lora_name: str | None, max_new_tokens: int, return_logprob: bool) -> dict[str, Any]:
    """The greedy ``/generate`` request for one prompt."""
    body: dict[str, Any] = {
        "input_ids": [int(i) for i in input_ids],
        "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0},
    }
    if lora_name is not None:
        body["lora_path"] = lora_name  # the adapter *name*, despite the field's name
    if return_logprob:
        body["return_logprob"] = True
    return body


def config_dict(adapter: Adapter) -> dict[str, Any]:
    """The ``adapter_config.json`` content SGLang's ``LoRAConfig.from_dict`` reads."""
    config = adapter.config
    leaves = sorted({m.rsplit(".", 1)[-1] for m in adapter.modules})
    return {
        "peft_type": "LORA",
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "target_modules": leaves,
        "base_model_name_or_path": config.base_model_name_or_path,
        "use_dora": False,
        "bias": "none",
    }


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that owns its storage."""
    # clone(): a pickled view would carry its whole storage.
    return tensor.detach().to("cpu").contiguous().clone()


def serialize(obj: Any) -> str:
    """``base64(pickle)`` as SGLang's ``MultiprocessingSerializer.deserialize`` reads it.

    A plain pickle (not ``ForkingPickler``) stores each tensor's bytes inline, through
    ``torch.storage._load_from_bytes``, which SGLang's allowlisting unpickler maps to
    ``torch.load(weights_only=True)``: no shared-memory handles, so it works across hosts.
    """
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sha256(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor checksum: sha256 of the contiguous flattened bytes (tp_worker.py)."""
    import torch

    return hashlib.sha256(tensor.contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def buckets(named_tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split ``named_tensors`` into requests of at most ``limit`` bytes (a larger tensor goes alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            out.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        out.append(current)
    return out
