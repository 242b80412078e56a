"""A second process standing in for a vLLM worker: it runs lorasync's real worker-extension
methods (CUDA IPC and shared-memory staging) and reports what it holds.

Protocol: one JSON object per line on stdin, one answer per line on stdout.

* ``{"op": "stage_cuda" | "stage_shm", "arg": spec_json}`` → the method's answer plus
  ``hashes`` and ``devices`` of the staged tensors.
* ``{"op": "stage_file", "token": token}`` → what the worker's load hook does first in the one-trip
  path (stage from the client's stage file): ``staged`` and the ``hashes``, or the ``error``.
* ``{"op": "import", "arg": spec_json}`` → ``import_tensors`` straight (kept under ``"held"``).
* ``{"op": "hashes", "token": token}`` → hashes of what is staged (or held) now.
* ``{"op": "release", "token": token}`` → ``lorasync_release_adapter``.
* ``{"op": "mappings"}`` → the producer segments kept mapped (``handles`` in base64, ``covered``).

Only vLLM's LoRA manager is absent: a stub object receives the loader hook.
"""

from __future__ import annotations

import json
import sys
import types

import torch

from _gpu_helpers import digest

from lorasync.engines.vllm import worker as vllm_worker  # its private helpers; lorasync.engines.vllm_worker is the public alias
from lorasync.engines.vllm_worker import LoraSyncWorkerExtension
from lorasync.wire import cuda_ipc
from lorasync.wire.cuda_ipc import import_tensors


class _Manager:
    def _load_adapter(self, lora_request: object) -> object:  # replaced by lorasync's hook
        raise NotImplementedError


def main() -> None:
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(lora_manager=_Manager()))
    held: dict[str, torch.Tensor] = {}
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op in ("stage_cuda", "stage_shm"):
                method = LoraSyncWorkerExtension.lorasync_stage_adapter_cuda if op == "stage_cuda" else LoraSyncWorkerExtension.lorasync_stage_adapter
                answer = method(worker, msg["arg"])  # type: ignore[arg-type]
                if answer.get("staged"):
                    tensors = vllm_worker._STAGED[answer["token"]][0]
                    answer["hashes"] = digest(tensors)
                    answer["devices"] = sorted({t.device.type for t in tensors.values()})
            elif op == "stage_file":
                vllm_worker._stage_from_file(worker, msg["token"])
                staged = vllm_worker._STAGED.get(msg["token"])
                answer = {"staged": staged is not None, "token": msg["token"]}
                if staged:
                    answer["hashes"] = digest(staged[0])
                    answer["devices"] = sorted({t.device.type for t in staged[0].values()})
            elif op == "import":
                held, _ = import_tensors(json.loads(msg["arg"]))
                answer = {"hashes": digest(held), "devices": sorted({t.device.type for t in held.values()})}
            elif op == "hashes":
                staged = vllm_worker._STAGED.get(msg["token"])
                answer = {"hashes": digest(staged[0] if staged else held)}
            elif op == "mappings":
                kept = list(cuda_ipc._mappings.items())
                answer = {"handles": [cuda_ipc._b64(h) for (_, h), _ in kept], "covered": [c for _, (c, _) in kept]}
            elif op == "release":
                answer = {"released": LoraSyncWorkerExtension.lorasync_release_adapter(worker, msg["token"])}  # type: ignore[arg-type]
            else:
                answer = {"error": f"unknown op {op}"}
        except Exception as exc:  # reported to the test, which fails on it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
