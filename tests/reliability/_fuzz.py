"""Exporter fuzzing: any input either becomes an Adapter whose per-module ΔW = scale·B·A equals a
reference computed independently from that input, or raises a ``LoraSyncError``. Never another
exception type, never a silently different result.

References are written from the trainer's math, not from lorasync's exporters:

* FSDP/PEFT state dicts: the generator knows which module and adapter every decorated key
  stands for; ΔW = alpha / rank · B·A on the untrimmed factors (zero padding adds nothing, so a
  silently trimmed non-zero pad shows up as a difference).
* PEFT models: PEFT's own ``LoraLayer.get_delta_weight`` (rank/alpha patterns, rsLoRA included).
* Megatron shards: what Megatron computes with each rank's fused tensors (trainer-formats.md
  §1.2-1.3 and §2: TP gathers per parallel kind, fused QKV rows de-interleaved with the per-row
  formulas, fc1 split per TP rank into gate and up).
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lorasync.errors import LoraSyncError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "megatron"))
from _shard_builder import build_shards, config, make_peft  # noqa: E402 - independent inverse of the exporter

P = "base_model.model."
STATS: Counter[str] = Counter()  # "<exporter>:exported" / "<exporter>:<error class>" per example


def fuzz(strategy: st.SearchStrategy[Any], check: Callable[[Any], None], examples: int, *, derandomize: bool = False) -> int:
    """Run ``check`` on ``examples`` generated inputs (no example database; ``derandomize``: the
    same examples every run, for CI); returns how many ran."""
    ran = 0

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(strategy)
    def run(case: Any) -> None:
        nonlocal ran
        ran += 1
        check(case)

    run()
    return ran


def outcome(call: Callable[[], Any], kind: str) -> tuple[Any, BaseException | None]:
    """``(result, None)`` or ``(None, LoraSyncError)``; any other exception fails the property."""
    try:
        result = call()
    except LoraSyncError as exc:
        STATS[f"{kind}:{type(exc).__name__}"] += 1
        return None, exc
    except Exception as exc:  # the property: nothing but LoraSyncError may escape
        raise AssertionError(f"untyped {type(exc).__name__} escaped the exporter: {exc}") from exc
    STATS[f"{kind}:exported"] += 1
    return result, None


def same_delta(got: torch.Tensor, want: torch.Tensor, *, exact: bool, what: str) -> None:
    tol = {"rtol": 1e-9, "atol": 1e-12} if exact else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.double(), want.double(), equal_nan=True, msg=lambda m: f"{what}: {m}", **tol)


# -- FSDP / PEFT state dicts ----------------------------------------------------------------------

LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
WRAPPERS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16)


@st.composite
def fsdp_state_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A decorated trainer state dict plus the ground truth of what each key means."""
    n = draw(st.integers(1, 3))
    modules = draw(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(LEAVES)), min_size=n, max_size=n, unique=True))
    modules = [f"model.layers.{i}.{'self_attn' if leaf.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{leaf}" for i, leaf in modules]
    rank = draw(st.integers(1, 4))
    width = rank + draw(st.sampled_from((0, 0, 1, 3)))  # multi-LoRA max-rank padding
    nonzero_pad = width > rank and draw(st.booleans())
    segment = draw(st.booleans())  # "lora_A.default.weight" (named_parameters) vs "lora_A.weight" (saved)
    prefixed = draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    truth: dict[str, tuple[str, str]] = {}  # module -> (key of its A, key of its B) in the input
    sd: dict[str, Any] = {}

    def decorate(module: str, side: str, adapter: str | None) -> str:
        parts = (["base_model", "model"] if prefixed else []) + module.split(".")
        for _ in range(draw(st.integers(0, 2))):
            parts.insert(draw(st.integers(0, len(parts))), draw(st.sampled_from(WRAPPERS)))
        parts = ["module"] * draw(st.integers(0, 2)) + parts
        return ".".join(parts + [f"lora_{side}"] + ([adapter] if adapter else []) + ["weight"])

    for module in modules:
        fin, fout = draw(st.integers(1, 8)), draw(st.integers(1, 8))
        a = torch.randn(width, fin, generator=gen)
        b = torch.randn(fout, width, generator=gen)
        if width > rank and not nonzero_pad:
            a[rank:] = 0
            b[:, rank:] = 0
        key_a, key_b = decorate(module, "A", "default" if segment else None), decorate(module, "B", "default" if segment else None)
        truth[module] = (key_a, key_b)
        sd[key_a], sd[key_b] = a, b
        if draw(st.booleans()):  # another adapter on the same module: never exported
            sd[decorate(module, "A", "other")] = torch.randn(width, fin, generator=gen)
            sd[decorate(module, "B", "other")] = torch.randn(fout, width, generator=gen)
        if draw(st.booleans()):  # the frozen base weight next to it
            sd[".".join([P.rstrip("."), module, "base_layer", "weight"])] = torch.randn(fout, fin, generator=gen)
    if draw(st.booleans()):
        sd[f"{P}model.embed_tokens.modules_to_save.default.weight"] = torch.randn(4, 4, generator=gen)

    # Hostile mutations of the input (each a reason the export may refuse, never a reason to lie).
    mutation = draw(st.sampled_from(("none", "none", "none", "dtype", "shape", "non_tensor", "drop", "duplicate", "nan", "int")))
    keys = [k for k in sd if ".lora_" in k and ".other." not in k]
    victim = draw(st.sampled_from(keys))
    if mutation == "dtype":
        sd[victim] = sd[victim].to(torch.float16)
    elif mutation == "shape":
        sd[victim] = draw(st.sampled_from((sd[victim].T.contiguous(), sd[victim][:, :0], sd[victim].unsqueeze(0), sd[victim].reshape(-1))))
    elif mutation == "non_tensor":
        sd[victim] = draw(st.sampled_from((sd[victim].tolist(), None, "tensor", 3.0)))
    elif mutation == "drop":
        del sd[victim]
    elif mutation == "duplicate":  # the same PEFT key reached through a second decoration
        same = draw(st.booleans())
        sd["module." + victim] = sd[victim].clone() if same else sd[victim] + 1.0
        mutation = "duplicate_same" if same else "duplicate_differs"
    elif mutation == "nan":
        sd[victim] = sd[victim].clone()
        sd[victim].view(-1)[0] = float("nan")
    elif mutation == "int":
        sd[victim] = sd[victim].to(torch.int64)

    valid = draw(st.integers(0, 3)) > 0  # mostly valid options, so most examples reach the math
    alpha = draw(st.sampled_from((8.0, 16, 0.5) if valid else (0.0, -4.0, math.nan, math.inf, None)))
    rank_arg = draw(st.sampled_from((None, rank) if valid else (rank + 1, rank - 1, 0, -1, True)))
    dtype = draw(st.sampled_from(DTYPES))
    return {"sd": sd, "truth": truth, "rank": rank, "width": width, "alpha": alpha, "rank_arg": rank_arg,
            "dtype": dtype, "mutation": mutation, "clean_pad": not nonzero_pad}  # fmt: skip


def check_fsdp_state_dict(case: dict[str, Any]) -> None:
    from lorasync.exporters.fsdp import export

    sd, alpha, rank_arg, cast = case["sd"], case["alpha"], case["rank_arg"], case["dtype"]
    adapter, error = outcome(lambda: export(sd, alpha=alpha, rank=rank_arg, dtype=cast), "fsdp-dict")
    valid_alpha = isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0
    valid_rank = rank_arg is None or (type(rank_arg) is int and rank_arg == case["rank"] and case["clean_pad"])
    if case["mutation"] in ("none", "nan", "duplicate_same") and valid_alpha and valid_rank and (rank_arg or case["width"]) == case["width"] or (
        case["mutation"] == "none" and valid_alpha and type(rank_arg) is int and rank_arg == case["rank"] and case["clean_pad"]
    ):
        assert error is None, f"a well-formed state dict was refused: {error!r}"
    if error is not None:
        return
    assert case["mutation"] != "duplicate_differs", "two different values of one weight were exported without complaint"
    assert set(adapter.modules) == set(case["truth"]), f"exported {adapter.modules}, trained {sorted(case['truth'])}"
    scale = alpha / (rank_arg if rank_arg is not None else case["width"])
    for module, (key_a, key_b) in case["truth"].items():
        a, b = sd[key_a], sd[key_b]  # what the input holds (a missing key would have to fail)
        if cast is not None:
            a, b = a.to(cast), b.to(cast)
        if rank_arg is not None:  # the contract: factors are cut to rank= only where they are zero
            assert not a[rank_arg:].any() and not b[:, rank_arg:].any(), f"{module}: non-zero padding dropped"
            a, b = a[:rank_arg], b[:, :rank_arg]
        want = scale * (b.double() @ a.double())
        same_delta(adapter.delta(module, torch.float64), want, exact=True, what=module)


# -- PEFT models ----------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int, gen: torch.Generator) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d // 2, bias=False)
        self.down_proj = nn.Linear(d, d + 3, bias=False)


class _Tiny(nn.Module):
    def __init__(self, d: int, layers: int, gen: torch.Generator) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(d, gen) for _ in range(layers))


class _Holder(nn.Module):
    def __init__(self, name: str, inner: nn.Module) -> None:
        super().__init__()
        self.add_module(name, inner)


@st.composite
def peft_models(draw: st.DrawFn) -> dict[str, Any]:
    """A small PEFT model with random LoRA hyper-parameters, one or two adapters, maybe wrapped."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    layers = draw(st.integers(1, 2))
    targets = draw(st.lists(st.sampled_from(("q_proj", "v_proj", "down_proj")), min_size=1, max_size=3, unique=True))

    def lora_config() -> Any:
        names = [f"layers.{i}.{t}" for i in range(layers) for t in targets]
        patterns = draw(st.lists(st.sampled_from(names + targets), max_size=2, unique=True))
        return LoraConfig(
            r=draw(st.integers(1, 6)),
            lora_alpha=draw(st.sampled_from((1, 4, 8.0, 16, 32))),
            target_modules=targets,
            use_rslora=draw(st.booleans()),
            rank_pattern={p: draw(st.integers(1, 6)) for p in patterns if draw(st.booleans())},
            alpha_pattern={p: draw(st.sampled_from((2, 8, 24))) for p in patterns if draw(st.booleans())},
            lora_dropout=0.0,
        )

    model = get_peft_model(_Tiny(8, layers, torch.Generator()), lora_config())
    names = ["default"]
    if draw(st.booleans()):
        model.add_adapter("second", lora_config())
        names.append("second")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param))
    wrapper = draw(st.sampled_from((None, "module", "_orig_mod", "_fsdp_wrapped_module")))
    source = model if wrapper is None else _Holder(wrapper, model)
    return {"model": model, "source": source, "adapter": draw(st.sampled_from(names)), "dtype": draw(st.sampled_from(DTYPES))}


def check_peft_model(case: dict[str, Any]) -> None:
    from peft.tuners.lora import LoraLayer

    from lorasync.exporters.fsdp import export

    name, dtype = case["adapter"], case["dtype"]
    adapter, error = outcome(lambda: export(case["source"], adapter_name=name, dtype=dtype), "fsdp-peft")
    assert error is None, f"a PEFT model was refused: {error!r}"
    want = {}
    for path, module in case["model"].named_modules():
        if isinstance(module, LoraLayer) and name in module.lora_A:
            with torch.no_grad():
                want[path.removeprefix(P)] = module.get_delta_weight(name).double()  # PEFT's own ΔW
    assert set(adapter.modules) == set(want), f"exported {adapter.modules}, PEFT has {sorted(want)}"
    cast = dtype not in (None, torch.float32, torch.float64)
    for module, delta in want.items():
        got = adapter.delta(module, torch.float64)
        # PEFT computes in float32; a bf16/fp16 export is compared within that format's precision.
        tol = 0.05 * float(delta.abs().max()) + 1e-3 if cast else 1e-5
        config = case["model"].peft_config[name]
        why = (
            f"r={config.r} alpha={config.lora_alpha} rslora={config.use_rslora} "
            f"rank_pattern={config.rank_pattern} alpha_pattern={config.alpha_pattern}"
        )
        torch.testing.assert_close(got, delta, rtol=0.05 if cast else 1e-5, atol=tol, msg=lambda m, mod=module, why=why: f"{mod} ({why}): {m}")


# -- Megatron shards --------------------------------------------------------------------------------


@st.composite
def megatron_shards(draw: st.DrawFn) -> dict[str, Any]:
    """Megatron-Bridge rank shards of a random dense adapter, maybe damaged on purpose."""
    kv = draw(st.sampled_from((1, 2, 4)))
    heads = kv * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from((2, 4)))
    # TP sizes Megatron accepts for this geometry: heads and the fused QKV rows split evenly.
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0 and (kv * (heads // kv + 2) * head_dim) % t == 0]))
    pp = draw(st.sampled_from((1, 2)))
    cfg = config(
        hidden=4 * tp, heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=2 * tp * draw(st.integers(1, 2)),
        layers=pp * draw(st.integers(1, 2)),
    )  # fmt: skip
    r = tp * draw(st.integers(1, 2))  # column-parallel A is sharded on the rank axis
    lora_type = draw(st.sampled_from(("lora", "canonical_lora")))
    pad = draw(st.sampled_from((None, None, r + tp)))
    slot = draw(st.sampled_from((None, None, 0, 2)))
    peft = make_peft(cfg, r=r, seed=draw(st.integers(0, 2**31 - 1)), shared_a=lora_type == "lora")
    shards = build_shards(peft, cfg, tp=tp, pp=pp, lora_type=lora_type, max_rank=pad, slot=slot, prefix=draw(st.sampled_from(("", "module."))))
    damage = ("drop_shard", "drop_key", "shape", "dtype", "non_tensor", "nan", "pad_noise", "config", "extra_shard")
    mutation = draw(st.sampled_from(("none",) * 6 + damage))
    key = draw(st.sampled_from(sorted(shards)))
    names = sorted(k for k in shards[key] if k.endswith((".linear_in.weight", ".linear_out.weight")) and ".adapters." + str((slot or 0) + 1) not in k)
    victim = draw(st.sampled_from(names))
    t = shards[key][victim]
    if mutation == "drop_shard" and len(shards) > 1:
        del shards[key]
    elif mutation == "drop_key":
        del shards[key][victim]
    elif mutation == "shape":
        shards[key][victim] = draw(st.sampled_from((t[:-1], t[:, :-1], t.T.contiguous(), torch.cat([t, t]), t.unsqueeze(0))))
    elif mutation == "dtype":
        shards[key][victim] = t.to(draw(st.sampled_from((torch.float16, torch.bfloat16, torch.int32, torch.float64))))
    elif mutation == "non_tensor":
        shards[key][victim] = t.tolist()
    elif mutation == "nan":
        shards[key][victim] = t.clone()
        shards[key][victim].view(-1)[0] = float("nan")
    elif mutation == "pad_noise" and pad is not None:
        shards[key][victim] = t + 0.5  # padding rows/cols no longer zero
    elif mutation == "config":
        cfg = dict(cfg, num_key_value_heads=draw(st.sampled_from((1, 2, 4, 3))), num_attention_heads=draw(st.sampled_from((2, 4, 6))))
    elif mutation == "extra_shard":
        shards[(0, tp)] = shards[key]
    valid = draw(st.integers(0, 3)) > 0  # mostly valid options, so most examples reach the math
    rank = draw(st.sampled_from((None, r) if valid else (r - 1, r + 1, 0)))
    alpha = draw(st.sampled_from((16.0, 8)) if valid else st.sampled_from((0.0, -1.0, math.nan)))
    return {"shards": shards, "cfg": cfg, "tp": tp, "pp": pp, "r": r, "pad": pad, "slot": slot, "lora_type": lora_type,
            "rank": rank, "alpha": alpha, "mutation": mutation, "width": pad or r}  # fmt: skip


_MEG = re.compile(
    r"^(?:module\.)*decoder\.layers\.(?P<layer>\d+)\.(?P<path>.+?)\.(?P<container>adapter|adapters\.\d+)"
    r"(?:\.adapter_(?P<sub>[a-z]+))?\.linear_(?P<side>in|out)\.weight$"
)
_PATHS = {"self_attention.linear_qkv": "column", "self_attention.linear_proj": "row", "mlp.linear_fc1": "column", "mlp.linear_fc2": "row"}


def megatron_reference(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """ΔW per HF module as Megatron computes it from the given shards, discovering the grid and
    the adapters from the input itself (raises on anything Megatron could not run with)."""
    cfg, shards = case["cfg"], case["shards"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    if heads % kv:
        raise ValueError("heads not divisible by kv heads")
    hpg, G = heads // kv, heads // kv + 2
    keys = set(shards)
    if not all(isinstance(k, tuple) and len(k) == 2 for k in keys):
        raise ValueError("unexpected shard keys")
    pp, tp = 1 + max(k[0] for k in keys), 1 + max(k[1] for k in keys)
    if keys != {(s, t) for s in range(pp) for t in range(tp)}:
        raise ValueError("a shard inside the grid is missing")
    if cfg["num_hidden_layers"] % pp:
        raise ValueError("layers do not split evenly over the stages")
    per_stage = cfg["num_hidden_layers"] // pp
    container = "adapter" if case["slot"] is None else f"adapters.{case['slot']}"
    found: dict[tuple[int, int, str, str | None, str], dict[int, torch.Tensor]] = {}
    for (s, t), state in shards.items():
        for name, value in state.items():
            m = _MEG.match(name)
            if m is None or m["container"] != container:
                continue
            if m["path"] not in _PATHS:
                raise ValueError(f"unknown adapter path {m['path']}")
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != 2:
                raise ValueError(f"{name}: not a 2-D float tensor")
            found.setdefault((s, int(m["layer"]), m["path"], m["sub"], m["side"]), {})[t] = value.double()
    groups: dict[tuple[int, int, str, str | None], dict[str, tuple[torch.Tensor, list[torch.Tensor]]]] = {}
    for (s, local, path, sub, side), per_rank in found.items():
        if set(per_rank) != set(range(tp)):
            raise ValueError(f"{path}: a TP rank lacks linear_{side}")
        if ((s, local, path, sub, "in" if side == "out" else "out")) not in found:
            raise ValueError(f"{path}: linear_{side} without its pair")
        if local >= per_stage:
            raise ValueError("layer index beyond the stage")
        fused = sub is None and path in ("self_attention.linear_qkv", "mlp.linear_fc1")
        if fused != (case["lora_type"] == "lora") and path in ("self_attention.linear_qkv", "mlp.linear_fc1"):
            raise ValueError("adapter kind differs from lora_type")
        if side == "in":
            a_dim = 0 if _PATHS[path] == "column" else 1
            b_parts = [found[(s, local, path, sub, "out")][t] for t in range(tp)]
            groups.setdefault((s, local, path, sub), {})["f"] = (torch.cat([per_rank[t] for t in range(tp)], a_dim), b_parts)
    out: dict[str, torch.Tensor] = {}
    for (s, local, path, sub), parts in groups.items():
        a, bs = parts["f"]
        scale = case["alpha"] / (case["rank"] if case["rank"] is not None else a.shape[0])
        hf = f"model.layers.{s * per_stage + local}."
        if path == "self_attention.linear_qkv" and sub is None:
            fused = torch.cat(bs) @ a * scale
            if fused.shape[0] != kv * G * d:
                raise ValueError("fused qkv rows do not match the geometry")
            q = [(j // hpg) * G * d + (j % hpg) * d + x for j in range(heads) for x in range(d)]
            k = [g * G * d + hpg * d + x for g in range(kv) for x in range(d)]
            v = [g * G * d + (hpg + 1) * d + x for g in range(kv) for x in range(d)]
            for proj, rows in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[hf + f"self_attn.{proj}"] = fused[rows]
        elif path == "mlp.linear_fc1" and sub is None:
            halves = [torch.chunk(b @ a * scale, 2, 0) for b in bs]
            if any(len(h) != 2 or h[0].shape != h[1].shape for h in halves):
                raise ValueError("odd fc1 rows")
            out[hf + "mlp.gate_proj"], out[hf + "mlp.up_proj"] = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        else:
            leaf = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                    None: "self_attn.o_proj" if path == "self_attention.linear_proj" else "mlp.down_proj"}.get(sub)  # fmt: skip
            if leaf is None:
                raise ValueError(f"unknown sub-adapter {sub}")
            out[hf + leaf] = torch.cat(bs) @ a * scale
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    want_shapes = {"q_proj": (heads * d, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h), "o_proj": (h, heads * d),
                   "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip
    for module, delta in out.items():
        if tuple(delta.shape) != want_shapes[module.rsplit(".", 1)[-1]]:
            raise ValueError(f"{module}: ΔW {tuple(delta.shape)} does not fit the base model")
    if not out:
        raise ValueError("no adapter at all")
    return out


def check_megatron(case: dict[str, Any]) -> None:
    from lorasync.exporters.megatron import export

    adapter, error = outcome(
        lambda: export(
            case["shards"], base_config=case["cfg"], alpha=case["alpha"], rank=case["rank"], lora_type=case["lora_type"], slot=case["slot"]
        ),
        "megatron",
    )
    harmless = case["mutation"] == "none" or (case["mutation"] in ("nan", "pad_noise") and case["pad"] is None)
    clean = harmless and case["alpha"] in (16.0, 8) and case["rank"] in (None, case["r"])
    if clean:
        assert error is None, f"well-formed shards were refused: {error!r}"
    if error is not None:
        return
    try:
        want = megatron_reference(case)
    except (KeyError, ValueError, RuntimeError, IndexError, ZeroDivisionError) as exc:
        raise AssertionError(f"the exporter accepted shards Megatron could not compute with ({case['mutation']}): {exc}") from exc
    assert set(adapter.modules) == set(want), f"exported {sorted(adapter.modules)}, expected {sorted(want)}"
    for module, delta in want.items():
        same_delta(adapter.delta(module, torch.float64), delta, exact=True, what=module)
