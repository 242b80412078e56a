"""Alias of :mod:`lorasync.engines.vllm.worker`, kept because users pass this path to vLLM.

``--worker-extension-cls lorasync.engines.vllm_worker.LoraSyncWorkerExtension`` (and
``LLM(worker_extension_cls=...)``) name this module; the code lives in the ``vllm`` package.
"""

# _STAGED (the workers' staging area) stays reachable here for tests that inspect it.
from lorasync.engines.vllm.worker import _STAGED, CONFIG_KEY, IPC_PREFIX, LoraSyncWorkerExtension  # noqa: F401

__all__ = ["CONFIG_KEY", "IPC_PREFIX", "LoraSyncWorkerExtension"]
