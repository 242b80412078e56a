"""``PeftEngine``: the Engine protocol and inference over the adapters :mod:`._slots` keeps.

Loads, swaps and unloads run under one re-entrant lock that inference holds too, so a request
sees an adapter before or after a change, never half of one; a merged weight update holds
inference off from ``begin_weight_update`` to ``end_weight_update``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lorasync.adapter._adapter import Adapter
from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines._inflight import InFlight
from lorasync.engines.peft._errors import translated
from lorasync.engines.peft._model import base_parameter, device_of, load_base_model, pad_id, read_adapter_dir
from lorasync.engines.peft._slots import AdapterSlots
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterRejectedError,
    CapacityError,
    ConfigError,
    InvalidNameError,
)

__all__ = ["PeftEngine"]


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
    copies_tensors = True  # set_peft_model_state_dict copies into the slot's own parameters

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
        base = model if model is not None else load_base_model(Path(base_model_path), dtype)  # type: ignore[arg-type]
        base.eval()
        self.url = str(base_model_path) if base_model_path is not None else ""
        self._max_loras = max_loras
        self._max_rank = max_rank
        self._adapters = AdapterSlots(base, kind=self.kind)
        self._slots = self._adapters.names  # served name -> internal PEFT adapter name
        self._lock = threading.RLock()
        # Held from begin_weight_update to end_weight_update (possibly by different threads, so
        # a plain Lock): inference waits instead of seeing half of a merged update.
        self._update_gate = threading.Lock()
        self._in_flight = InFlight()  # generations running or waiting, per adapter
        # Served name -> where that load came from (a path, or a token per tensor load): what
        # ``adapter_sources`` reports, so a publisher sees when someone else reloaded a name.
        self._sources: dict[str, str] = {}

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
        with self._lock:
            self._check_new_name(name)
            self._load_validated(name, read_adapter_dir(name, Path(path), kind=self.kind))
            self._sources[name] = os.path.abspath(os.fspath(path))

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
            self._sources[name] = _tensor_source()

    def _load_validated(self, name: str, adapter: Adapter) -> None:
        self._preflight(name, adapter)
        self._adapters.add(name, adapter)

    def replace_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Atomically make ``name`` serve the adapter directory ``path`` (loads it if absent).

        Raises:
            AdapterNotFoundError, AdapterRejectedError: as :meth:`load_adapter`; ``name`` keeps
            serving its previous weights.
        """
        adapter = read_adapter_dir(name, Path(path), kind=self.kind)
        with self._lock:
            self.replace_adapter_tensors(name, adapter)
            self._sources[name] = os.path.abspath(os.fspath(path))

    def replace_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """Atomically make ``name`` serve ``adapter``: the new weights are loaded into a fresh
        slot, then the name switches to it under the engine lock (inference holds the same lock,
        so it sees the old or the new adapter, never a mix) and the old slot is freed.

        Raises:
            AdapterRejectedError, RankTooLargeError: ``name`` keeps serving its previous weights.
        """
        with self._lock:
            if name not in self._slots:
                self.load_adapter_tensors(name, adapter)
                return
            self.capabilities().check(adapter)
            self._adapters.swap(name, adapter)
            self._sources[name] = _tensor_source()

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` and free its weights.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded.
        """
        with self._lock:
            self._adapters.remove(name)
            self._sources.pop(name, None)

    def list_adapters(self) -> list[str]:
        """Names of the loaded adapters, in load order."""
        with self._lock:
            return list(self._slots)

    def adapter_sources(self) -> dict[str, str]:
        """Where each loaded adapter came from: the directory it was read from, or a token
        unique to that tensor load (every load and swap gets a new one)."""
        with self._lock:
            return dict(self._sources)

    def adapters_in_use(self) -> frozenset[str]:
        """Adapters a generation runs on or waits for (exact: every request passes through here)."""
        return self._in_flight.names()

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``named_tensors`` into the base model's parameters, in place.

        Names are the base model's own (``model.layers.0.self_attn.q_proj.weight``); while PEFT
        wraps a module, its weight lives at ``...q_proj.base_layer.weight`` and is found there.
        A checkpoint's per-expert name (``...mlp.experts.3.gate_proj.weight``) writes its rows of
        the fused expert parameter (``...mlp.experts.gate_up_proj``).
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
            return self._adapters.serving

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
        with self._in_flight.track(adapter), self._lock, self._adapters.active(adapter) as model, self._translate("generate", adapter), torch.no_grad():
            if max_new_tokens == 0:
                return []
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id(self._adapters.base),
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
        with self._lock, self._adapters.active(adapter) as model, self._translate("logprobs", adapter), torch.no_grad():
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

    def _base_parameter(self, name: str) -> torch.Tensor:
        return base_parameter(self._adapters.base, name, kind=self.kind)

    def _input_ids(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ConfigError("prompt_ids is empty; pass at least one token id")
        return torch.tensor([ids], dtype=torch.long, device=device_of(self._adapters.base))

    def _translate(self, op: str, adapter: str | None) -> contextlib.AbstractContextManager[None]:
        """Turn torch/PEFT/OS errors raised during ``op`` into lorasync errors."""
        return translated(op, adapter, kind=self.kind)


def _tensor_source() -> str:
    """A token no other load shares (what ``adapter_sources`` reports for a tensor load)."""
    return f"tensors:{uuid.uuid4().hex}"
