"""An in-process engine: a transformers causal LM with PEFT LoRA adapters, in this Python process.

It serves the same role as a vLLM or SGLang server for tests, demos and small-scale RL loops that
run generation next to the trainer: adapters are loaded by name (from PEFT directories or straight
from tensors), unloaded, listed, and selected per call to :meth:`PeftEngine.generate` /
:meth:`PeftEngine.logprobs`. Base weights can be replaced in place (the merged fallback).

Adapters live in one ``PeftModel`` that wraps the base model while at least one is loaded; when
the last one is unloaded, PEFT's ``unload()`` puts the original modules back. Every mutation is
rolled back on failure, so a failed load leaves the other adapters serving exactly as before.
Served names are mapped to internal PEFT adapter names, so any name (``"policy@v3"``,
``"qwen-1.5"``) works even though PEFT forbids dots in its own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lorasync._adapter import ADAPTER_CONFIG, Adapter
from lorasync.engines._inflight import InFlight
from lorasync.engines._base import Capabilities, Engine
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    AdapterRejectedError,
    CapacityError,
    ConfigError,
    EngineError,
    IncompatibleAdapterError,
    InvalidNameError,
    LoraSyncError,
)

__all__ = ["PeftEngine"]

logger = logging.getLogger("lorasync")


class PeftEngine(Engine):
    """A transformers causal LM plus PEFT LoRA adapters, served in this process.

    Args:
        model (`transformers.PreTrainedModel` or `str`, *optional*):
            The base causal LM, used as it is (its dtype and device are kept). A string or path
            is taken as ``base_model_path``, which is how ``connect("peft", "/path/to/base")``
            reaches this constructor.
        base_model_path (`str` or `os.PathLike`, *optional*):
            A local transformers checkpoint directory, loaded with
            ``AutoModelForCausalLM.from_pretrained`` in ``dtype``. Nothing is downloaded.
        max_loras (`int`, *optional*): how many adapters may be loaded at once; a load beyond
            that raises ``CapacityError``. Defaults to no limit.
        max_rank (`int`, *optional*): largest LoRA rank accepted (``RankTooLargeError``
            above it). Defaults to no limit.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype ``base_model_path`` is loaded
            in. Ignored when ``model`` is given.

    Raises:
        ConfigError: neither or both of ``model`` and ``base_model_path``, or a path that holds
            no loadable causal LM.

    Example:
        >>> from lorasync.engines import connect
        >>> engine = connect("peft", base_model_path="/models/tiny")  # doctest: +SKIP
        >>> engine.load_adapter("policy@v1", "/dev/shm/lorasync/policy/v1")  # doctest: +SKIP
        >>> engine.generate([1, 17, 42], adapter="policy@v1", max_new_tokens=4)  # doctest: +SKIP
        [311, 87, 87, 402]
    """

    kind = "peft"

    def __init__(
        self,
        model: Any = None,
        *,
        base_model_path: str | os.PathLike[str] | None = None,
        max_loras: int | None = None,
        max_rank: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if isinstance(model, (str, os.PathLike)):
            if base_model_path is not None:
                raise ConfigError(
                    "give the base model either as the URL/model argument or as base_model_path=, not both"
                )
            model, base_model_path = None, model
        if (model is None) == (base_model_path is None):
            raise ConfigError(
                "PeftEngine needs exactly one of model= (a transformers causal LM) or base_model_path= "
                "(a local checkpoint directory), e.g. connect('peft', base_model_path='/models/base')"
            )
        for option, value in (("max_loras", max_loras), ("max_rank", max_rank)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{option} must be a positive int or None, got {value!r}")
        self._base = model if model is not None else _load_base(Path(base_model_path), dtype)  # type: ignore[arg-type]
        self._base.eval()
        self.url = str(base_model_path) if base_model_path is not None else ""
        self._max_loras = max_loras
        self._max_rank = max_rank
        self._peft: Any = None  # the PeftModel while at least one adapter is loaded
        self._slots: dict[str, str] = {}  # served name -> internal PEFT adapter name
        self._slot_ids = itertools.count()
        self._lock = threading.RLock()
        # Held from begin_weight_update to end_weight_update (possibly by different threads, so
        # a plain Lock): inference waits instead of seeing half of a merged update.
        self._update_gate = threading.Lock()
        self._in_flight = InFlight()  # generations running or waiting, per adapter

    # -- the Engine protocol ------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """Everything is supported in process: runtime loads, tensor loads and weight updates."""
        return Capabilities(
            engine=self.kind,
            url=self.url,
            lora=True,
            runtime_lora=True,
            max_rank=self._max_rank,
            max_loras=self._max_loras,
            tensor_load=True,
            weight_update=True,
            load_inplace=True,
            same_host=True,
            in_process=True,
        )

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT adapter directory ``path`` under ``name``.

        The directory is read and validated by ``Adapter.load`` (safetensors only, complete A/B
        pairs, rank, no config field that changes the math unsupported), and the layers are
        built from that validated Adapter alone, exactly as :meth:`load_adapter_tensors` does:
        one LoRA layer per module the file holds, nothing else from ``adapter_config.json``.
        PEFT's own directory loader would also honour fields such as ``init_lora_weights``
        (PiSSA rewrites the base weights) or give targeted modules without weights random
        factors. Once this returns, the adapter serves; the files may be deleted.

        Raises:
            AdapterAlreadyLoadedError: ``name`` is loaded (unload it first).
            AdapterNotFoundError: ``path`` holds no ``adapter_config.json``.
            AdapterRejectedError: unreadable or invalid files; ``RankTooLargeError`` /
                ``IncompatibleAdapterError`` for a rank above ``max_rank`` or modules the base
                model lacks or shapes it does not have.
            CapacityError: ``max_loras`` adapters are loaded already.
        """
        directory = Path(path)
        with self._lock:
            self._check_new_name(name)
            if not (directory / ADAPTER_CONFIG).is_file():
                raise AdapterNotFoundError(
                    f"no PEFT adapter at {directory} (no {ADAPTER_CONFIG}); save the adapter there first "
                    "(Adapter.save) or pass the right path",
                    engine=self.kind,
                    adapter=name,
                    path=str(directory),
                )
            try:
                adapter = Adapter.load(directory)
            except (LoraSyncError, OSError, ValueError, KeyError, TypeError) as exc:  # bad files or config
                raise AdapterRejectedError(
                    f"cannot load adapter {name!r} from {directory}: {exc}",
                    engine=self.kind,
                    adapter=name,
                    path=str(directory),
                ) from exc
            self._load_validated(name, adapter)

    def load_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """Load ``adapter`` under ``name`` from its tensors, without files.

        PEFT injects the LoRA layers (``add_adapter`` / ``get_peft_model``) and
        ``set_peft_model_state_dict`` copies the tensors in, exactly as a disk load would.

        Raises:
            AdapterAlreadyLoadedError, AdapterRejectedError, CapacityError: as ``load_adapter``.
        """
        with self._lock:
            self._check_new_name(name)
            self._load_validated(name, adapter)

    def _load_validated(self, name: str, adapter: Adapter) -> None:
        self._preflight(name, adapter)
        from peft import set_peft_model_state_dict

        tensors = dict(adapter.tensors)
        self._add(name, _peft_config(adapter), lambda peft, slot: set_peft_model_state_dict(peft, tensors, adapter_name=slot))

    def replace_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Atomically make ``name`` serve the adapter directory ``path`` (loads it if absent).

        Raises:
            AdapterNotFoundError, AdapterRejectedError: as :meth:`load_adapter`; ``name`` keeps
            serving its previous weights.
        """
        directory = Path(path)
        if not (directory / ADAPTER_CONFIG).is_file():
            raise AdapterNotFoundError(
                f"no PEFT adapter at {directory} (no {ADAPTER_CONFIG})", engine=self.kind, adapter=name, path=str(directory)
            )
        try:
            adapter = Adapter.load(directory)
        except (LoraSyncError, OSError, ValueError, KeyError, TypeError) as exc:
            raise AdapterRejectedError(
                f"cannot load adapter {name!r} from {directory}: {exc}", engine=self.kind, adapter=name, path=str(directory)
            ) from exc
        self.replace_adapter_tensors(name, adapter)

    def replace_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """Atomically make ``name`` serve ``adapter``: the new weights are loaded into a fresh
        slot, then the name switches to it under the engine lock (inference holds the same lock,
        so it sees the old or the new adapter, never a mix) and the old slot is freed.

        Raises:
            AdapterRejectedError, RankTooLargeError: ``name`` keeps serving its previous weights.
        """
        with self._lock:
            old = self._slots.get(name)
            if old is None:
                self.load_adapter_tensors(name, adapter)
                return
            self.capabilities().check(adapter)
            from peft import set_peft_model_state_dict

            tensors = dict(adapter.tensors)
            staging = f"{name}\0next"  # NUL: never a user's name
            self._add(staging, _peft_config(adapter), lambda peft, slot: set_peft_model_state_dict(peft, tensors, adapter_name=slot))
            new = self._slots.pop(staging)
            self._slots[name] = new
            with self._translate("replace", name):
                self._peft.set_adapter(new, inference_mode=True)
                self._peft.delete_adapter(old)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` and free its weights.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded.
        """
        with self._lock:
            slot = self._slots.get(name)
            if slot is None:
                raise AdapterNotFoundError(
                    f"adapter {name!r} is not loaded in the peft engine; loaded: {sorted(self._slots)}",
                    engine=self.kind,
                    adapter=name,
                )
            with self._translate("unload", name):
                if len(self._slots) == 1:
                    # Last one: PEFT's unload() puts the original modules back (same parameters,
                    # so in-place weight updates survive).
                    self._base = self._peft.unload()
                    self._peft = None
                else:
                    remaining = next(s for n, s in self._slots.items() if n != name)
                    self._peft.set_adapter(remaining, inference_mode=True)  # never delete the active one
                    self._peft.delete_adapter(slot)
            del self._slots[name]

    def list_adapters(self) -> list[str]:
        """Names of the loaded adapters, in load order."""
        with self._lock:
            return list(self._slots)

    def adapters_in_use(self) -> frozenset[str]:
        """Adapters a generation runs on or waits for (exact: every request passes through here)."""
        return self._in_flight.names()

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``named_tensors`` into the base model's parameters, in place.

        Names are the base model's own (``model.layers.0.self_attn.q_proj.weight``); while PEFT
        wraps a module, its weight lives at ``...q_proj.base_layer.weight`` and is found there.
        Every name and shape is checked before anything is written, so a bad request changes
        nothing. Loaded adapters keep applying on top of the new weights.

        Raises:
            IncompatibleAdapterError: a name the base model does not have.
            AdapterRejectedError: a shape that differs from the parameter's.
        """
        with self._lock:
            targets = [(self._base_parameter(name), name, tensor) for name, tensor in named_tensors.items()]
            for param, name, tensor in targets:
                if tuple(tensor.shape) != tuple(param.shape):
                    raise AdapterRejectedError(
                        f"{name}: got shape {tuple(tensor.shape)}, the base model has {tuple(param.shape)}; "
                        "send full (unsharded) weights of the same model",
                        engine=self.kind,
                        key=name,
                    )
            with self._translate("update_weights", None), torch.no_grad():
                for param, _, tensor in targets:
                    param.copy_(tensor.detach().to(device=param.device, dtype=param.dtype))

    def begin_weight_update(self) -> None:
        """Hold inference until :meth:`end_weight_update` (waits for running inference)."""
        self._update_gate.acquire()

    def end_weight_update(self) -> None:
        if self._update_gate.locked():
            self._update_gate.release()

    def greedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens after ``prompt_ids`` with adapter ``name`` and each one's log-prob."""
        with self._update_gate:
            tokens = self.generate(prompt_ids, adapter=name, max_new_tokens=max_tokens)
            if not tokens:
                return [], []
            rows = self.logprobs(list(prompt_ids) + tokens[:-1], adapter=name)[len(prompt_ids) - 1 :]
        return tokens, [float(rows[i, t]) for i, t in enumerate(tokens)]

    def close(self) -> None:
        """Nothing to release: the model is freed with the engine."""

    @property
    def model(self) -> Any:
        """The module that serves now: the ``PeftModel`` while adapters are loaded, else the
        base model. For inspection; mutate it only through the engine's methods."""
        with self._lock:
            return self._peft if self._peft is not None else self._base

    # -- inference helpers --------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], *, adapter: str | None = None, max_new_tokens: int = 8) -> list[int]:
        """Greedy decoding of ``max_new_tokens`` tokens after ``prompt_ids``.

        Args:
            prompt_ids (`Sequence[int]`): the prompt's token ids (one sequence, no batch).
            adapter (`str`, *optional*): a loaded adapter's name; None runs the base model with
                every adapter disabled.
            max_new_tokens (`int`, defaults to 8): tokens to generate (fewer if EOS comes first).

        Returns:
            `list[int]`: the new token ids only.

        Raises:
            AdapterNotFoundError: ``adapter`` is not loaded.
            ConfigError: an empty prompt or a negative ``max_new_tokens``.
        """
        if max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        ids = self._input_ids(prompt_ids)
        with self._in_flight.track(adapter), self._lock, self._active(adapter) as model, self._translate("generate", adapter), torch.no_grad():
            if max_new_tokens == 0:
                return []
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=_pad_id(self._base),
            )
        return [int(t) for t in out[0, ids.shape[1] :]]

    def logprobs(self, prompt_ids: Sequence[int], *, adapter: str | None = None) -> torch.Tensor:
        """Log-probabilities of the next token at every position of ``prompt_ids``.

        Row ``i`` is ``log p(· | prompt_ids[: i + 1])``, so ``out[i, prompt_ids[i + 1]]`` is the
        prompt log-prob vLLM reports for token ``i + 1``. Used by verification probes.

        Args:
            prompt_ids (`Sequence[int]`): one sequence of token ids.
            adapter (`str`, *optional*): a loaded adapter's name; None means the base model.

        Returns:
            `torch.Tensor`: float32 ``[len(prompt_ids), vocab]`` on CPU.

        Raises:
            AdapterNotFoundError: ``adapter`` is not loaded.
            ConfigError: an empty prompt.
        """
        ids = self._input_ids(prompt_ids)
        with self._lock, self._active(adapter) as model, self._translate("logprobs", adapter), torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
        return torch.log_softmax(logits.float(), dim=-1).cpu()

    # -- internals ----------------------------------------------------------------------------

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or "\0" in name:
            raise InvalidNameError(f"adapter name must be a non-empty string without NUL, got {name!r}")
        if name in self._slots:
            raise AdapterAlreadyLoadedError(
                f"adapter {name!r} is already loaded in the peft engine; unload it first or publish "
                "under a new versioned name",
                engine=self.kind,
                adapter=name,
            )

    def _preflight(self, name: str, adapter: Adapter) -> None:
        self.capabilities().check(adapter)  # rank and LoRA support, before anything changes
        if self._max_loras is not None and len(self._slots) >= self._max_loras:
            raise CapacityError(
                f"the peft engine holds {len(self._slots)} adapters (max_loras={self._max_loras}); "
                f"unload one of {sorted(self._slots)} before loading {name!r}",
                engine=self.kind,
                adapter=name,
            )

    def _add(self, name: str, peft_config: Any, fill: Any) -> None:
        """Inject a LoRA adapter under a fresh internal name, ``fill`` it, and roll back on any
        failure so the engine is exactly as before."""
        from peft import get_peft_model

        slot = f"slot{next(self._slot_ids)}"
        created = self._peft is None
        with self._translate("load", name):
            try:
                with _quiet_foreign_warnings():
                    if created:
                        self._peft = get_peft_model(self._base, peft_config, adapter_name=slot)
                    else:
                        self._peft.add_adapter(slot, peft_config)
                    result = fill(self._peft, slot)
                _check_load_result(result, slot, name)
                self._peft.eval()
            except BaseException:
                try:
                    self._rollback(slot, created)
                except Exception:  # keep the load's own error; the rollback's goes to the log
                    logger.exception("peft engine: rolling back adapter %r failed", name)
                raise
        self._slots[name] = slot

    def _rollback(self, slot: str, created: bool) -> None:
        if self._peft is None:
            return
        if created:
            self._base = self._peft.unload()
            self._peft = None
        elif slot in self._peft.peft_config:
            active = self._peft.active_adapter
            if active == slot:
                self._peft.set_adapter(next(iter(self._slots.values())), inference_mode=True)
            self._peft.delete_adapter(slot)

    @contextlib.contextmanager
    def _active(self, adapter: str | None) -> Iterator[Any]:
        """The model to run with only ``adapter`` applied (None: no adapter at all)."""
        if adapter is None:
            if self._peft is None:
                yield self._base
            else:
                with self._peft.disable_adapter():
                    yield self._peft
            return
        slot = self._slots.get(adapter)
        if slot is None:
            raise AdapterNotFoundError(
                f"adapter {adapter!r} is not loaded in the peft engine; loaded: {sorted(self._slots)}",
                engine=self.kind,
                adapter=adapter,
            )
        self._peft.set_adapter(slot, inference_mode=True)
        yield self._peft

    def _base_parameter(self, name: str) -> torch.nn.Parameter:
        """The parameter ``name`` of the base model, looking through PEFT's wrappers."""
        module_path, _, attr = name.rpartition(".")
        try:
            module = self._base.get_submodule(module_path) if module_path else self._base
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
                engine=self.kind,
                key=name,
            )
        return param

    def _input_ids(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ConfigError("prompt_ids is empty; pass at least one token id")
        return torch.tensor([ids], dtype=torch.long, device=_device(self._base))

    @contextlib.contextmanager
    def _translate(self, op: str, adapter: str | None) -> Iterator[None]:
        """Turn torch/PEFT/OS errors raised during ``op`` into lorasync errors."""
        try:
            yield
        except LoraSyncError:
            raise
        except torch.OutOfMemoryError as exc:
            raise CapacityError(
                f"peft engine ran out of memory during {op}: {exc}; unload adapters or use a smaller model",
                engine=self.kind,
                adapter=adapter,
            ) from exc
        except (ValueError, KeyError, IndexError, TypeError, RuntimeError) as exc:
            if op != "load":
                raise EngineError(f"peft engine failed during {op}: {exc}", engine=self.kind, adapter=adapter) from exc
            message = str(exc)
            incompatible = "not found in the base model" in message or "size mismatch" in message
            rejected: type[EngineError] = IncompatibleAdapterError if incompatible else AdapterRejectedError
            raise rejected(
                f"the peft engine rejected adapter {adapter!r}: {message}; check that it was trained on this "
                "base model",
                engine=self.kind,
                adapter=adapter,
            ) from exc
        except OSError as exc:
            failed: type[EngineError] = AdapterRejectedError if op == "load" else EngineError
            raise failed(f"peft engine I/O failed during {op}: {exc}", engine=self.kind, adapter=adapter) from exc


def _peft_config(adapter: Adapter) -> Any:
    """The ``LoraConfig`` the engine injects ``adapter`` with: its validated rank, alpha and
    patterns, targeting exactly the module paths it holds weights for (a leaf name such as
    ``v_proj`` would also wrap modules the adapter has no factors for), default init (the
    factors are copied in right after; the base weights are never touched)."""
    config = adapter.config.to_peft()
    config.target_modules = set(adapter.modules)
    return config


def _check_load_result(result: Any, slot: str, name: str) -> None:
    """PEFT only warns about adapter weights that match no module; refuse them instead."""
    unexpected = [k for k in getattr(result, "unexpected_keys", ()) or () if ".lora_" in k]
    if unexpected:
        shown = ", ".join(k.replace(f".{slot}.", ".") for k in unexpected[:3])
        raise IncompatibleAdapterError(
            f"adapter weights for modules the base model does not have: {shown}"
            + (f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else "")
            + "; check that it was trained on this base model",
            engine=PeftEngine.kind,
            adapter=name,
        )


@contextlib.contextmanager
def _quiet_foreign_warnings() -> Iterator[None]:
    # transformers deprecation notices raised inside PEFT's wrapping say nothing to our users.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _load_base(path: Path, dtype: torch.dtype) -> Any:
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


def _device(model: Any) -> torch.device:
    param: torch.Tensor = next(model.parameters())
    return param.device


def _pad_id(model: Any) -> int | None:
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    return pad if pad is not None else getattr(config, "eos_token_id", None)
