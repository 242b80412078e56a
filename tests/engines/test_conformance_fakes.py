"""The test doubles shipped in ``lorasync.testing``: both pass the conformance suite, and each
does what its docstring promises (recording, async handlers, capacity, failure injection)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync.engines import Capabilities, Engine
from lorasync.errors import (
    AdapterRejectedError,
    CapabilityError,
    CapacityError,
    ConfigError,
    EngineUnavailableError,
    RankTooLargeError,
)
from lorasync.testing import EngineConformance, FakeEngine, MemoryEngine, tiny_llama_adapter


class TestMemoryEngineConformance(EngineConformance):
    @pytest.fixture
    def engine(self) -> Engine:
        return MemoryEngine()


class TestMemoryEngineWithoutTensorLoadConformance(EngineConformance):
    @pytest.fixture
    def engine(self) -> Engine:
        return MemoryEngine(tensor_load=False)


def _forwarding_handler(memory: MemoryEngine, *, asynchronous: bool) -> Any:
    """A FakeEngine handler that serves from a MemoryEngine (the usual way to give a fake state)."""

    def handle(op: str, **kwargs: Any) -> Any:
        result = getattr(memory, op)(**kwargs)
        return dataclasses.replace(result, engine="fake") if op == "capabilities" else result

    async def ahandle(op: str, **kwargs: Any) -> Any:
        await asyncio.sleep(0)
        return handle(op, **kwargs)

    return ahandle if asynchronous else handle


class TestFakeEngineConformance(EngineConformance):
    @pytest.fixture(params=[False, True], ids=["sync-handler", "async-handler"])
    def engine(self, request: pytest.FixtureRequest) -> Engine:
        return FakeEngine(_forwarding_handler(MemoryEngine(), asynchronous=request.param))


# -- FakeEngine -------------------------------------------------------------------------------


def test_fake_engine_records_every_call_with_its_arguments(tmp_path: Path) -> None:
    replies = {"list_adapters": ["a"], "load_adapter": None}
    engine = FakeEngine(lambda op, **kw: replies.get(op))

    engine.load_adapter("a", tmp_path)
    assert engine.list_adapters() == ["a"]
    asyncio.run(engine.aunload_adapter("a"))

    assert [(c.op, dict(c.kwargs)) for c in engine.calls] == [
        ("load_adapter", {"name": "a", "path": tmp_path}),
        ("list_adapters", {}),
        ("unload_adapter", {"name": "a"}),
    ]


def test_fake_engine_defaults_for_none_and_rejects_bad_capabilities() -> None:
    engine = FakeEngine(lambda op, **kw: None, url="fake://x")
    assert engine.capabilities() == Capabilities(engine="fake", url="fake://x")
    assert engine.list_adapters() == []
    with pytest.raises(ConfigError, match="Capabilities"):
        FakeEngine(lambda op, **kw: {"lora": True}).capabilities()
    with pytest.raises(ConfigError, match="callable"):
        FakeEngine("not a function")  # type: ignore[arg-type]


def test_fake_engine_propagates_the_handlers_errors_unchanged() -> None:
    down = EngineUnavailableError("engine is down", engine="fake")

    def handler(op: str, **kwargs: Any) -> None:
        raise down

    engine = FakeEngine(handler)
    with pytest.raises(EngineUnavailableError) as sync_info:
        engine.unload_adapter("x")
    with pytest.raises(EngineUnavailableError) as async_info:
        asyncio.run(engine.aunload_adapter("x"))
    assert sync_info.value is down and async_info.value is down


def test_async_handler_works_from_sync_methods_but_not_inside_a_running_loop() -> None:
    async def handler(op: str, **kwargs: Any) -> list[str]:
        return ["from-async"]

    engine = FakeEngine(handler)
    assert engine.list_adapters() == ["from-async"]

    async def misuse() -> list[str]:
        return engine.list_adapters()  # sync call while this loop runs

    with pytest.raises(ConfigError, match="alist_adapters"):
        asyncio.run(misuse())


def test_fake_engine_passes_tensors_through_untouched() -> None:
    seen: dict[str, Any] = {}
    engine = FakeEngine(lambda op, **kw: seen.update(kw))
    weights = {"model.layers.0.mlp.up_proj.weight": torch.ones(2, 2)}
    adapter = tiny_llama_adapter()
    engine.update_weights(weights)
    engine.load_adapter_tensors("t", adapter)
    assert seen["named_tensors"] is weights and seen["adapter"] is adapter


# -- MemoryEngine -----------------------------------------------------------------------------


def test_memory_engine_holds_exactly_the_adapter_on_disk(tmp_path: Path) -> None:
    adapter = tiny_llama_adapter(seed=7)
    engine = MemoryEngine()
    engine.load_adapter("a", adapter.save(tmp_path / "a"))
    held = engine.adapters["a"]
    assert held.content_hash == adapter.content_hash
    assert all(torch.equal(held.tensors[k], adapter.tensors[k]) for k in adapter.tensors)
    assert engine.path_of("a") == str(tmp_path / "a")


def test_memory_engine_capacity_rank_and_capabilities(tmp_path: Path) -> None:
    engine = MemoryEngine(max_loras=1, max_rank=4, tensor_load=False, weight_update=False)
    engine.load_adapter("a", tiny_llama_adapter(r=4).save(tmp_path / "a"))
    with pytest.raises(CapacityError):
        engine.load_adapter("b", tiny_llama_adapter(r=4).save(tmp_path / "b"))
    engine.unload_adapter("a")
    with pytest.raises(RankTooLargeError):
        engine.load_adapter("c", tiny_llama_adapter(r=8).save(tmp_path / "c"))
    with pytest.raises(CapabilityError):
        engine.load_adapter_tensors("d", tiny_llama_adapter())
    with pytest.raises(CapabilityError):
        engine.update_weights({})
    assert engine.list_adapters() == []


def test_memory_engine_rejects_corrupt_weights(tmp_path: Path) -> None:
    directory = tiny_llama_adapter().save(tmp_path / "a")
    (directory / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterRejectedError):
        MemoryEngine().load_adapter("a", directory)


def test_memory_engine_fails_on_demand_then_recovers(tmp_path: Path) -> None:
    engine = MemoryEngine()
    directory = tiny_llama_adapter().save(tmp_path / "a")
    engine.fail_next("load_adapter", EngineUnavailableError("flaky"), times=2)
    for _ in range(2):
        with pytest.raises(EngineUnavailableError, match="flaky"):
            engine.load_adapter("a", directory)
    engine.load_adapter("a", directory)
    assert engine.list_adapters() == ["a"]
    assert engine.ops.count("load_adapter") == 3


def test_memory_engine_keeps_weight_updates(tmp_path: Path) -> None:
    engine = MemoryEngine()
    weight = torch.arange(4.0).reshape(2, 2)
    engine.update_weights({"w": weight})
    weight.zero_()  # the engine holds its own copy
    assert torch.equal(engine.weights["w"], torch.arange(4.0).reshape(2, 2))
