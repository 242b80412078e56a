"""An engine for a vLLM (V1) living in the trainer's own process: ``vllm.LLM`` or ``AsyncLLM``.

``connect("vllm-inprocess", llm=llm)`` wraps either; no HTTP server, no dev mode. Adapters reach
the workers as tensors: lorasync writes them into one shared-memory segment and every worker
copies them out through ``llm.collective_rpc("lorasync_stage_adapter", ...)`` (lorasync's
worker extension, built with ``worker_extension_cls=WORKER_EXTENSION``; JSON specs, no pickle),
then ``add_lora`` registers a :class:`vllm.lora.request.LoRARequest` whose path names the staged
tensors. Without the extension the publisher falls back to the disk transport (``load_adapter``
of a directory). vLLM itself keeps no names: :meth:`VLLMInProcessEngine.lora_request` gives the
request object to pass to ``llm.generate(..., lora_request=...)``.

Each operation is written once as a generator of steps (a method of the engine core and its
arguments) and driven two ways by ``_steps.StepDriver``, as the HTTP clients do with their
calls: directly for a ``vllm.LLM``, awaited on the AsyncLLM's own event loop for an ``AsyncLLM``.

What the engine objects over one vLLM share — one sender into a sync ``LLM``'s engine core,
retired versions refused when a request for them is submitted, and staged tensors kept while a
request may still make vLLM rebuild the adapter — lives in ``_frontend.Frontend``.

Tested against vLLM 0.32 (CPU build). The module runs over 400 lines because each operation is
written once for both the sync ``LLM`` and the ``AsyncLLM``, and each is documented.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import threading
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from lorasync.adapter._moe import group_experts
from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines.vllm._frontend import Frontend
from lorasync.engines.vllm._protocol import CONFIG_KEY, FUSED_MODULES, IPC_PREFIX, WORKER_EXTENSION, CudaStage, ShmStage, one_cuda_device
from lorasync.engines.vllm._steps import Op, Step, StepDriver
from lorasync.engines.vllm.moe import check as check_moe
from lorasync.engines.vllm.moe import check_format, fused_tensors, num_experts_of
from lorasync.engines.vllm._surface import resolve, version_text
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    CapabilityError,
    ConfigError,
    EngineError,
    EngineUnavailableError,
    LoraNotEnabledError,
)

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter

__all__ = ["VLLMInProcessEngine"]


#: LoRA ids of every in-process engine object of this process. vLLM's ``add_lora`` silently keeps
#: the adapter already registered under an id, so a second wrapper of the same LLM counting from 1
#: would serve the first wrapper's weights under its own name. Ids start high, clear of the small
#: ids users give their own ``LoRARequest``s.
_LORA_IDS = itertools.count(1 << 20)

class VLLMInProcessEngine(StepDriver, Engine):
    """Load, unload, list and verify LoRA adapters of a ``vllm.LLM`` or ``AsyncLLM`` in this process.

    Args:
        llm: a ``vllm.LLM`` or ``vllm.v1.engine.async_llm.AsyncLLM`` built with
            ``enable_lora=True`` (and ``worker_extension_cls=WORKER_EXTENSION`` for tensor loads).
        loop (`asyncio.AbstractEventLoop`, *optional*): the AsyncLLM's event loop; defaults to the
            loop running when the engine is made (connect inside the loop that drives the AsyncLLM).
        timeout (`float`): seconds a worker call may take.
        moe_lora_format (`str`, defaults to ``"per_expert"``): how tensor loads send MoE expert
            LoRA: one LoRA per expert (every vLLM loads it), or ``"3d"``, PEFT's fused layout with
            ``is_3d_lora_weight=True``, which needs ``enable_mixed_moe_lora_format=True``. Files
            (disk) are always per expert.

    Raises:
        ConfigError: ``llm`` is neither, or an AsyncLLM is given without a loop.

    Example:
        >>> engine = connect("vllm-inprocess", llm=llm)  # doctest: +SKIP
        >>> publisher = Publisher(engine, name="policy", keep=2)  # doctest: +SKIP
        >>> report = publisher.publish(model, version=step)  # doctest: +SKIP
        >>> llm.generate(prompts, params, lora_request=engine.lora_request(report.served_name))  # doctest: +SKIP
    """

    kind: ClassVar[str] = "vllm-inprocess"
    # Staged through shared memory, a CUDA IPC copy or (same process) a copy into each worker's own memory.
    copies_tensors: ClassVar[bool] = True
    remedies: ClassVar[Mapping[str, str]] = {
        "lora": "build the vllm.LLM with enable_lora=True (and max_lora_rank >= the adapter's rank)",
        "tensor_load": f"build the vllm.LLM with worker_extension_cls={WORKER_EXTENSION!r}, or publish with transport='disk'",
        "weight_update": f"build the vllm.LLM with worker_extension_cls={WORKER_EXTENSION!r}",
    }

    def __init__(self, *, llm: Any, loop: asyncio.AbstractEventLoop | None = None, timeout: float = 120.0, moe_lora_format: str = "per_expert") -> None:
        self.llm = llm
        self.moe_lora_format = check_format(moe_lora_format)
        self.is_async = inspect.iscoroutinefunction(getattr(llm, "add_lora", None))
        core = llm if self.is_async else getattr(llm, "llm_engine", None)
        if core is None or not hasattr(core, "add_lora") or not hasattr(core, "vllm_config"):
            raise ConfigError(
                f"llm must be a vllm.LLM or a vllm AsyncLLM, got {type(llm).__name__}; for a vLLM server "
                "use connect('vllm', url)"
            )
        self._core = core
        if self.is_async and loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise ConfigError(
                    "an AsyncLLM belongs to an event loop: connect inside that loop or pass loop="
                ) from None
        self._loop = loop
        self.timeout = timeout
        self.url = f"in-process {type(llm).__name__}"
        self._served: dict[str, Any] = {}  # name -> LoRARequest
        self._tokens: dict[str, str] = {}  # name -> token of tensors staged in the workers
        self._retired: dict[str, int] = {}  # unloaded name -> its lora_int_id, until vLLM lets go of it
        self._ids = _LORA_IDS  # shared: two engine objects over one LLM must never reuse an id
        self._lock = threading.Lock()
        # Shared by every engine object over this LLM: one sender, retired versions refused at
        # admission, sources kept while a request may rebuild them (see _frontend).
        self._frontend = Frontend.of(core, is_async=self.is_async)

    # -- what users call besides the Engine protocol ----------------------------------------------

    def lora_request(self, name: str) -> Any:
        """The ``vllm.lora.request.LoRARequest`` that selects adapter ``name`` in ``llm.generate``.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded (list_adapters() shows what is).
        """
        with self._lock:
            request = self._served.get(name)
        if request is None:
            raise AdapterNotFoundError(
                f"{self.kind} serves no adapter named {name!r}; publish it first (served: {sorted(self._served)})",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        return request

    @property
    def lock(self) -> threading.RLock:
        """The driver's lock of a sync ``vllm.LLM`` (shared by every engine object over it).

        Publishing needs none: every send into the engine core is serialised already, so it may
        run while another thread's ``llm.generate`` decodes. A publish with ``verify=`` generates
        through the LLM too, and a ``vllm.LLM`` has one driver: hold this lock around your own
        ``llm.generate`` calls and the verification waits for them (without it, a verification
        that meets a running generate is refused with ``ConfigError``).
        """
        return self._frontend.driver_lock

    def home_loop(self) -> asyncio.AbstractEventLoop | None:
        """The AsyncLLM's event loop (blocking calls there would deadlock it); None for a ``vllm.LLM``."""
        return self._loop if self.is_async else None

    # -- the Engine protocol ----------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """Read the engine's own config: LoRA on, max rank, slots, dtypes, the worker extension.

        Raises:
            EngineUnavailableError: the engine died.
        """
        return self._run(self._capabilities())

    async def acapabilities(self) -> Capabilities:
        return await self._arun(self._capabilities())

    def check_adapter(self, adapter: Adapter, caps: Capabilities) -> None:
        """The generic checks, worded for an ``LLM(...)`` the caller built (its arguments, not
        server flags, are what to change).

        Raises:
            LoraNotEnabledError, RankTooLargeError, IncompatibleAdapterError.
        """
        caps.check(
            adapter,
            enable_lora="build it with enable_lora=True and max_lora_rank >= the adapter's rank, or publish "
            "with transport='merged'",
            raise_rank="build the LLM with max_lora_rank >= {rank} or train/trim the adapter to r <= {max_rank}",
        )
        check_moe(adapter, caps, moe_lora_format=self.moe_lora_format)

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT adapter directory ``path`` under ``name``; returns once the workers built it.

        Raises:
            AdapterAlreadyLoadedError, AdapterNotFoundError, RankTooLargeError,
            IncompatibleAdapterError, LoraNotEnabledError, EngineUnavailableError (asleep, dead).
        """
        self._run(self._load(name, os.path.abspath(os.fspath(path))))

    async def aload_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        await self._arun(self._load(name, os.path.abspath(os.fspath(path))))

    def load_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """Load ``adapter`` under ``name`` without files, through the worker extension.

        Raises:
            CapabilityError: the LLM was built without lorasync's worker extension; plus
            everything :meth:`load_adapter` raises.
        """
        self._run(self._load_tensors(name, adapter))

    async def aload_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        await self._arun(self._load_tensors(name, adapter))

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` and drop its staged tensors.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded. EngineUnavailableError: asleep or dead.
        """
        self._run(self._unload(name))

    async def aunload_adapter(self, name: str) -> None:
        await self._arun(self._unload(name))

    def list_adapters(self) -> list[str]:
        """Names loaded through this engine object (vLLM itself keeps only integer ids)."""
        if self._frontend.pending and not self._on_home_loop():
            self._run(self._sweep())  # sources of retired versions whose last request finished
        with self._lock:
            return sorted(self._served)

    async def alist_adapters(self) -> list[str]:
        if self._frontend.pending:
            await self._arun(self._sweep())
        with self._lock:
            return sorted(self._served)

    def close(self) -> None:
        """Release what retired versions' finished requests no longer need; the LLM stays (it is the caller's)."""
        if self._frontend.pending and not self._on_home_loop():
            self._run(self._sweep())

    async def aclose(self) -> None:
        if self._frontend.pending:
            await self._arun(self._sweep())

    def held_adapters(self) -> frozenset[str]:
        """Names whose LoRA the engine core holds now, by vLLM's own ``list_loras`` (integer
        ids): the served ones it has cached, and unloaded ones it did not let go of (a leak)."""
        return self._run(self._held())

    async def aheld_adapters(self) -> frozenset[str]:
        return await self._arun(self._held())

    def _held(self) -> Op[frozenset[str]]:
        ids = set((yield Step("list_loras")) or ())
        with self._lock:
            for name, lora_id in list(self._retired.items()):
                if lora_id not in ids:
                    del self._retired[name]  # freed
            known = {name: request.lora_int_id for name, request in self._served.items()} | self._retired
        return frozenset(name for name, lora_id in known.items() if lora_id in ids)

    def adapters_in_use(self) -> frozenset[str] | None:
        """Adapter names of the requests the engine's output processor tracks now (waiting,
        running or streaming out), read in-process: no lag, no metrics needed."""
        states = getattr(getattr(self._core, "output_processor", None), "request_states", None)
        if not isinstance(states, dict):
            return None
        for _ in range(5):  # the engine's thread may add or finish requests while we read
            try:
                return frozenset(s.lora_name for s in list(states.values()) if getattr(s, "lora_name", None))
            except RuntimeError:
                continue
        return None

    async def aadapters_in_use(self) -> frozenset[str] | None:
        return self.adapters_in_use()

    def greedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens after ``prompt_ids`` with adapter ``name`` (None: the base model) and each
        chosen token's log-probability.

        Raises:
            AdapterNotFoundError, EngineUnavailableError, EngineError.
        """
        return self._run(self._greedy(name, prompt_ids, max_tokens))

    async def agreedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        return await self._arun(self._greedy(name, prompt_ids, max_tokens))

    # -- operations (no I/O: yield a _Step, receive its result) ---------------------------------

    def _capabilities(self) -> Op[Capabilities]:
        config = self._core.vllm_config
        lora = config.lora_config
        extension = False
        if getattr(config.parallel_config, "worker_extension_cls", ""):
            try:
                answers = yield Step("collective_rpc", ("lorasync_ping",), kwargs={"timeout": self.timeout})
                extension = bool(answers) and all(answers)
            except EngineError:
                extension = False
        notes = [f"vllm {version_text()}", f"dtype {config.model_config.dtype}"]
        if lora is not None:
            notes.append(f"lora dtype {lora.lora_dtype}")
        if not extension:
            notes.append(f"tensor loads need LLM(worker_extension_cls={WORKER_EXTENSION!r}); files are used")
        return Capabilities(
            engine=self.kind,
            url=self.url,
            lora=lora is not None,
            runtime_lora=True,
            max_rank=lora.max_lora_rank if lora is not None else None,
            # The worker's LRU holds max_cpu_loras adapters (>= max_loras GPU slots); an evicted one
            # is rebuilt from its staged tensors or files, so that is no hard limit.
            reloads_from_path=True,
            max_loras=(lora.max_cpu_loras or lora.max_loras) if lora is not None else None,
            target_modules=frozenset(lora.target_modules) if lora is not None and getattr(lora, "target_modules", None) else None,
            tensor_load=extension,
            same_host=True,
            in_process=True,
            # The caller's own llm.generate and lorasync's add/remove_lora share one engine-core
            # socket that must not be used from two threads at once: the Frontend serialises the
            # sends (AsyncLLM calls run on its loop), so retirement may run in the background;
            # where it cannot, retirement runs inside publish and refuses while requests run.
            concurrent_calls=self._frontend.serialised,
            fused_modules=FUSED_MODULES,
            moe_3d=bool(getattr(lora, "enable_mixed_moe_lora_format", False)),
            version=version_text(),
            notes=tuple(notes),
        )

    def _on_home_loop(self) -> bool:
        try:
            return self.is_async and asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _sweep(self) -> Op[None]:
        """Release the staged tensors of unloaded versions whose last request finished."""
        for token in self._frontend.releasable():
            yield from self._release(token)

    def _ready(self, name: str) -> Op[None]:
        """Refuse before anything moves: bad name, LoRA off, name taken, engine asleep."""
        yield from self._sweep()
        if not name:
            raise ConfigError("adapter name must be a non-empty string")
        if self._core.vllm_config.lora_config is None:
            raise LoraNotEnabledError(
                f"{self.kind} ({self.url}) runs without LoRA; build it with enable_lora=True and max_lora_rank >= "
                "the adapter's rank, or publish with transport='merged'",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        with self._lock:
            taken = name in self._served
        if taken:
            raise AdapterAlreadyLoadedError(
                f"{self.kind} already serves an adapter named {name!r}; publish under a new versioned name or unload it",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        self._frontend.check_name_free(name, kind=self.kind, url=self.url, version=version_text())  # vLLM < 0.34: one name, one id
        asleep = yield Step("is_sleeping")
        if asleep:
            raise EngineUnavailableError(
                f"{self.kind} is asleep (llm.sleep()); nothing was loaded and the served versions are unchanged. "
                "Call llm.wake_up() and publish again",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )

    def _load(self, name: str, path: str, *, is_3d: bool = False) -> Op[None]:
        yield from self._ready(name)
        if not path.startswith(IPC_PREFIX) and not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise AdapterNotFoundError(
                f"{self.kind} found no adapter at {path}; the directory must hold adapter_config.json and "
                "adapter_model.safetensors",
                engine=self.kind,
                url=self.url,
                adapter=name,
                path=path,
            )
        LoRARequest = resolve("LoRARequest")  # noqa: N806 - vLLM's class

        extra = {"is_3d_lora_weight": True} if is_3d else {}
        request = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path, **extra)
        try:
            yield Step("add_lora", (request,))
        except EngineError as exc:
            if isinstance(exc, EngineUnavailableError):
                raise
            # vLLM registers an adapter before activating it: one it refuses while activating
            # (shapes of another base) would stay in its cache under this id, a zombie taking a slot.
            try:
                yield Step("remove_lora", (request.lora_int_id,))
            except EngineError:
                pass
            raise self._load_error(name, path, exc) from exc
        with self._lock:
            self._served[name] = request

    def _load_tensors(self, name: str, adapter: Adapter) -> Op[None]:
        from lorasync.wire.d2h import to_shm_segment

        yield from self._ready(name)
        caps = yield from self._capabilities()
        if not caps.tensor_load:
            raise CapabilityError(
                f"{self.kind} was built without lorasync's worker extension: pass "
                f"worker_extension_cls={WORKER_EXTENSION!r} to vllm.LLM / AsyncEngineArgs, or publish with transport='disk'",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        token = uuid.uuid4().hex
        config = json.dumps(adapter.config.to_peft().to_dict(), default=sorted)
        is_3d = self.moe_lora_format == "3d" and bool(group_experts(adapter.modules))
        if is_3d:
            check_moe(adapter, caps, moe_lora_format="3d")  # also when called without a publisher
        experts = num_experts_of(getattr(self._core.vllm_config.model_config, "hf_text_config", None))
        tensors = fused_tensors(adapter, engine=self.kind, num_experts=experts) if is_3d else adapter.tensors
        staged = False
        if self._same_process():
            # The worker runs in this process: hand the tensors over directly (CUDA IPC cannot
            # map a process's own memory; shared memory would take every byte to the host).
            yield Step("collective_rpc", ("lorasync_stage_adapter_local",), kwargs={"args": (token, dict(tensors), config), "timeout": self.timeout})
            staged = True
        elif one_cuda_device(tensors):
            staged = yield from self._stage_cuda(token, tensors, config)
        if not staged:
            segment = to_shm_segment(tensors, {CONFIG_KEY: config})
            try:
                spec = ShmStage(shm=segment.name, nbytes=segment.nbytes, token=token).to_json()
                yield Step("collective_rpc", ("lorasync_stage_adapter",), kwargs={"args": (spec,), "timeout": self.timeout})
            finally:
                segment.release()  # every worker copied the tensors out (or failed)
        try:
            yield from self._load(name, IPC_PREFIX + token, is_3d=is_3d)
        except BaseException:
            yield from self._release(token)
            raise
        with self._lock:
            self._tokens[name] = token

    def _same_process(self) -> bool:
        """Whether the LLM's engine core and its one worker run in this process (a sync
        ``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one uni-process worker): then
        ``collective_rpc`` hands Python objects over as they are."""
        if self.is_async:
            return False
        client = getattr(self._core, "engine_core", None)
        if type(client).__name__ != "InprocClient":
            return False
        executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
        return type(executor).__name__ == "UniProcExecutor"

    def _stage_cuda(self, token: str, tensors: Mapping[str, Any], config: str) -> Op[bool]:
        """Hand a GPU adapter to the workers through CUDA IPC, the copy kept on their GPU (the
        engine is colocated: no host round trip); False, after undoing any partial staging, when
        some worker cannot map it (another GPU set, no CUDA)."""
        from lorasync.wire.cuda_ipc import share_tensors

        shared = share_tensors(tensors, {CONFIG_KEY: config})
        try:
            spec = CudaStage(token=token, ipc=shared.spec, on_gpu=True).to_json()
            results = yield Step("collective_rpc", ("lorasync_stage_adapter_cuda",), kwargs={"args": (spec,), "timeout": self.timeout})
        finally:
            shared.release()  # every worker has its own copy (or failed)
        if results and all(isinstance(r, dict) and r.get("staged") is True for r in results):
            return True
        yield from self._release(token)
        return False

    def _release(self, token: str) -> Op[None]:
        try:
            yield Step("collective_rpc", ("lorasync_release_adapter",), kwargs={"args": (token,), "timeout": self.timeout})
        except EngineError:
            pass  # staged tensors of a dead engine die with it

    def _unload(self, name: str) -> Op[None]:
        with self._lock:
            request = self._served.get(name)
        if request is None:
            raise AdapterNotFoundError(
                f"{self.kind} does not serve adapter {name!r}; list_adapters() shows what it serves",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        asleep = yield Step("is_sleeping")
        if asleep:
            raise EngineUnavailableError(
                f"{self.kind} is asleep (llm.sleep()); {name!r} stays loaded. Call llm.wake_up() and unload again",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        # From here a request naming this version is refused when submitted: vLLM would rebuild
        # the adapter for it from a source lorasync is about to free.
        self._frontend.retire(request.lora_int_id, name)
        try:
            # False when the adapter was already evicted from the worker cache: forgotten either way.
            yield Step("remove_lora", (request.lora_int_id,))
        except BaseException:
            self._frontend.unretire(request.lora_int_id)
            raise
        with self._lock:
            self._retired[name] = request.lora_int_id  # held_adapters() tells whether vLLM let go
            self._served.pop(name, None)
            token = self._tokens.pop(name, None)
        # A request admitted before (a forced retirement) may still make vLLM rebuild the adapter:
        # its staged tensors stay until that request finished.
        token = self._frontend.keep_or_release(request.lora_int_id, token)
        if token is not None:
            yield from self._release(token)

    def _greedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> Op[tuple[list[int], list[float]]]:
        SamplingParams = resolve("SamplingParams")  # noqa: N806 - vLLM's class

        yield from self._sweep()
        request = self.lora_request(name) if name is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
        tokens, logprobs = yield Step("generate_one", ([int(t) for t in prompt_ids], params, request), local=True)
        return tokens, logprobs

    # -- generation, the one step that differs between LLM and AsyncLLM -------------------------

    def generate_one(self, prompt_ids: list[int], params: Any, request: Any) -> tuple[list[int], list[float]]:
        with self._frontend.driver_lock:
            self._frontend.check_idle(self.kind, stepping=True)
            outputs = self.llm.generate([{"prompt_token_ids": prompt_ids}], params, lora_request=request, use_tqdm=False)
        if len(outputs) != 1:  # another thread's generate started meanwhile and was stepped here
            raise EngineError(
                f"{self.kind}: the LLM generated for another thread during verification ({len(outputs)} outputs); hold "
                "engine.lock around your llm.generate calls",
                engine=self.kind,
                url=self.url,
            )
        return _tokens_and_logprobs(outputs[0].outputs[0])

    async def agenerate_one(self, prompt_ids: list[int], params: Any, request: Any) -> tuple[list[int], list[float]]:
        final = None
        async for out in self.llm.generate(
            {"prompt_token_ids": prompt_ids}, params, request_id=f"lorasync-{uuid.uuid4().hex}", lora_request=request
        ):
            final = out
        if final is None:
            raise EngineError(f"{self.kind} answered no output", engine=self.kind, url=self.url)
        return _tokens_and_logprobs(final.outputs[0])

def _tokens_and_logprobs(completion: Any) -> tuple[list[int], list[float]]:
    tokens = [int(t) for t in completion.token_ids]
    steps = completion.logprobs or []
    logprobs = [float(step[t].logprob) for step, t in zip(steps, tokens)]
    return tokens, logprobs
