"""BaseWeights: the pristine base model's weights, read lazily one parameter at a time.

The merged fallback folds ``W0 + s·B·A`` from these, never from an engine's already-merged
weights, so repeated publishes do not accumulate deltas.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch

from lorasync.adapter._keys import WRAPPER_SEGMENTS
from lorasync.errors import ConfigError, StorageError

__all__ = ["BaseWeights"]

_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class BaseWeights:
    """Name → pristine tensor, from a HF checkpoint directory (safetensors) or from tensors.

    Args:
        files (`Mapping[str, Path]`): parameter name → safetensors file holding it.
        tensors (`Mapping[str, torch.Tensor]`): parameter name → tensor (the trainer's copy).
    """

    def __init__(self, *, files: Mapping[str, Path] | None = None, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        self._files = dict(files or {})
        self._tensors = dict(tensors or {})
        # from_model: the model's LoRA layers, weakly (the tensors are the model's own, live).
        self._lora_layers: list[tuple[str, weakref.ref[torch.nn.Module]]] = []

    @property
    def device(self) -> torch.device | None:
        """The one device every tensor it holds lives on (a trainer's base: often a GPU), or
        ``None`` (read from a checkpoint, or spread over devices): where a fold runs by default."""
        devices = {t.device for t in self._tensors.values()}
        return devices.pop() if len(devices) == 1 and not self._files else None

    def check_pristine(self) -> None:
        """Whether the weights are still the pristine base, checked at every fold.

        A base read by :meth:`from_model` is the model's own live tensors: LoRA merged into them
        after that (TRL's vLLM weight sync merges and unmerges around generation) would make the
        fold add the delta twice and the engine serve ``W0 + 2·s·B·A``, reported ok.

        Raises:
            ConfigError: a LoRA layer of that model is merged now.
        """
        for module_name, ref in self._lora_layers:
            module = ref()
            if module is not None and getattr(module, "merged_adapters", None):
                raise _merged_error(module_name, module)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> BaseWeights:
        """Index a HF checkpoint directory (``model.safetensors`` or a sharded index).

        Raises:
            StorageError: no safetensors weights in ``directory`` (``.bin`` checkpoints are not
                read: they would need pickle).
        """
        from safetensors import safe_open

        path = Path(directory)
        index = path / "model.safetensors.index.json"
        files: dict[str, Path] = {}
        try:
            if index.is_file():
                for name, fname in json.loads(index.read_text())["weight_map"].items():
                    files[name] = path / fname
            else:
                shards = sorted(path.glob("*.safetensors"))
                for shard in shards:
                    with safe_open(str(shard), framework="pt") as f:
                        for name in f.keys():
                            files[name] = shard
        except (OSError, ValueError, KeyError) as exc:
            raise StorageError(f"cannot index base weights in {path}: {exc}") from exc
        if not files:
            raise StorageError(
                f"{path} holds no safetensors base weights; convert the checkpoint to safetensors "
                "or pass BaseWeights(tensors=...)"
            )
        return cls(files=files)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> BaseWeights:
        """Name → pristine tensor, as given (the fold reads them and never writes them)."""
        return cls(tensors=tensors)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> BaseWeights:
        """The pristine base weights of the trainer's own model (a PEFT ``PeftModel`` or the
        model PEFT injected LoRA into), live: no copy, on the devices they live on.

        A GPU trainer's frozen base is the cheapest W0 for the merged fallback: the fold reads it
        on the GPU (nothing comes from disk or the host) and never writes it. Names are the base
        checkpoint's (``base_model.model.`` and ``.base_layer`` dropped, ``modules_to_save``
        copies skipped for their ``original_module``), LoRA factors left out.

        Args:
            model (`torch.nn.Module`): the model being trained; its base weights must stay frozen
                (LoRA training) for as long as this object is used.

        Returns:
            `BaseWeights`: backed by the model's own tensors.

        Raises:
            ConfigError: a LoRA layer of ``model`` is merged into its base weight (they are not
                pristine: unmerge first), or a weight is sharded (``DTensor``: pass the base
                checkpoint's directory instead).
        """
        layers = [(module_name, module) for module_name, module in model.named_modules() if hasattr(module, "merged_adapters")]
        for module_name, module in layers:
            if module.merged_adapters:
                raise _merged_error(module_name, module)
        # PEFT's LoraModel (a PeftModel's .base_model) holds the model as .model: its names carry
        # one "model." more than the checkpoint's.
        inner = type(model).__name__ != "PeftModel" and any(c.__name__ == "BaseTuner" for c in type(model).__mro__)
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            if inner and name.startswith("model."):
                name = "base_model.model." + name.removeprefix("model.")
            # The wrappers the exporters see through (FSDP1, activation checkpointing,
            # torch.compile, DDP's leading ``module.``) name no base weight either.
            parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
            while parts and parts[0] == "module":
                parts = parts[1:]
            if any(p.startswith("lora_") for p in parts) or "modules_to_save" in parts:
                continue
            if parts[:2] == ["base_model", "model"]:
                parts = parts[2:]
            parts = [p for p in parts if p not in ("base_layer", "original_module")]
            if type(tensor).__name__ == "DTensor":
                raise ConfigError(
                    f"{name} is sharded (DTensor); BaseWeights.from_model needs whole weights. Pass the base "
                    "checkpoint's directory (Publisher(base=path)) instead"
                )
            key = ".".join(parts)
            if key in tensors and tensors[key] is not tensor:
                raise ConfigError(f"two weights of the model are named {key!r} once PEFT's and the wrappers' segments are dropped; pass the base checkpoint's directory")
            tensors[key] = tensor
        base = cls(tensors=tensors)
        base._lora_layers = [(module_name, weakref.ref(module)) for module_name, module in layers]
        return base

    def __contains__(self, name: object) -> bool:
        return name in self._tensors or name in self._files

    def nbytes(self, name: str) -> int:
        """Size of parameter ``name`` in bytes, read from the header (no tensor data loaded)."""
        if name in self._tensors:
            t = self._tensors[name]
            return t.numel() * t.element_size()
        file = self._files.get(name)
        if file is None:
            self.get(name)  # raises the ConfigError naming the parameter
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            sl = f.get_slice(name)
            count = 1
            for d in sl.get_shape():
                count *= d
            return count * _ITEMSIZE.get(str(sl.get_dtype()).upper(), 4)

    def get(self, name: str) -> torch.Tensor:
        """The pristine tensor ``name`` (a private copy for files, the given tensor otherwise).

        Raises:
            ConfigError: ``name`` is not a base parameter.
        """
        if name in self._tensors:
            return self._tensors[name]
        file = self._files.get(name)
        if file is None:
            raise ConfigError(
                f"base weights have no parameter {name!r}; the adapter targets a module the base "
                "checkpoint does not have (wrong base model?)"
            )
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(name)
        except OSError as exc:
            raise StorageError(f"cannot read {name} from {file}: {exc}") from exc


def _merged_error(module_name: str, module: torch.nn.Module) -> ConfigError:
    return ConfigError(
        f"{module_name or type(module).__name__} has LoRA merged into its base weight "
        f"({module.merged_adapters}); its weights are not the pristine base. Call unmerge_adapter() "
        "first, or pass the base checkpoint's directory"
    )
