"""MoE LoRA inside a real in-process ``vllm.LLM`` (vLLM 0.32 CPU build): what vLLM holds after a load.

Runs in the vLLM engine venv (``tests/engines/test_vllm_moe.py`` writes the tiny Qwen3-MoE, the
adapters exported by lorasync from a PEFT ``target_parameters`` LoRA, and a JSON file named by
``LORASYNC_MOE_DATA``, then runs this module there with pytest, once per ``LORASYNC_MOE_MODE``:
``plain``, an ``LLM`` without vLLM's mixed MoE LoRA format, and ``mixed``, one with
``enable_mixed_moe_lora_format=True``). One ``LLM`` per run.

vLLM's CPU build cannot serve MoE LoRA tokens: with LoRA enabled on an MoE model it always takes
its Triton-only MoE LoRA kernel, which has no CPU backend, so any request kills the engine. Token
serving of MoE LoRA therefore runs in the GPU suite (``tests/gpu``, which reuses
``lorasync.testing.make_moe_case``); here every expert's LoRA buffers inside vLLM are read back
and compared with the adapter's B·A·scale.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter, Publisher
from lorasync.engines import connect
from lorasync.errors import IncompatibleAdapterError

MODE = os.environ.get("LORASYNC_MOE_MODE", "plain")
DATA: dict[str, Any] = json.loads(Path(os.environ["LORASYNC_MOE_DATA"]).read_text()) if os.environ.get("LORASYNC_MOE_DATA") else {}
EXPERTS = 4
LAYERS = 2


def _tensor(wire: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(wire["data"]))
    return torch.frombuffer(raw, dtype=torch.float32).reshape(wire["shape"])


@pytest.fixture(scope="module")
def llm() -> Any:
    from vllm import LLM

    return LLM(
        model=DATA["model_dir"], enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=4, dtype="float32",
        enforce_eager=True, max_model_len=128, max_num_seqs=2, worker_extension_cls="tests.engines.vllm_moe_ext.MoEProbeExtension",
        enable_mixed_moe_lora_format=MODE == "mixed",
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(llm: Any) -> Any:
    return connect("vllm-inprocess", llm=llm)


def without_router(adapter: Adapter) -> Adapter:
    """``adapter`` less its router (``mlp.gate``) factors, which vLLM does not apply (refused)."""
    return Adapter({k: v for k, v in adapter.tensors.items() if ".mlp.gate." not in k}, adapter.config)


def buffers(llm: Any, engine: Any, served: str) -> dict[str, Any]:
    (answer,) = llm.collective_rpc("moe_probe_buffers", args=(engine.lora_request(served).lora_int_id,))
    return answer


def assert_vllm_holds(adapter: Adapter, held: dict[str, Any]) -> float:
    """Every expert's (and the router's) slot buffers are the adapter's factors with its scale
    folded into B, bit for bit, so each B·A equals the adapter's scale·B·A; returns the largest
    |ΔW| error over all experts."""
    worst = 0.0
    assert sorted(held["experts"]) == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    for owner, slots in held["experts"].items():
        for leaf, (a_key, b_key) in {"gate_proj": ("w1_a", "w1_b"), "up_proj": ("w3_a", "w3_b"), "down_proj": ("w2_a", "w2_b")}.items():
            a_buf, b_buf = _tensor(slots[a_key]), _tensor(slots[b_key])
            assert a_buf.shape[0] == EXPERTS
            for e in range(EXPERTS):
                module = f"{owner}.{e}.{leaf}"
                a, b = adapter.pair(module)
                r = a.shape[0]
                scale = adapter.config.scale_for(module)
                assert torch.equal(a_buf[e, :r], a) and not a_buf[e, r:].any(), module
                assert torch.equal(b_buf[e, :, :r], b * scale) and not b_buf[e, :, r:].any(), module
                worst = max(worst, float((b_buf[e] @ a_buf[e] - adapter.delta(module)).abs().max()))
    for layer in range(LAYERS):
        router = f"model.layers.{layer}.mlp.gate"
        if router in adapter.modules:
            (a_buf,), (b_buf,) = (_tensor(x) for x in held["linear"][router]["a"]), (_tensor(x) for x in held["linear"][router]["b"])
            a, b = adapter.pair(router)
            assert torch.equal(a_buf[: a.shape[0]], a) and torch.equal(b_buf[:, : a.shape[0]], b * adapter.config.scale_for(router))
    return worst


@pytest.mark.parametrize("transport", ["ipc", "disk"])
def test_every_expert_buffer_is_the_adapters_ba_scale(llm: Any, engine: Any, tmp_path: Path, transport: str) -> None:
    """Through lorasync's in-memory path (``ipc``: the worker extension builds the LoRA from
    staged tensors; before this fix it refused every expert module) and its disk path. Token
    serving of MoE LoRA runs in the GPU suite: vLLM's CPU build has no MoE LoRA kernel."""
    if MODE != "plain":
        pytest.skip("the plain LLM only")
    adapter = without_router(Adapter.load(DATA["adapters"]["moe"]))
    with Publisher(engine, name=f"moe-{transport}", transport=transport, root=tmp_path / "store") as publisher:
        report = publisher.publish(adapter, version=1).raise_for_errors()
        assert report.results[0].transport == transport
        worst = assert_vllm_holds(adapter, buffers(llm, engine, report.served_name))
        assert worst <= 1e-6, worst
        print(f"MOE-BUFFERS {transport}: max |B·A·scale - adapter delta| = {worst:.3g}")
    engine.unload_adapter(report.served_name)


def test_both_paths_refuse_what_vllms_loader_refuses(engine: Any) -> None:
    """Expert 9 of a 4-expert model: vLLM's disk loader names it unexpected; the in-memory path,
    which now applies vLLM's own rule, refuses it the same way (nothing served)."""
    if MODE != "plain":
        pytest.skip("the plain LLM only")
    bogus = Adapter.load(DATA["adapters"]["bogus_expert"])
    with pytest.raises(IncompatibleAdapterError, match=r"experts\.9\.gate_proj"):
        engine.load_adapter("bogus-disk", DATA["adapters"]["bogus_expert"])
    with pytest.raises(IncompatibleAdapterError, match=r"experts\.9\.gate_proj"):
        engine.load_adapter_tensors("bogus-ipc", bogus)
    assert not any(name.startswith("bogus") for name in engine.list_adapters())


def test_3d_is_refused_by_an_engine_without_the_mixed_format(engine: Any, llm: Any, tmp_path: Path) -> None:
    """``moe_lora_format="3d"`` asks for PEFT's fused 3-D keys (``is_3d_lora_weight=True``); an LLM
    built without ``enable_mixed_moe_lora_format`` does not load them: refused before anything
    moves, with what to change."""
    if MODE != "plain":
        pytest.skip("the plain LLM only")
    asking = connect("vllm-inprocess", llm=llm, moe_lora_format="3d")
    assert asking.capabilities().moe_3d is False
    with Publisher(asking, name="moe-3d", root=tmp_path / "store") as publisher:
        report = publisher.publish(without_router(Adapter.load(DATA["adapters"]["moe"])), version=1)
    error = report.results[0].error
    assert isinstance(error, IncompatibleAdapterError) and "--enable-mixed-moe-lora-format" in str(error), error
    assert asking.list_adapters() == []


def test_3d_through_the_mixed_format_fills_the_same_buffers(llm: Any, tmp_path: Path) -> None:
    """The in-memory path sends PEFT's fused 3-D keys (the inverse of the export's layout) with
    ``is_3d_lora_weight=True``; vLLM converts them to its per-expert buffers, which hold exactly
    the adapter's factors, as the per-expert format does. Token serving runs in the GPU suite."""
    if MODE != "mixed":
        pytest.skip("needs enable_mixed_moe_lora_format=True")
    adapter = without_router(Adapter.load(DATA["adapters"]["moe"]))
    for fmt in ("3d", "per_expert"):
        engine = connect("vllm-inprocess", llm=llm, moe_lora_format=fmt)
        assert engine.capabilities().moe_3d is True
        with Publisher(engine, name=f"moe-{fmt}", transport="ipc", root=tmp_path / fmt) as publisher:
            report = publisher.publish(adapter, version=1).raise_for_errors()
            assert engine.lora_request(report.served_name).is_3d_lora_weight == (fmt == "3d")
            worst = assert_vllm_holds(adapter, buffers(llm, engine, report.served_name))
            assert worst <= 1e-6, worst
            print(f"MOE-BUFFERS mixed {fmt}: max |B·A·scale - adapter delta| = {worst:.3g}")
        engine.unload_adapter(report.served_name)


def test_router_lora_is_refused_because_the_routing_bypasses_it(llm: Any, engine: Any, tmp_path: Path) -> None:
    """Issue 33 item 23: vLLM 0.26 on the GPU loaded ``mlp.gate`` LoRA and ignored it, and
    lorasync reported the publish ok. vLLM 0.32 does the same, read from the real engine's module
    graph (the CPU build cannot run the forward: its MoE LoRA kernel is Triton-only): the MoE
    runner routes through its own reference to the gate, and vLLM's rewiring of that reference
    lands on the runner's LoRA wrapper, whose forward calls the runner, which still holds the bare
    gate. So the publish is refused before anything moves. If a release ever routes through the
    wrapper, this test fails: set ``router_lora=True`` for it in ``_lora_compat.RELEASES``."""
    if MODE != "plain":
        pytest.skip("the plain LLM only")
    from lorasync.engines.vllm._lora_compat import rules_for

    (found,) = llm.collective_rpc("moe_probe_router_paths")
    assert sorted(found) == [f"model.layers.{i}.mlp.gate" for i in range(LAYERS)], found
    for router, where in found.items():
        runner = router.replace(".mlp.gate", ".mlp.experts")
        # The forward: FusedMoEWithLoRA.forward -> its base_layer (the MoE runner) -> runner.gate.
        assert f"{runner}.base_layer.gate" in where["bare_at"], f"{router}: the runner no longer holds the bare gate: {where}"
    version = engine.capabilities().version
    assert version.startswith("0.32") and rules_for(version).router_lora is False
    adapter = Adapter.load(DATA["adapters"]["moe"])
    with Publisher(engine, name="moe-router", transport="ipc", root=tmp_path / "store") as publisher:
        report = publisher.publish(adapter, version=1)
    error = report.results[0].error
    assert isinstance(error, IncompatibleAdapterError) and "does not apply it" in str(error), report
    assert not [n for n in engine.list_adapters() if n.startswith("moe-router")]
    print(f"MOE-ROUTER refused on vLLM {version}: {found}")
