"""A stand-in vLLM worker extension that only answers lorasync's capability probe.

Loaded by the test server with ``--worker-extension-cls tests.engines.vllm_probe_ext.ProbeExtension``
(the repository root is on the engine's PYTHONPATH) to exercise ``VLLMEngine._has_worker_extension``
before the real extension is wired into capabilities.
"""


class ProbeExtension:
    def lorasync_ping(self) -> str:
        return "lorasync"
