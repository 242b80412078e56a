"""vLLM worker extension: adapters and base weights from shared memory or CUDA IPC, no files.

Start vLLM with ``--worker-extension-cls lorasync.engines.vllm_worker.LoraSyncWorkerExtension``
(that path is an alias of this module, kept because users pass it on command lines) and
``VLLM_SERVER_DEV_MODE=1`` (for ``/collective_rpc``), or build ``vllm.LLM(...,
worker_extension_cls=...)`` for the in-process engine; lorasync must be importable by the
engine's Python (``PYTHONPATH``). This module imports only the standard library, torch,
lorasync's wire formats and, inside the worker, vLLM. Specs arrive as JSON strings
(``lorasync.engines.vllm._protocol``), never pickles.

Adapter flow (driven by ``VLLMEngine.load_adapter_tensors``):

1. lorasync writes the tensors and the adapter config into one shared-memory segment;
2. ``collective_rpc("lorasync_stage_adapter", spec)``: every worker copies the tensors out and
   keeps them under a token; the worker's LoRA loader learns the ``/lorasync-ipc/<token>`` path;
3. ``POST /v1/load_lora_adapter`` with that path: the API server registers the name (so OpenAI
   requests can select it — an adapter added only inside the worker would be invisible) and the
   worker builds the LoRA from the staged tensors, with vLLM's own validation;
4. lorasync unlinks the segment; after unloading the name it calls
   ``lorasync_release_adapter(token)``. Staged tensors stay until then because vLLM may evict and
   re-load the adapter from its "path" at any time.

When the trainer's adapter lives on a GPU of this host, step 1-2 are instead
``collective_rpc("lorasync_stage_adapter_cuda", spec)``: every worker maps the trainer's packed
GPU buffer through a CUDA IPC handle (encoded as JSON, no pickle), copies it straight into its
own page-locked host memory (where vLLM 0.32 builds adapters) and returns; lorasync then frees
the buffer. A worker that cannot map it (no CUDA, the GPU not visible) answers
``staged: False`` and lorasync falls back to shared memory.

Tested against vLLM 0.32 (``WorkerLoRAManager._load_adapter``); other versions may differ.
"""

from __future__ import annotations

import json
import threading
import types
from typing import Any

import torch

from lorasync.engines.vllm._protocol import CONFIG_KEY, IPC_PREFIX, CudaStage, ShmStage, check_token
from lorasync.errors import ConfigError, CudaIpcUnavailableError
from lorasync.wire.cuda_ipc import import_tensors
from lorasync.wire.shm import read_segment

__all__ = ["CONFIG_KEY", "IPC_PREFIX", "LoraSyncWorkerExtension"]

_STAGED: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
_LOCK = threading.Lock()


class LoraSyncWorkerExtension:
    """Methods mixed into vLLM's worker; call them through ``/collective_rpc``."""

    def lorasync_ping(self) -> str:
        return "lorasync"

    def lorasync_stage_adapter(self, spec_json: str) -> dict[str, Any]:
        """Copy an adapter out of shared memory and make its IPC path loadable.

        ``spec_json``: a :class:`~lorasync.engines.vllm._protocol.ShmStage` with a token.
        """
        spec = ShmStage.from_json(spec_json)
        token = check_token(spec.token)
        tensors, metadata = read_segment(spec.shm, spec.nbytes)
        return _stage(self, token, tensors, metadata)

    def lorasync_stage_adapter_cuda(self, spec_json: str) -> dict[str, Any]:
        """Copy an adapter out of the trainer's GPU memory (CUDA IPC) and make its IPC path loadable.

        ``spec_json``: a :class:`~lorasync.engines.vllm._protocol.CudaStage`. Answers ``{"staged": True, ...}``
        once the tensors are in this worker's own memory (the trainer may then free its
        buffer), or ``{"staged": False, "reason": ...}`` when this worker cannot map the
        trainer's GPU, so the caller falls back to shared memory.

        vLLM 0.32 builds adapters in host memory (its LoRA cache lives there and is copied into
        GPU slots on use), so the worker copies the trainer's buffer straight into page-locked
        host memory in one transfer, instead of vLLM moving it one tensor (and one GPU wait) at
        a time.
        """
        stage = CudaStage.from_json(spec_json)
        token = stage.token
        try:
            tensors, metadata = import_tensors(stage.ipc, device="cpu")
        except CudaIpcUnavailableError as exc:
            return {"token": token, "staged": False, "reason": str(exc)}
        return _stage(self, token, tensors, metadata)

    def lorasync_release_adapter(self, token: str) -> bool:
        with _LOCK:
            return _STAGED.pop(token, None) is not None

    def lorasync_staged(self) -> list[str]:
        with _LOCK:
            return sorted(_STAGED)

    def lorasync_update_weights(self, spec_json: str) -> dict[str, Any]:
        """Load base weights (HF names) from shared memory with the model's own ``load_weights``.

        ``spec_json``: a :class:`~lorasync.engines.vllm._protocol.ShmStage` without a token.
        """
        spec = ShmStage.from_json(spec_json)
        tensors, _ = read_segment(spec.shm, spec.nbytes)
        # reload_weights re-runs the post-load processing (CPU/GPU kernels repack weights) and
        # resets LoRA state derived from the old weights.
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"updated": len(tensors)}


def _stage(worker: Any, token: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    if CONFIG_KEY not in metadata:
        raise ConfigError(f"staged adapter {token} carries no {CONFIG_KEY}; stage it with lorasync's client")
    config = json.loads(metadata[CONFIG_KEY])
    _install_loader(worker)
    with _LOCK:
        _STAGED[token] = (tensors, config)
    return {"token": token, "tensors": len(tensors), "staged": True}


def _install_loader(worker: Any) -> None:
    """Teach the worker's LoRA manager to build adapters staged under ``IPC_PREFIX`` paths."""
    manager = worker.model_runner.lora_manager
    if getattr(manager, "_lorasync_installed", False):
        return
    original = manager._load_adapter

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        path = str(lora_request.lora_path)
        if not path.startswith(IPC_PREFIX):
            return original(lora_request)
        return _load_staged(self, lora_request, path[len(IPC_PREFIX) :])

    manager._load_adapter = types.MethodType(_load_adapter, manager)
    manager._lorasync_installed = True


def _load_staged(manager: Any, lora_request: Any, token: str) -> Any:
    # Mirrors vLLM 0.32 WorkerLoRAManager._load_adapter / LoRAModel.from_local_checkpoint with
    # the tensors and config taken from the staging area instead of a directory.
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    with _LOCK:
        staged = _STAGED.get(token)
    if staged is None:
        from vllm.lora.lora_model import LoRAAdapterNotFoundError  # type: ignore[attr-defined]

        raise LoRAAdapterNotFoundError(lora_request.lora_name, lora_request.lora_path)
    tensors, config = staged
    adapter_manager = manager._adapter_manager
    expected: set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        expected.update(adapter_manager.packed_modules_mapping.get(module, [module]))
    peft_helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft_helper.validate_legal(manager.lora_config)
    model = adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    unexpected = []
    for key in tensors:
        if is_base_embedding_weights(key):
            continue
        module_name, _ = parse_fine_tuned_lora_name(key, mapper)
        if module_name.rsplit(".", 1)[-1] not in expected:
            unexpected.append(module_name)
    if unexpected:
        raise ValueError(
            f"While loading {lora_request.lora_path}, expected target modules in {expected} but received "
            f"{unexpected}. Please verify that the loaded LoRA module is correct"
        )
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        tensors=dict(tensors),
        peft_helper=peft_helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    lora.is_3d_lora_weight = False
    adapter_manager._validate_moe_lora_format(lora)
    adapter_manager._validate_modules_to_save(lora)
    adapter_manager._validate_token_classification_lora(lora)
    return lora
