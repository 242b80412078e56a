"""Each transport end to end on the in-process PEFT engine: after a publish the engine's greedy
tokens equal the trainer's, a second version changes them accordingly, and the merged fallback
folds every version from the pristine base."""

import pytest

from lorasync import Probe, Publisher
from lorasync.exporters.fsdp import export

from .conftest import PROMPTS, reference


@pytest.mark.parametrize("transport", ["disk", "ipc", "merged"])
def test_transport_serves_trained_weights_and_follows_versions(transport, trainer, peft_engine, tiny_model_dir, tmp_path):
    pub = Publisher([peft_engine], name="policy", transport=transport, root=tmp_path, base=tiny_model_dir)
    for version, seed in ((1, 11), (2, 12)):
        model = trainer(seed=seed)
        report = pub.publish(export(model), version=version)
        assert report.ok, report
        [result] = report.results
        assert result.transport == transport and result.status == "loaded"
        served = None if transport == "merged" else f"policy@v{version}"
        assert report.served_name == f"policy@v{version}" if served else True
        for prompt in PROMPTS:
            tokens, logprobs = peft_engine.greedy(served, prompt, 6)
            assert tokens == reference(model, prompt)
            expected = Probe.from_model(model, prompt, max_tokens=6)
            assert expected.mismatch(tokens, logprobs) is None
    # v2 differs from v1: the engine really switched (not still serving v1).
    v1 = trainer(seed=11)
    assert any(reference(v1, p) != peft_engine.greedy(served, p, 6)[0] for p in PROMPTS)


def test_merged_bytes_are_touched_modules_only(trainer, peft_engine, tiny_model_dir, tmp_path):
    model = trainer(seed=3, targets=("q_proj", "v_proj"))
    report = Publisher([peft_engine], name="p", transport="merged", root=tmp_path, base=tiny_model_dir).publish(export(model), version=1)
    # 2 layers x (q: 256x256 + v: 128x256) fp32
    assert report.results[0].bytes_moved == 2 * (256 * 256 + 128 * 256) * 4
    assert [peft_engine.greedy(None, p, 6)[0] for p in PROMPTS] == [reference(model, p) for p in PROMPTS]


def test_merged_restores_modules_the_new_version_no_longer_touches(trainer, peft_engine, tiny_model_dir, tmp_path):
    pub = Publisher([peft_engine], name="p", transport="merged", root=tmp_path, base=tiny_model_dir)
    pub.publish(export(trainer(seed=4, targets=("q_proj", "down_proj"))), version=1)
    only_q = trainer(seed=5, targets=("q_proj",))
    assert pub.publish(export(only_q), version=2).ok
    assert [peft_engine.greedy(None, p, 6)[0] for p in PROMPTS] == [reference(only_q, p) for p in PROMPTS]
