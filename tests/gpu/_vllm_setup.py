"""What the real-vLLM GPU tests share: random-weight Qwen3 models built locally, PEFT adapters on
them, the HF+PEFT numerical reference, and the comparison every test applies.

On the H200 the models are of the Qwen3-0.6B shape in bf16 (vLLM 0.26 from
scripts/gpu-vllm-bundle.sh, in this python). ``LORASYNC_GPU_REHEARSAL=1`` runs the same tests on
a CPU vLLM (the 0.32 CPU build's python runs pytest) with a tiny fp32 Qwen3, so the code paths
are exercised before device time is spent; MoE serving needs the GPU and skips there.

The comparison (:func:`compare`): vLLM's greedy tokens and their log-probs, and the log-probs of
every prompt token (``prompt_logprobs``), against HF+PEFT run teacher-forced on vLLM's own
sequence. Tolerance is calibrated per test: PEFT in the test dtype is compared with PEFT in fp32
(the same weights), and vLLM may deviate from fp32 by ``TOL_FACTOR`` times that (at least
``TOL_FLOOR``). A test only counts if the adapter moves the same log-probs by ``SENSITIVITY``
times the tolerance: a wrong, missing or stale adapter then fails.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REHEARSAL = os.environ.get("LORASYNC_GPU_REHEARSAL") == "1"
DEVICE = "cpu" if REHEARSAL else "cuda"
DTYPE = torch.float32 if REHEARSAL else torch.bfloat16
DTYPE_NAME = "float32" if REHEARSAL else "bfloat16"
TOL_FACTOR = 4.0
TOL_FLOOR = 0.002 if REHEARSAL else 0.05
SENSITIVITY = 5.0
RESULTS = Path(os.environ.get("LORASYNC_GPU_RESULTS", os.environ.get("OUT", "/tmp"))) / "gpu_vllm_tests.jsonl"

# Qwen3-0.6B (hidden 1024, 28 layers, 16 heads / 8 KV heads of 128, MLP 3072, vocab 151936, tied
# embeddings) and Qwen3-8B; "tiny" is for the CPU rehearsal.
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=True),
    # The 8B shape's 36 layers (504 factors at all-linear) at tiny widths: the host-side work of a
    # publish and of the worker's add, which scales with the tensor count, rehearsed on the CPU.
    "tiny36": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=36, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=False),
}  # fmt: skip
TEST_SHAPE = "tiny" if REHEARSAL else "0.6b"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def record(test: str, **values: Any) -> None:
    """Append one test's measurements to ``$OUT/gpu_vllm_tests.jsonl`` (kept if a later step dies)."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps({"test": test, "time": time.time(), **values}, default=str) + "\n")


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``vocab`` ids (``w<i>``), built locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    words.update({f"w{i}": i for i in range(4, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def qwen3_config(shape: str, **overrides: Any) -> Any:
    from transformers import Qwen3Config

    values = dict(SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    values.update(overrides)
    return Qwen3Config(**values)


def build_model_dir(path: Path, config: Any, *, seed: int = 0, device: str = DEVICE, dtype: torch.dtype = DTYPE) -> Path:
    """Random weights (HF's own init, drawn on ``device``), saved in ``dtype`` with a tokenizer.

    The EOS logit is pushed far down so every generation has its requested length.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        if not config.tie_word_embeddings:
            head[2].fill_(-0.5)  # </s>: never the argmax
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer(config.vocab_size).save_pretrained(str(path))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def load_model(path: Path, *, dtype: torch.dtype = DTYPE, device: str = DEVICE) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


def randomize_lora(model: Any, *, seed: int, std: float) -> None:
    """A "trained" adapter: every lora_A / lora_B weight random (B non-zero)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name or "lora_" in name.rsplit(".", 1)[-1]:
                param.copy_((torch.randn(param.shape, generator=gen) * std).to(param.dtype))


def peft_model(base: Any, *, seed: int, r: int = 16, alpha: float = 32.0, std: float = 0.03, targets: Sequence[str] = TARGETS, **kw: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **kw)
    device = next(base.parameters()).device
    model = get_peft_model(base, cfg).to(device)  # PEFT makes the new factors on the host
    randomize_lora(model, seed=seed, std=std)
    return model.eval()


def gpu_adapter(model: Any) -> Any:
    """The trainer's adapter as its own live tensors, wherever they are (the GPU here): no copy.

    ``fsdp.export`` moves off-CPU tensors to the host (one copy, by design of the exporter), so
    a GPU trainer that publishes ``export(model)`` hands the engine host tensors and never
    reaches the CUDA IPC path. This is what a device-keeping export would return: export's
    keys and config, the parameters themselves.
    """
    from lorasync import Adapter
    from lorasync.adapter._keys import normalize_trainer_key
    from lorasync.exporters.fsdp import export

    exported = export(model)
    live = {}
    for name, param in model.named_parameters():
        key = normalize_trainer_key(name, "default")
        if key in exported.tensors:
            live[key] = param.detach()
    assert live.keys() == exported.tensors.keys(), sorted(set(exported.tensors) ^ set(live))[:4]
    return Adapter(live, exported.config)


def fp32_twin(model: Any) -> Any:
    """The same weights (the test dtype's values) in float32: the reference PEFT is compared to."""
    return copy.deepcopy(model).float()


@torch.no_grad()
def teacher_forced(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """Log-probabilities (float32, [len(ids), vocab]) after each prefix of ``ids``."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([list(ids)], device=device)).logits[0].float()
    return torch.log_softmax(logits, -1)


@torch.no_grad()
def greedy(model: Any, prompt: Sequence[int], n: int) -> list[int]:
    device = next(model.parameters()).device
    out = model.generate(torch.tensor([list(prompt)], device=device), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@dataclass
class Served:
    """One vLLM completion: greedy tokens, their log-probs, and each prompt token's log-prob."""

    tokens: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float]  # for prompt[1:]


def parse_completion(choice: Mapping[str, Any], prompt: Sequence[int]) -> Served:
    """Read an OpenAI completions choice with ``logprobs`` and vLLM's ``prompt_logprobs``."""
    lp = choice["logprobs"]
    tokens = [int(t.split(":", 1)[1]) if isinstance(t, str) and t.startswith("token_id:") else t for t in lp["tokens"]]
    plps = []
    for pos, entry in enumerate(choice["prompt_logprobs"][1:], start=1):
        plps.append(float(entry[str(prompt[pos])]["logprob"]))
    return Served(tokens=[int(t) for t in tokens], logprobs=[float(x) for x in lp["token_logprobs"]], prompt_logprobs=plps)


def completion_body(model: str, prompt: Sequence[int], n: int) -> dict[str, Any]:
    return {
        "model": model, "prompt": list(prompt), "max_tokens": n, "temperature": 0.0, "logprobs": 1,
        "prompt_logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True,
    }  # fmt: skip


@dataclass
class Verdict:
    err_engine: float
    err_peft: float
    tol: float
    effect: float
    tokens_equal: bool
    near_tie_at: int | None
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _values(lp: torch.Tensor, seq: Sequence[int]) -> torch.Tensor:
    """The log-prob of each next token of ``seq`` (positions 1..), from teacher-forced ``lp``."""
    idx = torch.tensor(list(seq[1:]), device=lp.device)
    return lp[:-1].gather(1, idx[:, None])[:, 0]


def compare(served: Served, prompt: Sequence[int], model: Any, model32: Any, base32: Any | None, expected_greedy: list[int]) -> Verdict:
    """Check vLLM's answer against HF+PEFT (see the module docstring); returns the measures."""
    seq = list(prompt) + served.tokens
    ref = teacher_forced(model32, seq)
    own = teacher_forced(model, seq)
    engine = torch.tensor(served.prompt_logprobs + served.logprobs, device=ref.device)
    ref_v, own_v = _values(ref, seq), _values(own, seq)
    err_engine = float((engine - ref_v).abs().max())
    err_peft = float((own_v - ref_v).abs().max())
    tol = max(TOL_FLOOR, TOL_FACTOR * err_peft)
    effect = float("inf")
    if base32 is not None:
        effect = float((_values(teacher_forced(base32, seq), seq) - ref_v).abs().max())
    # Greedy: each vLLM token is the reference's argmax up to a near tie (within 2 tol).
    near_tie_at = None
    problems = []
    start = len(prompt) - 1
    for i, tok in enumerate(served.tokens):
        row = ref[start + i]
        if float(row.max() - row[tok]) > 2 * tol:
            problems.append(f"token {i}: vLLM chose {tok}, {float(row.max() - row[tok]):.3f} nats below the reference's argmax {int(row.argmax())}")
        if tok != int(row.argmax()) and near_tie_at is None:
            near_tie_at = i
    equal = served.tokens == expected_greedy
    if not equal:
        first = next((i for i, (a, b) in enumerate(zip(served.tokens, expected_greedy)) if a != b), min(len(served.tokens), len(expected_greedy)))
        if first < min(len(served.tokens), len(expected_greedy)):
            row = ref[start + first]
            gap = float((row[expected_greedy[first]] - row[served.tokens[first]]).abs())
            if gap > 2 * tol:
                problems.append(f"greedy tokens differ from PEFT's at {first} with a {gap:.3f}-nat gap (no near tie): {served.tokens} vs {expected_greedy}")
            near_tie_at = first if near_tie_at is None else min(near_tie_at, first)
        else:
            problems.append(f"vLLM gave {len(served.tokens)} tokens, PEFT {len(expected_greedy)}")
    if err_engine > tol:
        problems.append(f"vLLM off the fp32 reference by {err_engine:.4f} nats > tolerance {tol:.4f} (PEFT {DTYPE_NAME}: {err_peft:.4f})")
    return Verdict(err_engine, err_peft, tol, effect, equal, near_tie_at, problems)


def check(verdict: Verdict, test: str, **extra: Any) -> None:
    """Record the measures, then assert exactness and that the test could have failed."""
    record(test, **verdict.as_dict(), **extra)
    assert not verdict.problems, f"{test}: " + "; ".join(verdict.problems)
    assert verdict.effect >= SENSITIVITY * verdict.tol, f"{test}: the adapter moves log-probs by only {verdict.effect:.4f}: the check could not tell it from the base"


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(4, vocab, (n,), generator=gen)]
