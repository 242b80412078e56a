"""The base model side of the PEFT engine: loading a checkpoint, finding a base parameter through
PEFT's wrappers and reading an adapter directory (:mod:`._inject` builds what PEFT injects)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lorasync.adapter._adapter import ADAPTER_CONFIG, Adapter
from lorasync.adapter._moe import fused_rows
from lorasync.errors import (
    AdapterNotFoundError,
    AdapterRejectedError,
    ConfigError,
    IncompatibleAdapterError,
    LoraSyncError,
)

KIND = "peft"


def load_base_model(path: Path, dtype: torch.dtype) -> Any:
    """The causal LM in the local checkpoint directory ``path`` (nothing is downloaded).

    Raises:
        ConfigError: ``path`` holds no loadable transformers checkpoint.
    """
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise ConfigError(
            f"base_model_path {path} holds no transformers checkpoint (no config.json); pass a local "
            "model directory (nothing is downloaded)"
        )
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ConfigError(f"cannot load the base model from {path}: {exc}") from exc


def read_adapter_dir(name: str, directory: Path, *, kind: str = KIND) -> Adapter:
    """The validated Adapter saved in ``directory``, to be served as ``name``.

    Raises:
        AdapterNotFoundError: ``directory`` holds no ``adapter_config.json``.
        AdapterRejectedError: unreadable or invalid files.
    """
    if not (directory / ADAPTER_CONFIG).is_file():
        raise AdapterNotFoundError(
            f"no PEFT adapter at {directory} (no {ADAPTER_CONFIG}); save the adapter there first "
            "(Adapter.save) or pass the right path",
            engine=kind,
            adapter=name,
            path=str(directory),
        )
    try:
        return Adapter.load(directory)
    except (LoraSyncError, OSError, ValueError, KeyError, TypeError) as exc:  # bad files or config
        raise AdapterRejectedError(
            f"cannot load adapter {name!r} from {directory}: {exc}", engine=kind, adapter=name, path=str(directory)
        ) from exc


def base_parameter(model: Any, name: str, *, kind: str = KIND) -> torch.Tensor:
    """The parameter ``name`` of the base ``model``, looking through PEFT's wrappers; a checkpoint's
    per-expert name (``...mlp.experts.3.gate_proj.weight``) is the view of its rows in the fused
    expert parameter transformers 5 holds (``mlp.experts.gate_up_proj[3, :I]``).

    Raises:
        IncompatibleAdapterError: the base model has no parameter ``name``.
    """
    where = fused_rows(name.removesuffix(".weight")) if name.endswith(".weight") else None
    if where is not None and _parameter(model, name) is None:
        path, expert, index, leaves = where
        fused = base_parameter(model, path, kind=kind)
        rows = fused.shape[1] // leaves
        if fused.dim() == 3 and expert < fused.shape[0]:
            return fused[expert, index * rows : (index + 1) * rows]
    param = _parameter(model, name)
    if param is None:
        raise IncompatibleAdapterError(
            f"the base model has no parameter {name!r}; use the model's own parameter names "
            "(e.g. 'model.layers.0.self_attn.q_proj.weight')",
            engine=kind,
            key=name,
        )
    return param


def _parameter(model: Any, name: str) -> torch.nn.Parameter | None:
    module_path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_path) if module_path else model
    except AttributeError:
        module = None
    base_layer = getattr(module, "get_base_layer", None)
    if callable(base_layer):  # a PEFT LoRA layer: the real weight sits in base_layer
        module = base_layer()
    param = getattr(module, attr, None) if module is not None else None
    return param if isinstance(param, torch.nn.Parameter) else None


def device_of(model: Any) -> torch.device:
    param: torch.Tensor = next(model.parameters())
    return param.device


def pad_id(model: Any) -> int | None:
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    return pad if pad is not None else getattr(config, "eos_token_id", None)


@contextlib.contextmanager
def quiet_foreign_warnings() -> Iterator[None]:
    # transformers deprecation notices raised inside PEFT's wrapping say nothing to our users.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # PEFT 0.21 checks pattern keys against modules only, so a pattern naming a target
        # parameter (fused experts, a router weight) is reported unmatched although it applies.
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
        yield
