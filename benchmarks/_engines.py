"""Engines for measuring lorasync itself: every load is accepted and its bytes are counted.

``CountingEngine`` is a real ``lorasync.engines.Engine`` (the publisher drives it exactly like a
remote one), so what it counts is what the transports hand over: the files of a version
directory, the shared-memory segment an IPC load writes, the buckets of a merged update.
``ShmReader`` is a second process that copies segments out, as an engine worker would.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks._shapes import VLLM_FUSED
from lorasync.engines import Capabilities, Engine
from lorasync.errors import AdapterNotFoundError
from lorasync.wire.shm import write_segment

__all__ = ["CONFIG_KEY", "CountingEngine", "Counts", "ShmReader", "safetensors_data_bytes"]

CONFIG_KEY = "lorasync.adapter_config"  # the metadata key vLLM's worker extension reads


@dataclass
class Counts:
    """What one engine received."""

    files: int = 0  # bytes of every file in loaded version directories
    file_data: int = 0  # tensor bytes inside their adapter_model.safetensors
    shm: int = 0  # bytes of the shared-memory segments written for tensor loads
    shm_data: int = 0  # tensor bytes inside those segments
    weights: int = 0  # bytes of merged weights pushed
    loads: int = 0
    buckets: int = 0
    bucket_sizes: list[int] = field(default_factory=list)


class CountingEngine(Engine):
    """An engine that serves nothing and counts everything it is handed.

    Args:
        load_delay (`float`): seconds each load/update takes on the "engine side" (a stand-in
            for work a real engine does on its own hardware; 0 measures lorasync alone).
        reader (`ShmReader`, *optional*): tensor loads hand their segment to this process,
            which copies the tensors out (as vLLM's worker does), before returning.
        in_process (`bool`): report ``in_process`` (the publisher then prefers IPC).
    """

    kind = "counting"

    def __init__(self, *, load_delay: float = 0.0, reader: ShmReader | None = None, in_process: bool = False) -> None:
        self.load_delay = load_delay
        self.reader = reader
        self.in_process = in_process
        self.counts = Counts()
        self._served: dict[str, str] = {}

    def capabilities(self) -> Capabilities:
        return Capabilities(engine=self.kind, tensor_load=True, weight_update=True, in_process=self.in_process, fused_modules=VLLM_FUSED)

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        folder = Path(path)
        self.counts.files += sum(f.stat().st_size for f in folder.iterdir())
        self.counts.file_data += safetensors_data_bytes(folder / "adapter_model.safetensors")
        self._loaded(name)

    def load_adapter_tensors(self, name: str, adapter: Any) -> None:
        meta = {CONFIG_KEY: json.dumps(adapter.config.to_dict(), sort_keys=True)}
        with write_segment(adapter.tensors, meta) as seg:
            self.counts.shm += seg.nbytes
            self.counts.shm_data += _segment_data_bytes(seg)
            if self.reader is not None:
                self.reader.read(seg.name, seg.nbytes)
        self._loaded(name)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in named_tensors.values())
        self.counts.weights += size
        self.counts.buckets += 1
        self.counts.bucket_sizes.append(size)
        if self.load_delay:
            time.sleep(self.load_delay)

    def unload_adapter(self, name: str) -> None:
        if self._served.pop(name, None) is None:
            raise AdapterNotFoundError(f"{name} is not loaded", engine=self.kind, adapter=name)

    def list_adapters(self) -> list[str]:
        return list(self._served)

    def _loaded(self, name: str) -> None:
        self.counts.loads += 1
        self._served[name] = name
        if self.load_delay:
            time.sleep(self.load_delay)


def safetensors_data_bytes(path: str | os.PathLike[str]) -> int:
    """Tensor bytes of a safetensors file: its size minus the 8-byte length and the header."""
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(path) - 8 - hlen


def _segment_data_bytes(seg: Any) -> int:
    (hlen,) = struct.unpack("<Q", bytes(seg._shm.buf[:8]))
    return int(seg.nbytes) - 8 - int(hlen)


class ShmReader:
    """A second Python process (``benchmarks._reader``) that attaches to segments and copies
    their tensors out with ``lorasync.wire.shm.read_segment``, as an engine worker does.

    It is a separate interpreter (not a multiprocessing child), so, like a real engine, it has its
    own resource tracker. Start once (it imports torch: seconds), then ``read()`` per handoff.

    Args:
        threads (`int`, *optional*): ``torch.set_num_threads`` in the reader (default: torch's).
    """

    def __init__(self, *, threads: int | None = None) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        args = [sys.executable, "-m", "benchmarks._reader"] + ([str(threads)] if threads else [])
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        if self._ask("ping") != "ready":
            self.close()
            raise RuntimeError("the shared-memory reader process did not start")

    def _ask(self, *words: object) -> str:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline().strip()
        if not answer or answer.startswith("error"):
            raise RuntimeError(f"shared-memory reader failed: {answer or 'it exited'}")
        return answer

    def read(self, name: str, nbytes: int) -> int:
        """Have the reader ``read_segment`` ``name``; returns the tensor bytes it got."""
        return int(self._ask("read", name, nbytes))

    def copy(self, name: str, nbytes: int) -> int:
        """Have the reader copy ``nbytes`` raw bytes out of segment ``name`` (one memcpy: the
        floor of any copy-out handoff)."""
        return int(self._ask("copy", name, nbytes))

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write("stop\n")
                self._proc.stdin.flush()
                self._proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(5)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
