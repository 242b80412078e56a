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

The staged tensors are the version's snapshot, owned by the worker and never handed to vLLM
itself: every build (the first, and each rebuild after vLLM's LRU evicted the adapter) gets its own
copy, because vLLM folds the LoRA scale into ``lora_B`` in place while it builds.

When the trainer's adapter lives on a GPU of this host, step 1-2 are instead
``collective_rpc("lorasync_stage_adapter_cuda", spec)``: every worker maps the trainer's packed
GPU buffer through a CUDA IPC handle (encoded as JSON, no pickle), copies it straight into its
own page-locked host memory (where vLLM builds adapters) and returns; lorasync then frees
the buffer. A worker that cannot map it (no CUDA, the GPU not visible) answers
``staged: False`` and lorasync falls back to shared memory. A colocated engine (the in-process
``vllm.LLM`` on the trainer's GPU) asks for ``on_gpu``: the copy stays on the worker's GPU and
vLLM builds the adapter there, so no byte of it crosses host memory.

Mirrors ``WorkerLoRAManager._load_adapter`` of the running vLLM: the differences between
releases (0.26 on the H200, 0.32 on CPU) are in ``_lora_compat``.
"""

from __future__ import annotations

import json
import threading
import time
import types
from typing import Any

import torch

from lorasync.engines.vllm._build import fold_scaling, owned_copy
from lorasync.engines.vllm._protocol import CONFIG_KEY, CUDA_UPDATES, IPC_PREFIX, NO_STAGE, PING, CudaStage, ShmStage, check_token, read_stage_file
from lorasync.engines.vllm._slots import install_slot_write, slot_writes
from lorasync.engines.vllm._template import build_from_template, layout_key, remember, template_builds
from lorasync.engines.vllm._timings import load_timings, record_build, time_adds
from lorasync.errors import ConfigError, CudaIpcUnavailableError
from lorasync.wire.cuda_ipc import import_tensors
from lorasync.wire.shm import read_segment

__all__ = ["CONFIG_KEY", "IPC_PREFIX", "LoraSyncWorkerExtension"]

_STAGED: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
# Released by lorasync while a request this worker runs still names them (a forced retirement):
# vLLM rebuilds the adapter for that request from here once it is evicted. Dropped as soon as no
# request of this worker names them.
_RELEASED: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
_LOCK = threading.Lock()


class LoraSyncWorkerExtension:
    """Methods mixed into vLLM's worker; call them through ``/collective_rpc``."""

    def lorasync_ping(self) -> str:
        # The client's capability probe: teaches the LoRA manager lorasync's paths already, so the
        # first publish can take the one-trip load (stage spec read at load).
        if getattr(getattr(self, "model_runner", None), "lora_manager", None) is not None:
            _install_loader(self)
        return ":".join((PING, CUDA_UPDATES))  # what this worker has beyond an older one's

    def lorasync_stage_adapter(self, spec_json: str) -> dict[str, Any]:
        """Copy an adapter out of shared memory and make its IPC path loadable.

        ``spec_json``: a :class:`~lorasync.engines.vllm._protocol.ShmStage` with a token.
        """
        spec = ShmStage.from_json(spec_json)
        token = check_token(spec.token)
        # One copy of the segment's data, cut into views: each build then copies (and casts) it
        # whole (_build.owned_copy), not tensor by tensor.
        tensors, metadata = read_segment(spec.shm, spec.nbytes, one_buffer=True)
        return _stage(self, token, tensors, metadata)

    def lorasync_stage_adapter_cuda(self, spec_json: str) -> dict[str, Any]:
        """Copy an adapter out of the trainer's GPU memory (CUDA IPC) and make its IPC path loadable.

        ``spec_json``: a :class:`~lorasync.engines.vllm._protocol.CudaStage`. Answers ``{"staged": True, ...}``
        once the tensors are in this worker's own memory (the trainer may then free its
        buffer), or ``{"staged": False, "reason": ...}`` when this worker cannot map the
        trainer's GPU, so the caller falls back to shared memory.

        A worker on a GPU keeps the copy on its GPU: vLLM then builds the adapter there and fills
        its GPU LoRA slots device to device (measured on an H200, Qwen3-8B r16: the worker's
        add 27 ms instead of 44 ms, and no 175 MB crossing the host). A worker without a GPU
        (vLLM CPU) copies straight into page-locked host memory in one transfer.
        """
        stage = CudaStage.from_json(spec_json)
        token = stage.token
        try:
            tensors, metadata = import_tensors(stage.ipc, device=_stage_device(self, stage.on_gpu))
        except CudaIpcUnavailableError as exc:
            return {"token": token, "staged": False, "reason": str(exc)}
        return _stage(self, token, tensors, metadata)

    def lorasync_stage_adapter_local(self, token: str, tensors: dict[str, torch.Tensor], config_json: str) -> dict[str, Any]:
        """Stage tensors handed over in this very process (an in-process ``vllm.LLM`` whose engine
        core and worker run in the caller's process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
        verl and colocated trainers run it). CUDA IPC cannot map a process's own memory, so
        without this such an engine fell back to shared memory: every byte to the host and back.

        The worker keeps its own copy on its own device (a GPU-to-GPU copy for a GPU trainer),
        never the caller's tensors (design invariant 7).
        """
        token = check_token(token)
        device = _stage_device(self, False)
        copies = {k: t.detach().to(device=device, copy=True) for k, t in tensors.items()}
        return _stage(self, token, copies, {CONFIG_KEY: config_json})

    def lorasync_load_timings(self) -> list[dict[str, Any]]:
        """This worker's last loads of staged adapters, oldest first: ``{"name", "stage_s", "build_s",
        "add_s"}`` (:mod:`~lorasync.engines.vllm._timings`)."""
        return load_timings()

    def lorasync_slot_writes(self) -> int:
        """How many adapter activations this worker did with lorasync's slot write."""
        return slot_writes()

    def lorasync_release_adapter(self, token: str) -> bool:
        """Drop the tensors staged under ``token`` (the adapter was unloaded). A request this
        worker still runs on them keeps them until it finished (see ``_RELEASED``)."""
        running = _running_tokens(self)
        with _LOCK:
            staged = _STAGED.pop(token, None)
            if staged is not None and token in running:
                _RELEASED[token] = staged
            for kept in [t for t in _RELEASED if t not in running]:
                del _RELEASED[kept]
        return staged is not None

    def lorasync_staged(self) -> list[str]:
        """Tokens whose tensors this worker holds: staged, or released but still needed by a request."""
        running = _running_tokens(self)
        with _LOCK:
            for kept in [t for t in _RELEASED if t not in running]:
                del _RELEASED[kept]
            return sorted({*_STAGED, *_RELEASED})

    def lorasync_update_weights(self, spec_json: str) -> dict[str, Any]:
        """Load base weights (HF names) from shared memory with the model's own ``load_weights``.

        ``spec_json``: a :class:`~lorasync.engines.vllm._protocol.ShmStage` without a token.
        """
        spec = ShmStage.from_json(spec_json)
        tensors, _ = read_segment(spec.shm, spec.nbytes)
        return _reload(self, tensors)

    def lorasync_update_weights_cuda(self, spec_json: str) -> dict[str, Any]:
        """Load base weights (HF names) from the trainer's GPU memory (CUDA IPC) into this
        worker's GPU, device to device, then as :meth:`lorasync_update_weights`.

        ``spec_json``: ``CudaShare.spec`` of ``lorasync.wire.cuda_ipc`` as JSON. Answers
        ``{"staged": False, "reason": ...}`` when this worker cannot map that memory (the client
        then sends the bucket through shared memory).
        """
        try:
            tensors, _ = import_tensors(json.loads(spec_json), device=_stage_device(self, False))
        except CudaIpcUnavailableError as exc:
            return {"staged": False, "reason": str(exc)}
        return {**_reload(self, tensors), "staged": True}


def _reload(worker: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load base weights (HF names) with the model's own loader, as a checkpoint would."""
    from lorasync.engines.vllm import _lora_compat
    from lorasync.engines.vllm._surface import version_text

    rules = _lora_compat.rules_for(version_text())
    if rules.base_layer_names:
        tensors = _lora_compat.to_base_layer_names(tensors, worker.model_runner.model)
    # reload_weights re-runs the post-load processing (CPU/GPU kernels repack weights) and
    # resets LoRA state derived from the old weights.
    worker.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    return {"updated": len(tensors)}


def _stage_device(worker: Any, on_gpu: bool) -> Any:
    """Where a CUDA IPC stage keeps its copy: the worker's own GPU when the worker runs on one
    (vLLM then builds the adapter and fills its GPU slots from device memory: no byte crosses
    the host, design invariant 14), else page-locked host memory. ``on_gpu``: the caller asks for
    the GPU (a colocated engine); None then means the producer's GPU as this process numbers it."""
    if on_gpu:
        return None
    device = getattr(getattr(worker, "model_runner", None), "device", None) or getattr(worker, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return device
    return "cpu"


def _running_tokens(worker: Any) -> set[str]:
    """Staging tokens named by the requests this worker's model runner holds (scheduled at least
    once and not finished: running or preempted). Requests still waiting in the scheduler are
    not known here; the in-process engine's Frontend covers those."""
    requests = getattr(getattr(worker, "model_runner", None), "requests", None)
    if not isinstance(requests, dict):
        return set()
    paths = {str(getattr(getattr(r, "lora_request", None), "lora_path", "")) for r in list(requests.values())}
    return {p[len(IPC_PREFIX) :] for p in paths if p.startswith(IPC_PREFIX)}


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
        token = path[len(IPC_PREFIX) :]
        start = time.perf_counter()
        _stage_from_file(worker, token)
        staged = time.perf_counter()
        templated = template_builds()
        lora = _load_staged(self, lora_request, token)
        record_build(lora_request.lora_name, staged - start, time.perf_counter() - staged, templated=template_builds() > templated)
        return lora

    manager._load_adapter = types.MethodType(_load_adapter, manager)
    install_slot_write(getattr(manager, "_adapter_manager", None))
    time_adds(manager, IPC_PREFIX)
    manager._lorasync_installed = True


def _stage_from_file(worker: Any, token: str) -> None:
    """Stage ``token`` from the spec file its client wrote beside the load (one round trip:
    ``_protocol.write_stage_file``), unless it is staged already or there is no such file (the
    load then answers vLLM's "not found", and a client of the one-trip path stages by RPC).

    Raises:
        RuntimeError: the spec names GPU memory this worker cannot map; says ``NO_STAGE``.
    """
    with _LOCK:
        if token in _STAGED or token in _RELEASED:
            return
    stage = read_stage_file(token)
    if stage is None:
        return
    try:
        tensors, metadata = import_tensors(stage.ipc, device=_stage_device(worker, stage.on_gpu))
    except CudaIpcUnavailableError as exc:
        raise RuntimeError(f"{NO_STAGE}: {exc}") from exc
    _stage(worker, token, tensors, metadata)


#: Where vLLM keeps ``LoRAAdapterNotFoundError``, newest first (0.32: ``vllm.exceptions``).
def _not_found(lora_name: str, lora_path: str) -> Exception:
    """vLLM's own "no adapter found" error (the HTTP server answers it with 404, and lorasync's
    clients map its text to ``AdapterNotFoundError``), from whichever module this vLLM has it in."""
    from lorasync.engines.vllm._surface import resolve
    from lorasync.errors import CapabilityError

    try:
        return resolve("LoRAAdapterNotFoundError")(lora_name, lora_path)
    except CapabilityError:  # a vLLM without it: the same words, which the clients map too
        return FileNotFoundError(f"Loading lora {lora_name} failed: No adapter found for {lora_path}")


def _load_staged(manager: Any, lora_request: Any, token: str) -> Any:
    # Mirrors vLLM 0.32-0.34 WorkerLoRAManager._load_adapter / LoRAModel.from_local_checkpoint with
    # the tensors and config taken from the staging area instead of a directory.
    from lorasync.engines.vllm._surface import resolve  # vLLM's names, wherever this release keeps them

    from lorasync.engines.vllm import _lora_compat
    from lorasync.engines.vllm._surface import version_text

    PEFTHelper = resolve("PEFTHelper")  # noqa: N806 - vLLM's class
    rules = _lora_compat.rules_for(version_text())

    with _LOCK:
        staged = _STAGED.get(token) or _RELEASED.get(token)
    if staged is None:
        raise _not_found(lora_request.lora_name, lora_request.lora_path)
    tensors, config = staged
    adapter_manager = manager._adapter_manager
    peft_helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft_helper.validate_legal(manager.lora_config)
    model = adapter_manager.model
    mapper = _lora_compat.rename_mapper(rules, model)
    skip_prefixes = getattr(model, "lora_skip_prefixes", None)
    # 0.34 also refuses factors of layers it does not wrap (BERT's pooler.dense); none before.
    unsupported = getattr(adapter_manager, "unsupported_lora_modules", None)
    # Every step publishes the same key set: the check (a regex per key) runs once per key set and
    # manager; only a set that passed is remembered.
    checked = adapter_manager.__dict__.setdefault("_lorasync_checked_keys", set())
    key_set = (tuple(tensors), tuple(sorted(peft_helper.modules_to_save or ())))
    unexpected = [] if key_set in checked else _unexpected_modules(tensors, _expected_modules(adapter_manager), mapper, skip_prefixes, peft_helper, unsupported)
    if not unexpected and len(checked) < 64:
        checked.add(key_set)
    if unexpected:
        raise ValueError(
            f"While loading {lora_request.lora_path}, expected target modules in {_expected_modules(adapter_manager)} but "
            f"received {unexpected}. Please verify that the loaded LoRA module is correct"
        )
    dtype = manager.lora_config.lora_dtype
    tensors = _local_experts(tensors, getattr(adapter_manager, "moe_ep_load_spec", None))
    # A copy per build: the scale is folded into lora_B in place, and vLLM rebuilds an evicted
    # adapter from this same staged snapshot, which must stay as staged. The copy stays where
    # the staged tensors are (host memory, or the worker's GPU), one kernel per run (_build).
    copies = owned_copy(tensors, dtype if isinstance(dtype, torch.dtype) else None)
    # Where the staged copy is: page-locked host memory (vLLM's LoRA cache), or the worker's
    # GPU for a colocated engine (on_gpu), where vLLM's slots copy it from device memory.
    device = str(next(iter(tensors.values())).device) if tensors else "cpu"
    key = layout_key(copies, config, device, dtype)
    # The layout vLLM built before (every step of a run): its build again, without the name parse.
    lora = build_from_template(adapter_manager, key, lora_request.lora_int_id, copies)
    if lora is None:
        lora = manager._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_request.lora_int_id,
            tensors=copies,
            peft_helper=peft_helper,
            device=device,
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=skip_prefixes,
        )
        remember(adapter_manager, key, lora, copies)  # before the fold and the packing change it
    # As vLLM's loader does: the request says whether the factors are PEFT's fused 3-D layout.
    lora.is_3d_lora_weight = bool(getattr(lora_request, "is_3d_lora_weight", False))
    lora._lorasync_staged = True  # activations of it may take the slot write
    fold_scaling(lora.loras)  # what vLLM's optimize() would do module by module, in a few kernels
    _lora_compat.validate(rules, adapter_manager, lora)
    return lora


# -- vLLM 0.32's own checks of a checkpoint's module names, for tensors instead of a directory -------


def _expected_modules(adapter_manager: Any) -> set[str]:
    """The module names vLLM's ``WorkerLoRAManager._load_adapter`` expects: every supported module,
    a packed one as its parts, and ``experts`` itself besides its per-expert parts
    (``experts.0.gate_proj`` ... from the model's expert mapping)."""
    expected: set[str] = set()
    packed = adapter_manager.packed_modules_mapping
    for module in adapter_manager.supported_lora_modules:
        expected.update(packed.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def _unexpected_modules(
    tensors: dict[str, torch.Tensor], expected: set[str], mapper: Any, skip_prefixes: Any, peft_helper: Any, unsupported: Any = None
) -> list[str]:
    """The modules vLLM's ``LoRAModel.from_local_checkpoint`` refuses (its ``check_unexpected_modules``):
    base embeddings, PEFT's fused ``base_layer`` factors and skipped prefixes pass; an expert
    module is checked by its name from ``experts`` on (``experts.3.gate_proj``), any other by its
    last segment (or as a ``modules_to_save`` entry); from 0.34 a module vLLM matched but did not
    wrap (``unsupported``, its ``unsupported_lora_modules``) is refused by its full name too."""
    from lorasync.engines.vllm._surface import resolve  # vLLM's names, wherever this release keeps them

    LoRAModel = resolve("LoRAModel")  # noqa: N806 - vLLM's class
    is_base_embedding_weights = resolve("is_base_embedding_weights")
    parse_fine_tuned_lora_name = resolve("parse_fine_tuned_lora_name")

    unexpected = []
    for key in tensors:
        if is_base_embedding_weights(key) or "base_layer" in key:
            continue
        if skip_prefixes and LoRAModel._should_skip_module(key, skip_prefixes):
            continue
        module_name, _ = parse_fine_tuned_lora_name(key, mapper)
        if ".experts" in module_name:
            if module_name[module_name.find(".experts") + 1 :] not in expected:
                unexpected.append(module_name)
        elif module_name.rsplit(".", 1)[-1] not in expected and module_name.rsplit(".", 1)[-1] not in (peft_helper.modules_to_save or ()):
            unexpected.append(module_name)
        elif module_name in (unsupported or ()):
            unexpected.append(f"{module_name} (not a LoRA layer)")
    return unexpected


def _local_experts(tensors: dict[str, torch.Tensor], spec: Any) -> dict[str, torch.Tensor]:
    """``tensors`` without the experts of other expert-parallel ranks, as vLLM's disk loader skips
    them (``moe_ep_spec``); all of them without expert parallelism."""
    if spec is None:
        return tensors
    from lorasync.engines.vllm._surface import resolve

    _is_remote_expert_key = resolve("_is_remote_expert_key")
    return {k: v for k, v in tensors.items() if not _is_remote_expert_key(k, spec)}
