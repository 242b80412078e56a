"""The fleet's unchanged check (``lorasync.fleet._hash``): its hash is ``Adapter.content_hash``, and
a round that hashes many tenants in threads, and publishes a changed one while it hashes the rest,
still sees content changed in place after a no-copy export, by writes no version counter sees."""

from __future__ import annotations

import pytest
import torch

from lorasync import Adapter, AdapterConfig, Fleet
from lorasync.fleet._hash import WORKERS, content_hash
from lorasync.exporters.fsdp import export
from tests.reliability._trust import lora_params, state
from tests.reliability._trust import served_lora as served

from .conftest import CountingEngine


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return bool(a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_fast_hash_is_the_content_hash():
    gen = torch.Generator().manual_seed(0)
    pairs = {f"base_model.model.layers.{i}.mlp.up_proj": (torch.randn(4, 32, generator=gen), torch.randn(48, 4, generator=gen)) for i in range(3)}
    plain = {k: t for m, (a, b) in pairs.items() for k, t in ((f"{m}.lora_A.weight", a), (f"{m}.lora_B.weight", b))}
    config = AdapterConfig(r=4, lora_alpha=8)
    adapters = [
        Adapter(plain, config),
        Adapter(plain, config).to(dtype=torch.bfloat16),
        Adapter({k: torch.nn.Parameter(t) for k, t in plain.items()}, config),
        Adapter({k: t.T.contiguous().T for k, t in plain.items()}, config),  # not contiguous: the slow path
        Adapter(plain, AdapterConfig(r=4, lora_alpha=16)),
    ]
    assert not next(iter(adapters[3].tensors.values())).is_contiguous()
    for adapter in adapters:
        assert content_hash(adapter) == adapter.content_hash
    assert len({content_hash(a) for a in adapters}) == 3  # the same bytes and config hash alike


@pytest.mark.parametrize(("transport", "max_loras"), [("disk", None), ("disk", 8), ("auto", None)])
def test_a_data_write_after_a_no_copy_export_is_published(trainer, tiny_model_dir, tmp_path, transport, max_loras):
    """More tenants than hashing threads, each passed every round as the same no-copy Adapter
    (the trainer's memory). One trainer writes through ``.data``: no version counter moves, and
    the round still publishes exactly that tenant, whether it publishes while hashing the others
    (no slot limit) or after the plan (a limit); then a restart restores what each version was."""
    engine = CountingEngine(base_model_path=tiny_model_dir, max_loras=max_loras)
    engine.loads = []
    names = [f"t{i}" for i in range(WORKERS + 3)]
    models = {name: trainer(seed=i + 1) for i, name in enumerate(names)}
    exported = {name: export(m) for name, m in models.items()}  # no copy: the trainers' own tensors
    with Fleet([engine], transport=transport, root=tmp_path) as fleet:
        for name in names:
            fleet.register(name, keep=1, grace=0.0)
        fleet.publish(exported, versions=dict.fromkeys(names, 1)).raise_for_errors()
        v1 = {name: state(m) for name, m in models.items()}
        for changed, version in ((names[-1], 2), (names[1], 3)):  # last in order, then one in between
            counters = [t._version for t in exported[changed].tensors.values()]
            with torch.no_grad():
                for p in lora_params(models[changed]):
                    p.data.add_(0.25)  # .data: bypasses the version counter the export shares
            assert [t._version for t in exported[changed].tensors.values()] == counters
            engine.loads.clear()
            report = fleet.publish(exported, versions=dict.fromkeys(names, version))
            report.raise_for_errors()
            assert {n: t.status for n, t in report.tenants.items()} == {n: "loaded" if n == changed else "unchanged" for n in names}
            assert list(report.tenants) == [*(n for n in names if n != changed), changed]  # settled by hash first
            assert engine.loads == [f"{changed}@v{version}"]
            assert same(served(engine, f"{changed}@v{version}"), state(models[changed]))
        # Where every engine loads files, the version's directory is the restore's source, not a copy.
        assert all((t._copy is None) == (transport == "disk") for t in fleet.tenants.values())
        published = {n: state(m) for n, m in models.items()}
        for model in models.values():  # the trainers move on; then the engine restarts
            with torch.no_grad():
                for p in lora_params(model):
                    p.data.mul_(2)
        for name in engine.list_adapters():
            engine.unload_adapter(name)
        restored = fleet.restore()
        assert sorted(restored.restored) == sorted(names)
        for name in names:
            version = fleet.tenants[name].version
            assert same(served(engine, f"{name}@v{version}"), published[name]), name
        assert same(served(engine, "t0@v1"), v1["t0"])


def test_a_round_on_a_loop_with_a_one_thread_executor(trainer, tiny_model_dir, tmp_path):
    """The hashing threads are the round's own: one waiting for a changed tenant's write never
    takes the only thread of the caller's executor that the write needs."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    engine = CountingEngine(base_model_path=tiny_model_dir)  # no slot limit: publishes overlap hashing
    engine.loads = []
    models = {name: trainer(seed=i + 1) for i, name in enumerate(("a", "b", "c"))}
    exported = {name: export(m) for name, m in models.items()}

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        async with Fleet([engine], transport="disk", root=tmp_path) as fleet:
            for name in models:
                await fleet.aregister(name, keep=1, grace=0.0)
            (await fleet.apublish(exported, versions=dict.fromkeys(models, 1))).raise_for_errors()
            with torch.no_grad():
                for p in lora_params(models["a"]):
                    p.add_(0.5)
            report = await asyncio.wait_for(fleet.apublish(exported, versions=dict.fromkeys(models, 2)), timeout=120)
            assert {n: t.status for n, t in report.tenants.items()} == {"a": "loaded", "b": "unchanged", "c": "unchanged"}
            assert same(served(engine, "a@v2"), state(models["a"]))

    asyncio.run(main())
