"""SGLang's own HTTP server over an in-process scheduler: the test peer of the SGLang client.

SGLang serves no model on CPU, but its HTTP layer imports fine. This module runs SGLang's real
FastAPI ``app`` (``sglang.srt.entrypoints.http_server``: routes, request classes, JSON envelopes,
auth middleware) with SGLang's real tokenizer-side LoRA logic (``TokenizerControlMixin``:
registry, locks, eviction, implicit reload; ``TokenizerManager._resolve_lora_path``) and SGLang's
real scheduler-side checks (``LoRAManager`` validation and error texts, ``LoRAMemoryPool.can_support``,
``LoRAAdapter`` weight loading and q/k/v packing, the 0.5.23 weight-update session of
``SchedulerWeightUpdaterManager``, ``MultiprocessingSerializer``'s safe unpickler). Only the GPU
parts are replaced: a tiny HF Llama on CPU runs ``/generate`` with the adapter's packed weights
applied by forward hooks at SGLang's scale (``lora_alpha / r``).

It is a test peer, not part of the wheel, and must run in the SGLang venv
(``scripts/sglang-venv.sh``)::

    python tests/peers/sglang_contract.py --port 30000 --model-path DIR \\
        --enable-lora --max-lora-rank 16 --lora-target-modules q_proj v_proj

Every ``sglang.launch_server`` flag is accepted, plus ``--lora-protocol tensors|streamed``:
``streamed`` serves SGLang main's streamed adapters (PR #36384; see ``sglang_main.py``) instead of
0.5.23's ``/load_lora_adapter_from_tensors``. Test-only routes live under ``/_contract``:
``GET /_contract/requests`` (the request log, with each body's keys checked against SGLang's
request class: ``unknown`` lists keys SGLang would silently ignore), ``POST /_contract/reset``
(clear the log and injected faults) and ``POST /_contract/fail`` ``{"path", "status", "times",
"after", "delay", "lose"}`` (let ``after`` requests to ``path`` through, then answer the next ``times``
with ``status`` before SGLang sees them, after ``delay`` seconds; status 0 only delays; with
``lose`` SGLang handles the request and its answer is replaced by ``status``, 502 by default: an
answer lost after the request landed). ``POST /_contract/factors`` ``{"lora_name"}`` answers what
SGLang computes with for a loaded adapter: its scale and the sha256 of each module's A and B.

Loads from tensors run SGLang's own ``TpModelWorker.load_lora_adapter_from_tensors``, which
checks ``expected_checksums`` (sha256 per tensor) before the load; what it raises (a mismatch, a
payload that does not unpickle) kills the peer as it kills SGLang 0.5.23's server (the scheduler
process dies, and SIGQUIT takes the rest down): the request is never answered.

Requests in flight, under test control: ``POST /_contract/hold`` ``{"lora_name"}`` makes every
later ``/generate`` on that adapter stop after SGLang's own ``_validate_and_resolve_lora`` has
acquired it (the registry counts it in use, as for a request the scheduler is decoding) until
``POST /_contract/release`` ``{"lora_name"}``; ``GET /_contract/inflight`` lists the requests in
flight and SGLang's own per-adapter use counts. Unload is SGLang's own
(``TokenizerControlMixin._unload_lora_adapter_locked``): it unregisters the name at once, then
waits in ``LoRARegistry.wait_for_unload`` until every request holding the adapter has released
it, holding ``lora_update_lock`` the whole time (so a load, or an implicit reload, waits too).

This module is long (about 720 lines) because it is one peer: SGLang's app, its scheduler
stand-in and the test routes must be started together in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
import types
import warnings
from typing import Any

__all__ = ["build_app", "main"]

logger = logging.getLogger("lorasync.sglang_contract")

# Route -> name of the SGLang request class its body decodes into.
ROUTE_STRUCTS = {
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/generate": "GenerateReqInput",
    "/register_lora_adapter": "RegisterLoRAAdapterReqInput",
}

# Llama packing SGLang applies (lora.py normalize_qkv_proj / normalize_gate_up_proj): packed
# module -> HF leaves in slice order.
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _struct_fields(name: str) -> set[str]:
    import msgspec

    if name == "RegisterLoRAAdapterReqInput":  # SGLang main's, recorded (sglang_main_facts.json)
        from sglang_main import FACTS

        return set(FACTS["structs"][name]) | {"rid", "http_worker_ipc"}

    from sglang.srt.managers import io_struct

    cls = getattr(io_struct, name)
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {f.name for f in msgspec.structs.fields(cls)}


class _Runner:
    """What SGLang's model runner does for weight updates, on the tiny HF model."""

    def __init__(self, scheduler: _Scheduler) -> None:
        self.weight_updater = self
        self._scheduler = scheduler

    def begin_weight_update(self) -> None:
        if self._scheduler.streamed is not None:
            self._scheduler.streamed.stash = {}  # SGLang main: each session starts with an empty stash

    def end_weight_update(self, *, run_post_load: bool) -> None:
        pass

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None) -> tuple[bool, str]:
        if load_format not in (None, "direct"):
            raise NotImplementedError(f"Unknown load_format={load_format}")
        if self._scheduler.streamed is not None:  # SGLang main: "{lora}:{key}" tensors go to the stash
            named_tensors, refusal = self._scheduler.streamed.split(named_tensors)
            if refusal is not None:
                return False, refusal
        self._scheduler.load_base_weights(named_tensors)
        return True, "Success"

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None, recapture_cuda_graph: bool = False
    ) -> tuple[bool, str]:
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import DefaultModelLoader

        try:
            loader = DefaultModelLoader(LoadConfig(load_format=load_format or "auto"))
            weights = loader._get_weights_iterator(DefaultModelLoader.Source(model_path, revision=None))
            self._scheduler.load_base_weights(list(weights))
        except Exception as exc:  # SGLang reports loader failures in the message
            return False, f"Failed to update weights: {exc}.\nRolling back to original weights."
        return True, "Succeeded to update model weights."


class _ModelRunner:
    """ModelRunner's LoRA entry (SGLang's own method) over the peer's LoRA manager."""

    def __init__(self, lora_manager: Any) -> None:
        self.lora_manager = lora_manager

    def load_lora_adapter_from_tensors(self, lora_ref: Any, tensors: Any, config_dict: Any, added_tokens_config: Any = None) -> Any:
        # ModelRunner.load_lora_adapter_from_tensors, verbatim (importing ModelRunner costs ~12 s).
        return self.lora_manager.load_lora_adapter_from_tensors(lora_ref, tensors, config_dict, added_tokens_config)


class _TpWorker:
    """The TP worker: SGLang's own ``TpModelWorker`` methods for deserializing a rank's payload and
    loading an adapter from tensors (the ``expected_checksums`` check lives there)."""

    def __init__(self, scheduler: _Scheduler) -> None:
        from sglang.srt.managers.tp_worker import TpModelWorker

        self.runner = _Runner(scheduler)
        self.model_runner = _ModelRunner(scheduler.lora_manager)
        # SGLang's own, unbound: they read only deserialize_own_rank, model_runner and the TP rank.
        self.deserialize_own_rank = types.MethodType(TpModelWorker.deserialize_own_rank, self)
        self.load_lora_adapter_from_tensors = types.MethodType(TpModelWorker.load_lora_adapter_from_tensors, self)

    def weight_update_runners(self) -> list[tuple[str, Any]]:
        return [("target", self.runner)]


class _Scheduler:
    """The scheduler process, in-process: SGLang's LoRAManager and weight updater on CPU."""

    def __init__(self, server_args: Any, *, streamed: bool = False) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.lora.lora_manager import LoRAManager
        from sglang.srt.lora.mem_pool import LoRAMemoryPool
        from sglang.srt.lora.utils import get_normalized_target_modules
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

        model_path = server_args.model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        hf_config = AutoConfig.from_pretrained(model_path)
        self.hf_config = hf_config

        # LoRAManager without its GPU half (__init__ builds CUDA buffers); the methods used here
        # (_load_lora_adapter, validate_new_adapter, load_lora_weights, _unload_lora_adapter,
        # _load_lora_adapter_from_tensors) are SGLang's own.
        manager = object.__new__(LoRAManager)
        manager.base_hf_config = hf_config
        manager.load_config = LoadConfig()
        manager.lora_backend = None
        manager.base_model = None
        manager.speculative_algorithm = None
        manager.attn_dp_enabled = False
        manager.max_loras_per_batch = server_args.max_loras_per_batch
        manager.configs, manager.loras, manager.lora_refs = {}, {}, {}
        manager.num_pinned_loras = 0
        targets = server_args.lora_target_modules or ["all"]
        normalized = get_normalized_target_modules(targets)
        if "all" in normalized:  # auto_detect_lora_target_modules on a Llama
            normalized = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        pool = types.SimpleNamespace(
            max_lora_rank=server_args.max_lora_rank or 0,
            lora_added_tokens_size=0,
            target_modules=normalized,
            remove_lora=lambda lora_id: None,
        )
        pool.can_support = types.MethodType(LoRAMemoryPool.can_support, pool)
        manager.memory_pool = pool
        self.lora_manager = manager

        # The 0.5.23 weight-update session, SGLang's own (slots dataclass built field by field
        # because __post_init__ reads a TP process group).
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        updater = object.__new__(SchedulerWeightUpdaterManager)
        updater.tp_worker = _TpWorker(self)
        updater.draft_worker = None
        updater.memory_saver_adapter = None
        updater.flush_cache = lambda empty_cache=False: True
        updater.is_fully_idle = lambda **_: True
        updater.scheduler = types.SimpleNamespace(record_weight_version_change=lambda new_version=None: None)
        updater.metrics_collector = None
        updater.offload_tags = set()
        updater.stashed_model_static_state = None
        updater._session = None
        updater.tp_cpu_group = torch.distributed.group.WORLD
        self.weight_updater = updater
        self.lora_enabled = bool(server_args.enable_lora)
        if streamed:
            from sglang_main import StreamedLoRA

            self.streamed: Any = StreamedLoRA(self)
        else:
            self.streamed = None

    # -- requests from the tokenizer manager ------------------------------------------------

    def handle(self, obj: Any) -> Any:
        from sglang.srt.managers import io_struct as io

        name = type(obj).__name__
        lm = self.lora_manager
        if isinstance(obj, io.LoadLoRAAdapterFromTensorsReqInput):
            # SGLang's own TpModelWorker.load_lora_adapter_from_tensors: this rank's payload, the
            # expected_checksums check (sha256 per tensor), then the LoRA manager's load.
            try:
                return self.weight_updater.tp_worker.load_lora_adapter_from_tensors(obj)
            except Exception:  # a torn payload, a checksum mismatch: SGLang's scheduler dies of it
                _die_like_the_scheduler()
        if isinstance(obj, io.LoadLoRAAdapterReqInput):
            return lm._load_lora_adapter(obj.to_ref())
        if isinstance(obj, io.UnloadLoRAAdapterReqInput):
            if self.streamed is not None:
                self.streamed.forget(obj.lora_name)
            return lm._unload_lora_adapter(obj.to_ref())
        if isinstance(obj, io.BeginWeightUpdateReqInput):
            return self.weight_updater.begin_weight_update(obj)
        if isinstance(obj, io.EndWeightUpdateReqInput):
            out = self.weight_updater.end_weight_update(obj)
            if self.streamed is None or not out.success:
                return out
            success, message = self.streamed.apply()  # SGLang main: after the session closed
            return io.EndWeightUpdateReqOutput(success=success, message=message)
        if isinstance(obj, io.UpdateWeightsFromTensorReqInput):
            return self.weight_updater.update_weights_from_tensor(obj)
        if isinstance(obj, io.UpdateWeightFromDiskReqInput):
            return self.weight_updater.update_weights_from_disk(obj)
        if isinstance(obj, io.GetInternalStateReq):
            return io.GetInternalStateReqOutput(internal_state={"loaded_lora_ids": sorted(lm.loras)})
        raise NotImplementedError(f"the SGLang contract server does not handle {name}")

    def load_base_weights(self, named_tensors: Any) -> None:
        import torch

        params = dict(self.model.named_parameters())
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        with torch.no_grad():
            for name, tensor in items:
                if name in params:  # SGLang's Llama.load_weights skips unknown names
                    params[name].copy_(tensor.to(params[name].dtype))

    # -- generation --------------------------------------------------------------------------

    def generate(self, input_ids: list[int], *, lora_id: str | None, max_new_tokens: int, return_logprob: bool) -> dict[str, Any]:
        import torch

        hooks = self._lora_hooks(lora_id) if lora_id else []
        try:
            ids = list(input_ids)
            out_ids: list[int] = []
            logprobs: list[float] = []
            with torch.no_grad():
                for _ in range(max_new_tokens):
                    logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                    token = int(torch.argmax(logits))
                    logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                    out_ids.append(token)
                    ids.append(token)
        finally:
            for hook in hooks:
                hook.remove()
        meta: dict[str, Any] = {
            "finish_reason": {"type": "length", "length": max_new_tokens},
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in zip(logprobs, out_ids)]
        return {"text": self.tokenizer.decode(out_ids), "output_ids": out_ids, "meta_info": meta}

    def _lora_hooks(self, lora_id: str) -> list[Any]:
        """Forward hooks adding scale·B·A·x from SGLang's packed LoRAAdapter weights."""
        scale, deltas = self.factors(lora_id)
        hooks = []
        for path, (a, b) in deltas.items():
            module = self._module(path)

            def hook(mod: Any, args: Any, output: Any, a: Any = a, b: Any = b) -> Any:
                return output + scale * (args[0] @ a.T.to(args[0].dtype)) @ b.T.to(args[0].dtype)

            hooks.append(module.register_forward_hook(hook))
        return hooks

    def factors(self, lora_id: str) -> tuple[float, dict[str, tuple[Any, Any]]]:
        """SGLang's scale (``LoRAAdapter.scaling``) and each leaf module's (A, B), unpacked from
        SGLang's packed ``qkv_proj`` / ``gate_up_proj`` weights: what it computes with."""
        adapter = self.lora_manager.loras[lora_id]
        r = adapter.config.r
        deltas: dict[str, tuple[Any, Any]] = {}
        for layer_id, layer in enumerate(adapter.layers):
            for name, weight in layer.weights.items():
                if "lora_A" not in name:
                    continue
                b = layer.weights.get(name.replace("lora_A", "lora_B"))
                if b is None:
                    continue
                for packed, leaves in _PACKED.items():
                    if f".{packed}." in name:
                        prefix = name.split(f".{packed}.")[0]
                        offset = 0
                        for i, leaf in enumerate(leaves):
                            out = self._module(f"{prefix}.{leaf}").out_features
                            deltas[f"{prefix}.{leaf}"] = (weight[i * r : (i + 1) * r], b[offset : offset + out])
                            offset += out
                        break
                else:
                    deltas[name.split(".lora_A")[0]] = (weight, b)
        return adapter.scaling, deltas

    def _module(self, path: str) -> Any:
        path = path.removeprefix("base_model.model.")
        return self.model.get_submodule(path)


def _die_like_the_scheduler() -> None:
    """What SGLang 0.5.23 does when its scheduler's handler raises (``run_scheduler_process``: log
    "Scheduler hit an exception", SIGQUIT to the server, whose handler kills the process tree):
    the whole server dies, and the request that caused it is never answered."""
    import signal
    import traceback

    logger.error("Scheduler hit an exception: %s", traceback.format_exc())
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _fake_tokenizer_manager(server_args: Any, scheduler: _Scheduler) -> Any:  # noqa: C901 - one class
    """A TokenizerManager whose scheduler link is a function call instead of ZMQ."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.lora.lora_registry import LoRARegistry
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.runtime_context import get_lora, get_serving
    from sglang.srt.utils.aio_rwlock import RWLock
    from sglang.utils import TypeBasedDispatcher

    class ContractTokenizerManager(TokenizerControlMixin):
        # SGLang's own request-side LoRA resolution (never-loaded error, implicit reload).
        _validate_and_resolve_lora = TokenizerManager._validate_and_resolve_lora
        _resolve_lora_path = TokenizerManager._resolve_lora_path
        config_value = TokenizerManager.config_value
        serving_chat_class = TokenizerManager.serving_chat_class

        def __init__(self) -> None:
            self.server_args = server_args
            self.scheduler = scheduler
            self.enable_lora = get_lora().enable_lora
            self.served_model_name = get_serving().served_model_name or server_args.model_path
            self.model_path = server_args.model_path
            self.model_config = ModelConfig.from_server_args(server_args)
            self.tokenizer = scheduler.tokenizer
            self.processor = self.mm_processor = None
            self.is_generation = True
            self.gracefully_exit = False
            self.server_status = ServerStatus.Up
            self.startup_time = time.time()
            self.last_receive_tstamp = time.time()
            self.event_loop = None
            self.rid_to_state: dict[str, Any] = {}
            self.model_update_lock = RWLock()
            self.is_pause = False
            self.is_pause_cond = asyncio.Condition()
            self.initial_weights_loaded = True
            self.lora_registry = LoRARegistry(get_lora().lora_paths)
            if scheduler.streamed is not None:
                from sglang_main import never_evict_streamed

                never_evict_streamed(self.lora_registry)
            self.lora_update_lock = asyncio.Lock()
            self.lora_ref_cache: dict[str, Any] = {}
            self.pending_lora_unloads: dict[str, str] = {}
            self.weight_version = "default"
            self.holds: dict[str, asyncio.Event] = {}  # lora name -> gate of held requests
            self.inflight: dict[str, dict[str, Any]] = {}  # rid -> what the test sees
            self._result_dispatcher = TypeBasedDispatcher([])
            self.init_communicators()

        async def register_lora_adapter(self, obj: Any, request: Any = None) -> Any:
            from sglang_main import register_lora_adapter

            return await register_lora_adapter(self, obj)

        def is_ready(self) -> bool:
            return True

        def is_healthy(self) -> bool:
            return True

        def auto_create_handle_loop(self) -> None:
            if self.event_loop is None:
                self.event_loop = asyncio.get_running_loop()

        def _dispatch_to_scheduler(self, obj: Any) -> None:
            # The scheduler answers through the same dispatcher ZMQ would feed; deliver after
            # the communicator has started waiting, as a socket reply would.
            result = self.scheduler.handle(obj)
            asyncio.get_running_loop().call_soon(self._result_dispatcher, result)

        def abort_request(self, *args: Any, **kwargs: Any) -> None:
            pass

        def _update_weight_version_if_provided(self, weight_version: str | None) -> None:
            if weight_version is not None:
                self.weight_version = weight_version

        async def update_weights_from_disk(self, obj: Any, request: Any = None) -> tuple[bool, str, int]:
            # TokenizerManager.update_weights_from_disk minus the disk-specific ZMQ future.
            self.auto_create_handle_loop()
            async with self.model_update_lock.writer_lock:
                out = self.scheduler.handle(obj)
            message = out.message
            if out.success and obj.weight_version is not None:
                self._update_weight_version_if_provided(obj.weight_version)
                message += f" Weight version updated to {obj.weight_version}."
            return out.success, message, out.num_paused_requests

        async def generate_request(self, obj: Any, request: Any = None) -> Any:
            self.auto_create_handle_loop()
            self.last_receive_tstamp = time.time()  # /health waits for a scheduler reply
            obj.normalize_batch_and_arguments()
            if not obj.is_single or obj.input_ids is None:
                raise ValueError("the SGLang contract server serves single requests with input_ids only")
            await self._validate_and_resolve_lora(obj)
            entry = {"rid": obj.rid, "lora_name": obj.lora_path, "lora_id": getattr(obj, "lora_id", None), "held": False}
            self.inflight[str(obj.rid)] = entry
            try:
                gate = self.holds.get(obj.lora_path) if obj.lora_path else None
                if gate is not None and not gate.is_set():
                    # Like a request the scheduler is decoding: the adapter stays acquired.
                    entry["held"] = True
                    await gate.wait()
                    entry["held"] = False
                params = obj.sampling_params or {}
                out = self.scheduler.generate(
                    obj.input_ids,
                    lora_id=getattr(obj, "lora_id", None) if obj.lora_path else None,
                    max_new_tokens=int(params.get("max_new_tokens", 16)),
                    return_logprob=bool(obj.return_logprob),
                )
            finally:
                self.inflight.pop(str(obj.rid), None)
                if obj.lora_path:
                    await self.lora_registry.release(obj.lora_id)
            out["meta_info"]["id"] = obj.rid
            out["meta_info"]["weight_version"] = self.weight_version
            yield out

    return ContractTokenizerManager()


class _ContractMiddleware:
    """Pure ASGI middleware: request log with schema check, and fault injection."""

    def __init__(self, app: Any, manager: Any) -> None:
        self.app = app
        self.manager = manager
        self.log: list[dict[str, Any]] = []
        self.faults: dict[str, list[dict[str, Any]]] = {}
        self._fields = {route: _struct_fields(name) for route, name in ROUTE_STRUCTS.items()}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith("/_contract/"):
            await self._control(scope, receive, send)
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.log.append(self._entry(scope, body))
        faults = self.faults.get(path)
        lose = None
        if faults:
            fault = faults.pop(0)
            if fault["after"] > 0:  # let this one through, fail a later one
                faults.insert(0, {**fault, "after": fault["after"] - 1})
            elif fault["lose"]:
                lose = fault  # SGLang handles the request; its answer is lost on the way back
            else:
                await asyncio.sleep(fault["delay"])
                if fault["status"]:
                    await _respond(send, fault["status"], b"injected by the contract server", "text/plain")
                    return
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if lose is None:
            await self.app(scope, replay, send)
            return

        async def discard(message: Any) -> None:
            pass

        await self.app(scope, replay, discard)
        await asyncio.sleep(lose["delay"])
        await _respond(send, lose["status"] or 502, b"injected by the contract server after SGLang answered", "text/plain")

    def _entry(self, scope: Any, body: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {"method": scope["method"], "path": scope["path"], "bytes": len(body)}
        try:
            data = json.loads(body) if body.strip() else None
        except ValueError:
            data = None
        if isinstance(data, dict):
            entry["keys"] = sorted(data)
            fields = self._fields.get(scope["path"])
            entry["unknown"] = sorted(set(data) - fields) if fields is not None else None
            entry["body"] = {
                k: ([len(x) for x in v] if k == "serialized_named_tensors" and isinstance(v, list) else v)
                for k, v in data.items()
                if k != "serialized_tensors"
            }
        return entry

    async def _control(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"]
        if path == "/_contract/requests":
            payload: Any = self.log
        elif path == "/_contract/reset":
            self.log.clear()
            self.faults.clear()
            payload = {"ok": True}
        elif path == "/_contract/fail":
            spec = json.loads(body)
            fault = {
                "status": int(spec.get("status", 0)),
                "after": int(spec.get("after", 0)),
                "delay": float(spec.get("delay", 0)),
                "lose": bool(spec.get("lose", False)),
            }
            self.faults.setdefault(spec["path"], []).extend([fault] * int(spec.get("times", 1)))
            payload = {"ok": True}
        elif path == "/_contract/hold":
            self.manager.holds[str(json.loads(body)["lora_name"])] = asyncio.Event()
            payload = {"ok": True}
        elif path == "/_contract/release":
            gate = self.manager.holds.pop(str(json.loads(body)["lora_name"]), None)
            if gate is not None:
                gate.set()
            payload = {"ok": True}
        elif path == "/_contract/inflight":
            payload = self._inflight()
        elif path == "/_contract/factors":
            payload = self._factors(str(json.loads(body)["lora_name"]))
        elif path == "/_contract/stash" and self.manager.scheduler.streamed is not None:
            payload = self.manager.scheduler.streamed.view()
        else:
            await _respond(send, 404, b'{"detail":"Not Found"}', "application/json")
            return
        await _respond(send, 200, json.dumps(payload).encode(), "application/json")


    def _factors(self, name: str) -> dict[str, Any]:
        """What SGLang computes with for adapter ``name``: its scale and the sha256 of each leaf
        module's A and B (bytes of the contiguous tensor, as SGLang's checksums hash them)."""
        import hashlib

        import torch

        def digest(t: Any) -> str:
            return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()

        scale, deltas = self.manager.scheduler.factors(self.manager.lora_ref_cache[name].lora_id)
        modules = {path.removeprefix("base_model.model."): {"A": digest(a), "B": digest(b)} for path, (a, b) in deltas.items()}
        return {"scaling": scale, "modules": modules}

    def _inflight(self) -> dict[str, Any]:
        """Requests in flight, and SGLang's own use count of each adapter id (named through
        ``lora_ref_cache``; an unloading adapter keeps its count until it drains)."""
        manager = self.manager
        names = {ref.lora_id: name for name, ref in manager.lora_ref_cache.items()}
        counters = manager.lora_registry._counters
        in_use = {names.get(lora_id, lora_id): counter.value() for lora_id, counter in counters.items() if counter.value()}
        return {
            "requests": list(manager.inflight.values()),
            "in_use": in_use,
            "registered": sorted(manager.lora_registry.get_all_adapters()),
            "unloading": sorted(manager.pending_lora_unloads),
        }


async def _respond(send: Any, status: int, body: bytes, content_type: str) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(argv: list[str]) -> Any:
    """SGLang's FastAPI app wired to the in-process scheduler.

    Args:
        argv (`list[str]`): ``sglang.launch_server`` arguments (``--model-path`` required).

    Returns:
        The ASGI app to serve (SGLang's ``app`` wrapped in the contract middleware).
    """
    if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # sglang_main beside this file
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sglang.srt.entrypoints import http_server
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.runtime_context import get_serving, publish
    from sglang.srt.server_args import prepare_server_args

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--lora-protocol", choices=("tensors", "streamed"), default="tensors")
    ours, argv = parser.parse_known_args(argv)
    server_args = prepare_server_args([*argv, "--device", "cpu", "--skip-server-warmup"])
    publish(server_args, role="tokenizer")
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=0)  # the one TP rank: SGLang's TpModelWorker reads it
    scheduler = _Scheduler(server_args, streamed=ours.lora_protocol == "streamed")
    manager = _fake_tokenizer_manager(server_args, scheduler)
    template_manager = TemplateManager()
    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=manager,
            template_manager=template_manager,
            scheduler_info={"max_req_input_len": 512, "max_total_num_tokens": 4096},
        )
    )
    app = http_server.app
    if scheduler.streamed is not None:
        from sglang_main import install_routes

        install_routes(app, manager)
    # No warmup to run and no scheduler to freeze: the warmup thread would only post
    # /freeze_gc before uvicorn listens.
    http_server._freeze_gc_after_server_warmup = lambda server_args: None
    # What _setup_and_run_http_server does for one tokenizer worker.
    app.is_single_tokenizer_mode = True
    app.server_args = server_args
    app.warmup_thread_kwargs = dict(server_args=server_args)
    if get_serving().api_key or get_serving().admin_api_key:
        from sglang.srt.utils.auth import add_api_key_middleware

        add_api_key_middleware(app, api_key=get_serving().api_key, admin_api_key=get_serving().admin_api_key)
    return _ContractMiddleware(app, manager)


def main(argv: list[str] | None = None) -> None:
    """Run the contract server under uvicorn (``--host``/``--port`` as for SGLang)."""
    import uvicorn

    warnings.filterwarnings("ignore")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    known, _ = parser.parse_known_args(argv)
    logging.basicConfig(level=os.environ.get("LORASYNC_CONTRACT_LOG", "WARNING"))
    app = build_app(argv)
    uvicorn.run(app, host=known.host, port=known.port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
