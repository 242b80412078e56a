"""The base model side of the PEFT engine: loading a checkpoint, finding a base parameter through
PEFT's wrappers, the ``LoraConfig`` an adapter is injected with, and reading an adapter directory."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lorasync._adapter import ADAPTER_CONFIG, Adapter
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


def peft_config(adapter: Adapter) -> Any:
    """The ``LoraConfig`` the engine injects ``adapter`` with: its validated rank, alpha and
    patterns, targeting exactly the module paths it holds weights for (a leaf name such as
    ``v_proj`` would also wrap modules the adapter has no factors for), default init (the
    factors are copied in right after; the base weights are never touched)."""
    config = adapter.config.to_peft()
    config.target_modules = set(adapter.modules)
    return config


def base_parameter(model: Any, name: str, *, kind: str = KIND) -> torch.nn.Parameter:
    """The parameter ``name`` of the base ``model``, looking through PEFT's wrappers.

    Raises:
        IncompatibleAdapterError: the base model has no parameter ``name``.
    """
    module_path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_path) if module_path else model
    except AttributeError:
        module = None
    base_layer = getattr(module, "get_base_layer", None)
    if callable(base_layer):  # a PEFT LoRA layer: the real weight sits in base_layer
        module = base_layer()
    param = getattr(module, attr, None) if module is not None else None
    if not isinstance(param, torch.nn.Parameter):
        raise IncompatibleAdapterError(
            f"the base model has no parameter {name!r}; use the model's own parameter names "
            "(e.g. 'model.layers.0.self_attn.q_proj.weight')",
            engine=kind,
            key=name,
        )
    return param


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
        yield
