"""In-place publishing: one plain name switches atomically, only where the engine makes it safe."""

import pytest

from lorasync import Probe, Publisher
from lorasync.errors import CapabilityError, StaleVersionError, VerificationError
from lorasync.exporters.fsdp import export
from lorasync.testing import MemoryEngine

from .conftest import PROMPTS, reference


@pytest.mark.parametrize("transport", ["auto", "disk"])
def test_in_place_serves_each_version_under_one_name(transport, trainer, peft_engine, tmp_path):
    pub = Publisher([peft_engine], name="policy", in_place=True, transport=transport, root=tmp_path, keep=1)
    for version, seed in ((1, 81), (2, 82), (3, 83)):
        model = trainer(seed=seed)
        report = pub.publish(export(model), version=version, verify=Probe.from_model(model, PROMPTS[0], max_tokens=4))
        assert report.ok, report
        assert report.served_name == "policy" and peft_engine.list_adapters() == ["policy"]
        assert [peft_engine.greedy("policy", p, 6)[0] for p in PROMPTS] == [reference(model, p) for p in PROMPTS]
    if transport == "disk":
        assert sorted(p.name for p in pub.store.run_dir("policy").iterdir() if p.is_dir() and not p.name.startswith(".")) == ["v3"]
    with pytest.raises(StaleVersionError):
        pub.publish(export(trainer(seed=84)), version=2).raise_for_errors()


def test_failed_verification_puts_the_previous_weights_back(trainer, peft_engine, tmp_path):
    v1, v2 = trainer(seed=91), trainer(seed=92)
    pub = Publisher([peft_engine], name="p", in_place=True, root=tmp_path)
    assert pub.publish(export(v1), version=1).ok
    report = pub.publish(export(v2), version=2, verify=Probe.from_model(v1, PROMPTS[1], max_tokens=4))
    assert isinstance(report.results[0].error, VerificationError)
    assert peft_engine.greedy("p", PROMPTS[0], 6)[0] == reference(v1, PROMPTS[0])


def test_in_place_refused_where_unsafe(trainer, tmp_path):
    engine = MemoryEngine()  # like vLLM 0.32 and SGLang: no safe in-place swap
    report = Publisher([engine], name="p", in_place=True, root=tmp_path).publish(export(trainer(seed=1)), version=1)
    assert isinstance(report.results[0].error, CapabilityError)
    assert engine.list_adapters() == []
