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

Tested against vLLM 0.32 (CPU build). The module runs a little over 400 lines because each
operation is written once for both the sync ``LLM`` and the ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import threading
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines.vllm._protocol import CONFIG_KEY, FUSED_MODULES, IPC_PREFIX, WORKER_EXTENSION, ShmStage
from lorasync.engines.vllm._steps import Op, Step, StepDriver
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
    from lorasync._adapter import Adapter

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

    Raises:
        ConfigError: ``llm`` is neither, or an AsyncLLM is given without a loop.

    Example:
        >>> engine = connect("vllm-inprocess", llm=llm)  # doctest: +SKIP
        >>> publisher = Publisher(engine, name="policy", keep=2)  # doctest: +SKIP
        >>> report = publisher.publish(model, version=step)  # doctest: +SKIP
        >>> llm.generate(prompts, params, lora_request=engine.lora_request(report.served_name))  # doctest: +SKIP
    """

    kind: ClassVar[str] = "vllm-inprocess"

    def __init__(self, *, llm: Any, loop: asyncio.AbstractEventLoop | None = None, timeout: float = 120.0) -> None:
        self.llm = llm
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
        self._ids = _LORA_IDS  # shared: two engine objects over one LLM must never reuse an id
        self._lock = threading.Lock()

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
        with self._lock:
            return sorted(self._served)

    async def alist_adapters(self) -> list[str]:
        return self.list_adapters()

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
        import vllm

        notes = [f"vllm {vllm.__version__}", f"dtype {config.model_config.dtype}"]
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
            # socket that must not be used from two threads at once; AsyncLLM calls are
            # serialised on its loop.
            concurrent_calls=self.is_async,
            fused_modules=FUSED_MODULES,
            notes=tuple(notes),
        )

    def _ready(self, name: str) -> Op[None]:
        """Refuse before anything moves: bad name, LoRA off, name taken, engine asleep."""
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
        asleep = yield Step("is_sleeping")
        if asleep:
            raise EngineUnavailableError(
                f"{self.kind} is asleep (llm.sleep()); nothing was loaded and the served versions are unchanged. "
                "Call llm.wake_up() and publish again",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )

    def _load(self, name: str, path: str) -> Op[None]:
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
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)
        try:
            yield Step("add_lora", (request,))
        except EngineError as exc:
            if isinstance(exc, EngineUnavailableError):
                raise
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
        segment = to_shm_segment(adapter.tensors, {CONFIG_KEY: config})
        try:
            spec = ShmStage(shm=segment.name, nbytes=segment.nbytes, token=token).to_json()
            yield Step("collective_rpc", ("lorasync_stage_adapter",), kwargs={"args": (spec,), "timeout": self.timeout})
        finally:
            segment.release()  # every worker copied the tensors out (or failed)
        try:
            yield from self._load(name, IPC_PREFIX + token)
        except BaseException:
            yield from self._release(token)
            raise
        with self._lock:
            self._tokens[name] = token

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
        # False when the adapter was already evicted from the worker cache: forgotten either way.
        yield Step("remove_lora", (request.lora_int_id,))
        with self._lock:
            self._served.pop(name, None)
            token = self._tokens.pop(name, None)
        if token is not None:
            yield from self._release(token)

    def _greedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> Op[tuple[list[int], list[float]]]:
        from vllm import SamplingParams

        request = self.lora_request(name) if name is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
        tokens, logprobs = yield Step("generate_one", ([int(t) for t in prompt_ids], params, request), local=True)
        return tokens, logprobs

    # -- generation, the one step that differs between LLM and AsyncLLM -------------------------

    def generate_one(self, prompt_ids: list[int], params: Any, request: Any) -> tuple[list[int], list[float]]:
        outputs = self.llm.generate([{"prompt_token_ids": prompt_ids}], params, lora_request=request, use_tqdm=False)
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
