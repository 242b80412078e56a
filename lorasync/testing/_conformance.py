"""``EngineConformance``: the behaviour every engine client owes lorasync, as pytest tests.

Built-in engines and third-party plugins alike subclass it in a ``Test*`` class and override the
``engine`` fixture (and ``adapter_dir`` when their model is not lorasync's tiny Llama)::

    from lorasync.testing import EngineConformance

    class TestMyEngine(EngineConformance):
        @pytest.fixture
        def engine(self):
            with MyEngine("http://127.0.0.1:9000") as engine:
                yield engine

Every test uses fresh adapter names and unloads what it loaded, so a session-scoped ``engine``
fixture over a live server works too. Needs pytest (``pip install lorasync[test]``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lorasync.adapter._adapter import Adapter
from lorasync.adapter._config import AdapterConfig
from lorasync.adapter._keys import peft_key
from lorasync.engines._engine import Capabilities, Engine
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    CapabilityError,
    EngineError,
    LoraSyncError,
)

__all__ = ["EngineConformance", "tiny_llama_adapter"]


def tiny_llama_adapter(*, r: int = 4, alpha: float = 8.0, seed: int = 0) -> Adapter:
    """A small random adapter for lorasync's tiny Llama (``lorasync.testing.make_tiny_model``):
    ``q_proj`` and ``v_proj`` of layer 0, hidden 256, 2 KV heads of 64."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"model.layers.0.self_attn.q_proj": (256, 256), "model.layers.0.self_attn.v_proj": (128, 256)}
    tensors = {}
    for module, (out_features, in_features) in shapes.items():
        tensors[peft_key(module, "A")] = torch.randn(r, in_features, generator=gen) * 0.05
        tensors[peft_key(module, "B")] = torch.randn(out_features, r, generator=gen) * 0.05
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=alpha))


def _fresh_name(tag: str) -> str:
    return f"conformance-{tag}-{uuid.uuid4().hex[:8]}"


def _unload_quietly(engine: Engine, name: str) -> None:
    try:
        if name in engine.list_adapters():
            engine.unload_adapter(name)
    except LoraSyncError:  # cleanup must not hide the test's own failure
        pass


class EngineConformance:
    """Mixin of pytest tests for an :class:`~lorasync.engines.Engine` implementation.

    Fixtures to override:

    * ``engine`` (required): the engine under test, ready to load adapters.
    * ``adapter_dir``: a PEFT adapter directory this engine can serve. Defaults to
      :func:`tiny_llama_adapter` saved under ``tmp_path`` (fits ``make_tiny_model``).
    * ``adapter``: the same adapter in memory, for ``load_adapter_tensors``.
    """

    @pytest.fixture
    def engine(self) -> Engine:
        raise NotImplementedError("subclasses of EngineConformance override the 'engine' fixture")

    @pytest.fixture
    def adapter_dir(self, tmp_path: Path) -> Path:
        return tiny_llama_adapter().save(tmp_path / "conformance-adapter")

    @pytest.fixture
    def adapter(self, adapter_dir: Path) -> Adapter:
        return Adapter.load(adapter_dir)

    @pytest.fixture
    def loaded(self, engine: Engine, adapter_dir: Path) -> Iterator[str]:
        """A name loaded from ``adapter_dir`` for the duration of one test."""
        name = _fresh_name("loaded")
        engine.load_adapter(name, adapter_dir)
        yield name
        _unload_quietly(engine, name)

    # -- capabilities -------------------------------------------------------------------------

    def test_capabilities_returns_capabilities(self, engine: Engine) -> None:
        caps = engine.capabilities()
        assert isinstance(caps, Capabilities)
        assert caps.engine == engine.kind

    # -- load / list / unload -------------------------------------------------------------------

    def test_loaded_adapter_is_listed(self, engine: Engine, loaded: str) -> None:
        assert loaded in engine.list_adapters()

    def test_loading_a_name_twice_raises_already_loaded(self, engine: Engine, adapter_dir: Path, loaded: str) -> None:
        with pytest.raises(AdapterAlreadyLoadedError):
            engine.load_adapter(loaded, adapter_dir)
        assert loaded in engine.list_adapters()

    def test_unloading_an_unknown_name_raises_not_found(self, engine: Engine) -> None:
        with pytest.raises(AdapterNotFoundError):
            engine.unload_adapter(_fresh_name("never-loaded"))

    def test_unloaded_adapter_is_not_listed(self, engine: Engine, adapter_dir: Path) -> None:
        name = _fresh_name("unload")
        engine.load_adapter(name, adapter_dir)
        try:
            engine.unload_adapter(name)
            assert name not in engine.list_adapters()
        finally:
            _unload_quietly(engine, name)

    def test_loading_a_directory_without_adapter_raises_not_found(self, engine: Engine, tmp_path: Path) -> None:
        empty = tmp_path / "no-adapter-here"
        empty.mkdir()
        name = _fresh_name("missing")
        with pytest.raises(AdapterNotFoundError):
            engine.load_adapter(name, empty)
        assert name not in engine.list_adapters()

    def test_failed_load_leaves_loaded_adapters_serving(self, engine: Engine, tmp_path: Path, loaded: str) -> None:
        broken = tmp_path / "broken-adapter"
        broken.mkdir()
        (broken / "adapter_config.json").write_text("{not json")
        name = _fresh_name("broken")
        with pytest.raises(EngineError):
            engine.load_adapter(name, broken)
        listed = engine.list_adapters()
        assert loaded in listed and name not in listed

    def test_tensor_load_follows_capabilities(self, engine: Engine, adapter: Adapter) -> None:
        name = _fresh_name("tensors")
        if not engine.capabilities().tensor_load:
            with pytest.raises(CapabilityError):
                engine.load_adapter_tensors(name, adapter)
            return
        try:
            engine.load_adapter_tensors(name, adapter)
            assert name in engine.list_adapters()
            with pytest.raises(AdapterAlreadyLoadedError):
                engine.load_adapter_tensors(name, adapter)
        finally:
            _unload_quietly(engine, name)

    # -- errors -------------------------------------------------------------------------------

    def test_errors_are_lorasync_errors_with_a_message(self, engine: Engine, tmp_path: Path, loaded: str) -> None:
        attempts: list[Callable[[], None]] = [
            lambda: engine.unload_adapter(_fresh_name("unknown")),
            lambda: engine.load_adapter(loaded, tmp_path),
            lambda: engine.load_adapter(_fresh_name("empty"), tmp_path),
        ]
        for attempt in attempts:
            with pytest.raises(LoraSyncError) as info:
                attempt()
            assert isinstance(info.value, EngineError), f"{type(info.value).__name__} is not an EngineError"
            assert str(info.value), f"{type(info.value).__name__} has an empty message"

    # -- async twins --------------------------------------------------------------------------

    def test_async_twins_agree_with_sync(self, engine: Engine, adapter_dir: Path) -> None:
        name = _fresh_name("async")

        async def scenario() -> tuple[Capabilities, list[str], list[str]]:
            caps = await engine.acapabilities()
            await engine.aload_adapter(name, adapter_dir)
            after_load = await engine.alist_adapters()
            await engine.aunload_adapter(name)
            return caps, after_load, await engine.alist_adapters()

        try:
            caps, after_load, after_unload = asyncio.run(scenario())
        finally:
            _unload_quietly(engine, name)
        assert caps == engine.capabilities()
        assert name in after_load and name not in after_unload
        assert after_unload == engine.list_adapters()

    def test_async_errors_match_sync(self, engine: Engine, adapter_dir: Path, loaded: str) -> None:
        async def unload_unknown() -> None:
            await engine.aunload_adapter(_fresh_name("unknown"))

        async def load_twice() -> None:
            await engine.aload_adapter(loaded, adapter_dir)

        with pytest.raises(AdapterNotFoundError):
            asyncio.run(unload_unknown())
        with pytest.raises(AdapterAlreadyLoadedError):
            asyncio.run(load_twice())
