"""IPC fan-out: one publish to several engines on this host copies the adapter into shared
memory once; every engine reads the same, current bytes; nothing outlives the publish."""

from __future__ import annotations

import json
from multiprocessing import shared_memory
from typing import Any

import pytest
import torch

from lorasync import Adapter, AdapterConfig, Publisher
from lorasync.engines._engine import Capabilities, Engine
from lorasync.errors import AdapterNotFoundError
from lorasync.wire.shm import read_segment, write_segment


class ShmEngine(Engine):
    """Loads tensors as vLLM's client does: a segment per load, read back, then released."""

    kind = "shm-test"

    def __init__(self) -> None:
        self.segments: list[str] = []
        self.loaded: dict[str, dict[str, torch.Tensor]] = {}

    def capabilities(self) -> Capabilities:
        return Capabilities(engine=self.kind, tensor_load=True)

    def load_adapter(self, name: str, path: Any) -> None:
        raise AssertionError("the ipc transport never loads by path")

    def load_adapter_tensors(self, name: str, adapter: Any) -> None:
        meta = {"lorasync.adapter_config": json.dumps(adapter.config.to_dict(), sort_keys=True)}
        with write_segment(adapter.tensors, meta) as seg:
            self.segments.append(seg.name)
            self.loaded[name], _ = read_segment(seg.name, seg.nbytes)

    def unload_adapter(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise AdapterNotFoundError(f"{name} is not loaded", engine=self.kind, adapter=name)

    def list_adapters(self) -> list[str]:
        return list(self.loaded)


def _live() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    m = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{m}.lora_A.weight": torch.randn(4, 32, generator=g), f"{m}.lora_B.weight": torch.randn(32, 4, generator=g)}


@pytest.mark.parametrize("engines", [1, 4])
def test_one_segment_per_publish_for_all_engines_with_current_bytes(engines: int, tmp_path) -> None:
    live = _live()
    adapter = Adapter(live, AdapterConfig(r=4, lora_alpha=8))
    fleet = [ShmEngine() for _ in range(engines)]
    pub = Publisher(fleet, name="fan", transport="ipc", root=tmp_path)
    try:
        names = []
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for t in live.values():
                        t.mul_(2.0)  # the trainer's step, in place
            report = pub.publish(adapter, version=version).raise_for_errors()
            used = {e.segments[-1] for e in fleet}
            assert len(used) == 1, "every engine of one publish reads the same segment"
            names.append(used.pop())
            for e in fleet:
                got = e.loaded[report.results[0].served_name]
                assert all(torch.equal(got[k], t) for k, t in live.items())
            with pytest.raises(FileNotFoundError):  # released once the last engine loaded
                shared_memory.SharedMemory(name=names[-1])
    finally:
        pub.close()
