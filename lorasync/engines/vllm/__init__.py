"""vLLM engines: the OpenAI server's HTTP client, the in-process engine, and the worker extension.

Layout:

* ``_client`` — :class:`VLLMEngine`, the client of a running server's runtime LoRA routes;
* ``_errors`` — vLLM's error answers mapped to typed ``lorasync.errors``;
* ``_bodies`` — parsing of model lists, completions and the ``/metrics`` LoRA gauge;
* ``_protocol`` — routes, constants and the versioned stage specs shared with the worker;
* ``guard`` — :class:`AdminRouteGuard`, an ASGI middleware (``--middleware``) that puts the
  dev-mode admin routes behind the API key;
* ``worker`` — :class:`LoraSyncWorkerExtension`, imported inside vLLM's workers (also reachable
  as ``lorasync.engines.vllm_worker``, the path users pass to ``--worker-extension-cls``);
* ``pull`` — :class:`VLLMPullEngine` (kind ``vllm-pull``): publishes by writing versions where
  vLLM's filesystem LoRA resolver looks (imported on demand);
* ``inprocess`` — :class:`VLLMInProcessEngine` for a ``vllm.LLM`` / ``AsyncLLM`` in this process
  (imported on demand: it needs vLLM).
"""

from lorasync.engines.vllm._client import Completion, VLLMEngine
from lorasync.engines.vllm._protocol import CONFIG_KEY, FUSED_MODULES, IPC_PREFIX, WORKER_EXTENSION

__all__ = ["CONFIG_KEY", "FUSED_MODULES", "IPC_PREFIX", "WORKER_EXTENSION", "Completion", "VLLMEngine"]
