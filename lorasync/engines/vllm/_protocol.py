"""What lorasync and vLLM agree on: routes, constants and the stage specs of the worker extension.

Both sides import this module: the HTTP client and the in-process engine (which build the specs)
and the worker extension running inside vLLM's workers (which reads them). It imports only the
standard library and ``lorasync.errors``, so vLLM's worker processes can load it cheaply.

Stage specs travel as JSON strings through ``collective_rpc`` (never pickle: a worker must not
unpickle bytes a client sent). Each carries a version so a worker refuses, with a typed error, a
spec written by another lorasync release instead of misreading it:

* :class:`ShmStage` — an adapter (``token`` set) or base weights (no token) in one shared-memory
  segment, ``{"version": 1, "token": ..., "shm": ..., "nbytes": ...}``;
* :class:`CudaStage` — an adapter packed in one GPU buffer shared by a CUDA IPC handle, the
  token beside the CUDA IPC spec of ``lorasync.wire.cuda_ipc`` (which is versioned itself:
  ``{"token": ..., "version": SPEC_VERSION, "header": ..., "ipc": ...}``).

A :class:`CudaStage` may also travel with the load request itself, so a publish is one round trip
into the engine instead of two (a stage RPC, then the load): the client writes it to
:func:`stage_file` (``/dev/shm``, owner-only, created exclusively under the random token) and loads
``IPC_PREFIX + token``; a worker that has not staged that token reads the file, stages and builds
in the same call (:func:`read_stage_file`). The handle never appears in the load request, so
``/v1/models`` (which lists every adapter's path) does not show it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorasync.errors import ConfigError

__all__ = [
    "COMPLETIONS_ROUTE",
    "CONFIG_KEY",
    "FUSED_MODULES",
    "IPC_PREFIX",
    "LOAD_ROUTE",
    "LORA_GAUGE",
    "METRICS_ROUTE",
    "MODELS_ROUTE",
    "RPC_ROUTE",
    "RUNTIME_ENV",
    "SERVER_INFO_ROUTE",
    "SHM_STAGE_VERSION",
    "UNLOAD_ROUTE",
    "WORKER_EXTENSION",
    "CudaStage",
    "NO_STAGE",
    "STAGE_DIR",
    "ShmStage",
    "check_token",
    "one_cuda_device",
    "read_stage_file",
    "stage_file",
    "write_stage_file",
]

LOAD_ROUTE = "/v1/load_lora_adapter"
UNLOAD_ROUTE = "/v1/unload_lora_adapter"
MODELS_ROUTE = "/v1/models"
COMPLETIONS_ROUTE = "/v1/completions"
SERVER_INFO_ROUTE = "/server_info"
METRICS_ROUTE = "/metrics"
RPC_ROUTE = "/collective_rpc"
# A router's worker list (vllm-router, the SGLang router); vLLM itself has no such route.
LIST_WORKERS_ROUTE = "/list_workers"
# vLLM's Prometheus gauge of which adapters have requests (vllm/v1/metrics/loggers.py).
LORA_GAUGE = "vllm:lora_requests_info"
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# The value users pass to --worker-extension-cls (or LLM(worker_extension_cls=...)).
WORKER_EXTENSION = "lorasync.engines.vllm_worker.LoraSyncWorkerExtension"

# A LoRA path starting with this prefix names tensors staged in the workers, not a directory.
IPC_PREFIX = "/lorasync-ipc/"
# Safetensors metadata key holding the adapter's PEFT config (JSON) in a staged buffer.
CONFIG_KEY = "lorasync.adapter_config"
# vLLM stores these HF projections as one fused weight: merged updates send whole groups.
FUSED_MODULES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

SHM_STAGE_VERSION = 1
# What lorasync_ping answers: "lorasync", then the worker methods an older worker lacks, after
# colons. A client calls such a method only where every worker named it (vLLM 0.32 drops the
# connection on an unknown collective_rpc method instead of answering an error).
PING = "lorasync"
CUDA_UPDATES = "cuda_updates"


def ping_features(answers: Any) -> frozenset[str] | None:
    """The features every worker's ``lorasync_ping`` answer names; None when some worker did not
    answer as lorasync's extension (no extension: nothing of it may be called)."""
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.split(":")[0] == PING for a in answers):
        return None
    return frozenset.intersection(*(frozenset(a.split(":")[1:]) for a in answers))
# Where a stage spec waits for the load that reads it (tmpfs: never on a disk).
STAGE_DIR = "/dev/shm"
# Said by a worker that cannot stage from a spec file (no file, no CUDA, the GPU not visible): the
# client then stages by RPC, as before.
NO_STAGE = "lorasync: cannot stage from the spec file"
# A stage spec names a handful of tensors; anything larger at the path is not one of ours.
MAX_STAGE_BYTES = 1 << 20


def stage_file(token: str) -> str:
    """The path of the stage spec of ``token`` (a random hex string: never a user's name)."""
    return os.path.join(STAGE_DIR, f"lorasync-stage-{check_token(token)}.json")


def write_stage_file(stage: CudaStage) -> str | None:
    """Write ``stage`` for the load that reads it, readable by this user only; created exclusively
    (a file already there, a symlink among them, is never written through). None where there is
    no such directory or the file cannot be made: the caller stages by RPC."""
    path = stage_file(stage.token)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(stage.to_json())
    except OSError:  # a full /dev/shm, a quota: no half-written spec is left for a worker to read
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    return path


def read_stage_file(token: str) -> CudaStage | None:
    """The stage spec a client wrote for ``token``; None when there is none (a symlink is not
    followed; a file of another user is not read)."""
    # O_NONBLOCK: a FIFO (or any device) someone made at the path must not hold the engine's
    # load in open() or read(); only a regular file of this user, at most MAX_STAGE_BYTES, is read.
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(stage_file(token), flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MAX_STAGE_BYTES:
            return None
        chunks, size = [], 0
        while size <= MAX_STAGE_BYTES and (chunk := os.read(fd, MAX_STAGE_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_STAGE_BYTES:  # grew while read: not a spec of ours
            return None
        text = b"".join(chunks).decode()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    return CudaStage.from_json(text)


def one_cuda_device(tensors: Mapping[str, Any]) -> bool:
    """All tensors on one CUDA device: what one CUDA IPC share (:class:`CudaStage`) can carry."""
    devices = {t.device for t in tensors.values()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


def check_token(token: Any) -> str:
    """A staging token as the workers accept it: a non-empty string that cannot leave the prefix.

    Raises:
        ConfigError: an empty token or one holding ``/``.
    """
    if not isinstance(token, str) or not token or "/" in token:
        raise ConfigError(f"bad lorasync token {token!r}: staging tokens are non-empty strings without '/'")
    return token


def _object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} spec is not JSON ({exc}); client and engine must run the same lorasync") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{what} spec must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ShmStage:
    """Tensors in one shared-memory segment (lorasync's safetensors layout), for the workers to copy.

    Args:
        shm (`str`): the segment's name.
        nbytes (`int`): bytes of the segment that hold the header and tensors.
        token (`str`, *optional*): the adapter's staging token; None for base weights.
    """

    shm: str
    nbytes: int
    token: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.shm, str) or not self.shm:
            raise ConfigError(f"shared-memory stage needs a segment name, got {self.shm!r}")
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes <= 0:
            raise ConfigError(f"shared-memory stage needs a positive byte count, got {self.nbytes!r}")
        if self.token is not None:
            check_token(self.token)

    def to_json(self) -> str:
        """The spec as sent through ``collective_rpc``."""
        spec: dict[str, Any] = {"version": SHM_STAGE_VERSION, "shm": self.shm, "nbytes": self.nbytes}
        if self.token is not None:
            spec["token"] = self.token
        return json.dumps(spec)

    @classmethod
    def from_json(cls, text: str) -> ShmStage:
        """Read a spec written by :meth:`to_json`.

        Raises:
            ConfigError: not JSON, another version, or bad fields.
        """
        spec = _object(text, "shared-memory stage")
        if spec.get("version") != SHM_STAGE_VERSION:
            raise ConfigError(
                f"shared-memory stage spec version {spec.get('version')!r}, this worker reads "
                f"{SHM_STAGE_VERSION}; run the same lorasync in the trainer and the engine"
            )
        return cls(shm=spec.get("shm"), nbytes=spec.get("nbytes"), token=spec.get("token"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class CudaStage:
    """An adapter in one GPU buffer shared through CUDA IPC, under a staging token.

    Args:
        token (`str`): the adapter's staging token.
        ipc (`Mapping`): ``CudaShare.spec`` (versioned and validated by
            ``lorasync.wire.cuda_ipc``, which the worker calls to map it).
        on_gpu (`bool`): the worker keeps its copy on its own GPU (a colocated engine on the
            trainer's GPU: no round trip through host memory); default: page-locked host memory,
            where vLLM keeps its LoRA cache.
    """

    token: str
    ipc: Mapping[str, Any] = field(default_factory=dict)
    on_gpu: bool = False

    def __post_init__(self) -> None:
        check_token(self.token)

    def to_json(self) -> str:
        """The spec as sent through ``collective_rpc``."""
        spec: dict[str, Any] = {**self.ipc, "token": self.token}
        if self.on_gpu:  # sent only when set: a worker of an older lorasync reads the rest unchanged
            spec["on_gpu"] = True
        return json.dumps(spec)

    @classmethod
    def from_json(cls, text: str) -> CudaStage:
        """Read a spec written by :meth:`to_json` (the CUDA IPC part is checked when mapped).

        Raises:
            ConfigError: not JSON or a bad token.
        """
        spec = _object(text, "CUDA IPC stage")
        token = spec.pop("token", None)
        on_gpu = spec.pop("on_gpu", False)
        if not isinstance(on_gpu, bool):
            raise ConfigError(f"CUDA IPC stage: on_gpu must be true or false, got {on_gpu!r}")
        return cls(token=token, ipc=spec, on_gpu=on_gpu)  # type: ignore[arg-type]
