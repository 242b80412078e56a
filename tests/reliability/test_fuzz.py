"""Exporter fuzzing (see _fuzz.py): every input becomes an Adapter whose ΔW equals an independent
reference, or a LoraSyncError. Bounded here (fixed examples); LORASYNC_SOAK=1 runs 1000 random
examples per exporter."""

from __future__ import annotations

import pytest

from . import _fuzz as fz
from ._figures import record

BOUNDED = 150
SOAK = 1000


@pytest.mark.parametrize(
    ("kind", "strategy", "check"),
    [
        ("fsdp", fz.fsdp_state_dicts, fz.check_fsdp_state_dict),
        ("peft", fz.peft_models, fz.check_peft_model),
        ("megatron", fz.megatron_shards, fz.check_megatron),
    ],
)
def test_exporter_fuzz(kind, strategy, check):
    ran = fz.fuzz(strategy(), check, BOUNDED, derandomize=True)
    record(**{f"fuzz_{kind}": ran})
    exported = fz.STATS[f"{'fsdp-dict' if kind == 'fsdp' else 'fsdp-peft' if kind == 'peft' else 'megatron'}:exported"]
    assert ran == BOUNDED and exported > BOUNDED // 4  # most examples reach the math, not just refusals


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "strategy", "check"),
    [
        ("fsdp", fz.fsdp_state_dicts, fz.check_fsdp_state_dict),
        ("peft", fz.peft_models, fz.check_peft_model),
        ("megatron", fz.megatron_shards, fz.check_megatron),
    ],
)
def test_exporter_fuzz_soak(kind, strategy, check):
    record(**{f"fuzz_{kind}": fz.fuzz(strategy(), check, SOAK)})


def test_fuzz_catches_a_silently_wrong_exporter(monkeypatch):
    # The property has teeth: a k/v swap in the QKV split is found.
    import lorasync.exporters.megatron._convert as convert

    split = convert.split_qkv
    monkeypatch.setattr(convert, "split_qkv", lambda b, g: (lambda q, k, v: (q, v, k))(*split(b, g)))
    with pytest.raises(AssertionError, match="k_proj|v_proj"):
        fz.fuzz(fz.megatron_shards(), fz.check_megatron, 100, derandomize=True)
