"""Max-rank padding removal (lorasync.exporters.trim_tensor / trim_rank)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import lorasync
from lorasync.errors import ConfigError, PaddedRankError, ShapeMismatchError
from lorasync.exporters import trim_rank, trim_tensor
from lorasync.exporters.fsdp import export

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Real-part values include what a bitwise check must preserve: -0.0, NaN, inf, subnormals.
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -3.5, 65504.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Tensor bytes, so -0.0 != 0.0 and NaN payloads compare exactly."""
    return t.contiguous().view(torch.uint8)


@st.composite
def padded_factors(draw: st.DrawFn) -> dict:
    """A LoRA factor (plain [r, in] / [out, r] or packed [E, r, in] / [E, out, r]) and the same
    factor zero-padded to a larger max rank."""
    side = draw(st.sampled_from(["A", "B"]))
    packed = draw(st.lists(st.integers(1, 3), max_size=2))  # leading expert/stack dims
    rank = draw(st.integers(1, 6))
    pad = draw(st.integers(0, 5))
    other = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from(DTYPES))
    shape = [*packed, rank, other] if side == "A" else [*packed, other, rank]
    seed = draw(st.integers(0, 2**16))
    real = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    flat = real.view(-1)
    for i, value in draw(st.lists(st.tuples(st.integers(0, flat.numel() - 1), st.sampled_from(SPECIAL)), max_size=3)):
        flat[i] = value
    dim = real.dim() - 2 if side == "A" else real.dim() - 1
    pad_shape = list(real.shape)
    pad_shape[dim] = pad
    # Padding is exactly zero, of either sign.
    zeros = torch.zeros(pad_shape, dtype=dtype) * (-1.0 if draw(st.booleans()) else 1.0)
    padded = torch.cat([real, zeros], dim=dim)
    return {"side": side, "rank": rank, "real": real, "padded": padded, "dim": dim, "pad": pad}


@settings(max_examples=200, deadline=None)
@given(padded_factors())
def test_trim_is_exact(case: dict) -> None:
    trimmed = trim_tensor(case["padded"], case["side"], case["rank"], name="m")
    assert trimmed.shape == case["real"].shape
    assert trimmed.dtype == case["real"].dtype
    assert torch.equal(_bits(trimmed), _bits(case["real"]))


@settings(max_examples=200, deadline=None)
@given(
    padded_factors().filter(lambda c: c["pad"] > 0),
    st.lists(
        st.tuples(
            st.integers(0, 10**6),
            st.one_of(
                st.floats(allow_nan=False, allow_infinity=False, min_value=-1e4, max_value=1e4),
                st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-40, -6e-8]),
            ),
        ),
        min_size=1,
        max_size=4,
    ),
    st.from_regex(r"model\.layers\.[0-9]\.(self_attn|mlp)\.[a-z]_proj", fullmatch=True),
)
def test_nonzero_padding_anywhere_raises_naming_module_and_max(
    case: dict, pokes: list[tuple[int, float]], module: str
) -> None:
    padded = case["padded"].clone()
    padding = padded.narrow(case["dim"], case["rank"], case["pad"])
    flat = padding.clone().reshape(-1)
    for index, value in pokes:
        flat[index % flat.numel()] = value
    padding.copy_(flat.view(padding.shape))
    expected = padding.abs().max().item()
    assume(expected != 0)  # the value may round to zero in this dtype (1e-40 in fp16)
    with pytest.raises(PaddedRankError) as info:
        trim_tensor(padded, case["side"], case["rank"], name=module)
    err = info.value
    assert err.key == module
    assert module in str(err)
    assert (math.isnan(expected) and math.isnan(err.max_abs)) or err.max_abs == expected
    assert f"{expected:.6g}" in str(err)


def test_trim_under_python_O_still_raises() -> None:
    # The check must not be an assert: `python -O` strips asserts.
    code = textwrap.dedent(
        """
        import torch
        from lorasync.errors import PaddedRankError
        from lorasync.exporters import trim_tensor
        a = torch.zeros(6, 4)
        a[5, 3] = 0.5
        try:
            trim_tensor(a, "A", 4, name="model.layers.0.mlp.up_proj")
        except PaddedRankError as exc:
            print("RAISED", exc.max_abs)
        else:
            print("TRIMMED")
        print("ASSERTS", __debug__)
        """
    )
    # The child imports the same lorasync this test imported, wherever pytest runs from.
    root = str(Path(lorasync.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "ASSERTS False" in result.stdout
    assert "RAISED 0.5" in result.stdout


def test_trim_rank_per_module_and_missing_module() -> None:
    a = torch.cat([torch.ones(2, 3), torch.zeros(2, 3)])
    b = torch.cat([torch.ones(5, 2), torch.zeros(5, 2)], dim=1)
    tensors = {
        "base_model.model.x.q_proj.lora_A.weight": a,
        "base_model.model.x.q_proj.lora_B.weight": b,
        "base_model.model.x.v_proj.lora_A.weight": a,
        "base_model.model.x.v_proj.lora_B.weight": b,
    }
    out = trim_rank(tensors, {"x.q_proj": 2, "x.v_proj": 3})
    assert out["base_model.model.x.q_proj.lora_A.weight"].shape == (2, 3)
    assert out["base_model.model.x.q_proj.lora_B.weight"].shape == (5, 2)
    assert out["base_model.model.x.v_proj.lora_A.weight"].shape == (3, 3)
    with pytest.raises(ConfigError, match=r"no rank given for x\.v_proj"):
        trim_rank(tensors, {"x.q_proj": 2})


def test_trim_rejects_bad_rank_and_shape() -> None:
    with pytest.raises(ShapeMismatchError, match="rank must be positive"):
        trim_tensor(torch.zeros(4, 4), "A", 0, name="m")
    with pytest.raises(ShapeMismatchError, match="at least 2-D"):
        trim_tensor(torch.zeros(4), "A", 2, name="m")


def test_export_trims_padded_state_dict_with_per_module_ranks() -> None:
    """Multi-LoRA slot padded to rank 8; the real ranks differ per module."""
    gen = torch.Generator().manual_seed(0)
    real = {"model.layers.0.self_attn.q_proj": 2, "model.layers.0.mlp.down_proj": 4}
    state: dict[str, torch.Tensor] = {}
    for module, r in real.items():
        a = torch.zeros(8, 16)
        a[:r] = torch.randn(r, 16, generator=gen)
        b = torch.zeros(16, 8)
        b[:, :r] = torch.randn(16, r, generator=gen)
        state[f"module.base_model.model.{module}.lora_A.default.weight"] = a
        state[f"module.base_model.model.{module}.lora_B.default.weight"] = b
    adapter = export(state, rank=real, alpha=8)
    assert adapter.config.r == 4
    assert dict(adapter.config.rank_pattern) == {"model.layers.0.self_attn.q_proj": 2}
    for module, r in real.items():
        a, b = adapter.pair(module)
        assert torch.equal(a, state[f"module.base_model.model.{module}.lora_A.default.weight"][:r])
        assert torch.equal(b, state[f"module.base_model.model.{module}.lora_B.default.weight"][:, :r])
    with pytest.raises(PaddedRankError, match=r"model\.layers\.0\.mlp\.down_proj"):
        export(state, rank=3, alpha=8)
