"""Stdlib pickle of the values that cross process boundaries (torch.multiprocessing, process
pools, Ray's object store): Adapter, AdapterConfig, Probe, PublishReport and every error."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch

import lorasync.errors as errors
from lorasync import Adapter, AdapterConfig
from lorasync.adapter._probe import Probe
from lorasync.publisher._report import EngineResult, PublishReport


def _adapter() -> Adapter:
    g = torch.Generator().manual_seed(3)
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16, generator=g),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 4, generator=g),
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.randn(2, 16, generator=g),
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": torch.randn(32, 2, generator=g),
    }
    config = AdapterConfig(r=4, lora_alpha=8, rank_pattern={"up_proj": 2}, alpha_pattern={"up_proj": 3.0})
    return Adapter(tensors, config)


def test_adapter_round_trips_exactly() -> None:
    adapter = _adapter()
    back = pickle.loads(pickle.dumps(adapter))
    assert isinstance(back, Adapter) and back.config == adapter.config
    assert list(back.tensors) == list(adapter.tensors)
    for key, tensor in adapter.tensors.items():
        assert torch.equal(back.tensors[key], tensor) and back.tensors[key].dtype == tensor.dtype
    assert back.content_hash == adapter.content_hash
    # Still read-only after the trip, and the pattern order (PEFT's first match) is kept.
    with pytest.raises(TypeError):
        back.tensors["x"] = torch.zeros(1)  # type: ignore[index]
    assert list(back.config.rank_pattern.items()) == [("up_proj", 2)]
    assert back.config.scale_for("model.layers.0.mlp.up_proj") == adapter.config.scale_for("model.layers.0.mlp.up_proj")


def test_config_round_trips_for_every_protocol() -> None:
    config = _adapter().config
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(config, protocol=protocol))
        assert back == config
        with pytest.raises(TypeError):
            back.rank_pattern["q_proj"] = 1  # type: ignore[index]


def test_probe_and_report_round_trip() -> None:
    probe = Probe(prompt_ids=(5, 6, 7), expected_ids=(9, 10), expected_logprobs=(-0.5, -1.25), atol=0.01)
    assert pickle.loads(pickle.dumps(probe)) == probe
    failure = errors.RankTooLargeError("rank 32 > 16; restart", engine="vllm", url="http://h:1", rank=32, max_rank=16)
    report = PublishReport(
        name="policy",
        version=3,
        served_name="policy@v3",
        content_hash="abc",
        nbytes=1024,
        results=[
            EngineResult(engine="vllm", url="http://h:1", status="failed", reason="rank", error=failure),
            EngineResult(engine="peft", url="", status="ok", transport="inproc", served_name="policy@v3", retired=["policy@v1"]),
        ],
        timings={"total": 0.5},
    )
    back = pickle.loads(pickle.dumps(report))
    # Exceptions compare by identity: compare everything else field by field.
    assert (back.name, back.version, back.served_name, back.content_hash, back.nbytes, back.timings) == (
        "policy", 3, "policy@v3", "abc", 1024, {"total": 0.5}
    )
    assert back.results[1] == report.results[1]
    assert (back.results[0].status, back.results[0].reason, str(back.results[0].error)) == ("failed", "rank", str(failure))
    error = back.results[0].error
    assert type(error) is errors.RankTooLargeError and (error.rank, error.max_rank, error.engine) == (32, 16, "vllm")


def _error_classes() -> list[type[BaseException]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.LoraSyncError) and cls.__module__ == errors.__name__
    ]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_round_trips_with_its_context(cls: type[errors.LoraSyncError]) -> None:
    error = cls("what went wrong; what to do", engine="vllm", url="http://h:1", adapter="policy@v2", status=500)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error)
    assert back.context == error.context and (back.engine, back.adapter, back.status) == ("vllm", "policy@v2", 500)
