"""The benchmark of record: trainer weights ready -> first completion served by them, on a real
vLLM CPU server and a non-toy model, lorasync against what its users' frameworks do today.

Three ways to get a step's weights served, interleaved round by round (so the noise of a busy
box hits each alike), each followed by one completion on the new weights whose token is checked
against the trainer's own greedy token:

* ``peer`` — TRL AsyncGRPO / OpenPipe ART / SkyRL: ``peft_model.save_pretrained(dir)``, raw
  ``POST /v1/load_lora_adapter`` of a new name, ``POST /v1/unload_lora_adapter`` of step-2, the
  directory in the system's temp folder (``tempfile``), where those frameworks save;
* ``peer-tmpfs`` — the same, saved on tmpfs (``--root``, default ``/dev/shm``): the peer given
  the file system lorasync uses by default, so neither way is ahead by where it writes;
* ``lorasync`` — the documented loop ``pub.publish(fsdp.export(peft_model), version=step)``
  (default transport, keep=2, the store in its default kind of place: tmpfs, ``--root``);
* ``unload-then-load`` — the engine's bare load time: ``Adapter.save`` on tmpfs, unload and load
  of one fixed name (no versioning, a window with nothing served).

Models are built locally (``lorasync.testing.make_tiny_model`` with a bigger config; nothing is
downloaded): ``llama-10mb`` (hidden 1024, 8 layers, r16 all-linear fp32: a 9.6 MB adapter, the
model of issue 16) and, with ``--shape qwen3-0.6b``, a randomly initialised Qwen3-0.6B-shaped
model (28 layers, hidden 1024, tiny vocabulary: a 40 MB adapter).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._harness import Goal, Options, Table, fmt_bytes, fmt_ms, progress, say

__all__ = ["MODELS", "run_peer"]

PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7], [64, 65, 66, 67, 68, 69], [11, 22, 33], [400, 401, 402, 403])
MODES = ("peer", "peer-tmpfs", "lorasync", "unload-then-load")
#: name -> (config overrides for make_tiny_model, architecture)
MODELS: dict[str, tuple[dict[str, Any], str]] = {
    "llama-10mb": (dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64), "llama"),
    "qwen3-0.6b": (dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128), "qwen3"),
}
SERVED_BASE = "peer-base"


def run_peer(opts: Options, tmp: Path, python: Path, repeats: int, warmup: int) -> dict[str, Any]:
    """Every requested model: tables, goals, notes and raw samples (see module docstring)."""
    names = ["llama-10mb"] + [n for n in MODELS if n != "llama-10mb" and n in opts.shapes]
    out: dict[str, Any] = {"tables": [], "goals": [], "notes": [], "data": {}}
    for name in names:
        data = _one_model(name, tmp / name, _tmpfs(opts, tmp), python, repeats, warmup, opts.progress)
        out["data"][name] = data
        med = {m: statistics.median(data["modes"][m]["total"]) for m in MODES}
        rows = []
        for mode in MODES:
            s = data["modes"][mode]
            rows.append([
                mode, fmt_ms(statistics.median(s["publish"])), fmt_ms(statistics.median(s["first"])), f"**{fmt_ms(med[mode])}**",
                f"{med[mode] / med['peer']:.2f}", f"{med[mode] / med['unload-then-load']:.2f}", f"{sum(s['served_new'])}/{len(s['served_new'])}",
            ])
        out["tables"].append(Table(
            f"{name}: trainer weights → first completion served by them (vLLM 0.32 CPU, r16 all-linear fp32 adapter {fmt_bytes(data['adapter_bytes'])}; "
            f"median of {repeats} interleaved rounds after {warmup} warm-up; ms). lorasync transport: {', '.join(sorted(set(data['transports'])))}",
            ["way", "publish call", "first completion", "total", "x peer", "x bare load", "first token = trainer's"],
            rows,
        ))
        out["goals"].append(Goal(f"{name}: lorasync / peer (save_pretrained + load + unload)", med["lorasync"] / med["peer"], 0.5))
        out["goals"].append(Goal(f"{name}: lorasync / bare unload-then-load", med["lorasync"] / med["unload-then-load"], 1.1))
        stages = data["modes"]["lorasync"]["stages"]
        keys = sorted({k for st in stages for k in st})
        out["tables"].append(Table(
            f"{name}: inside lorasync's publish call (PublishReport timings, median ms)",
            ["stage", *keys],
            [["lorasync", *[fmt_ms(statistics.median([st.get(k, 0.0) for st in stages])) for k in keys]]],
        ))
        for mode in MODES:
            if not all(data["modes"][mode]["served_new"]):
                out["notes"].append(f"{name} {mode}: some first completions did not match the trainer's token (see JSON).")
        out["notes"].append(f"{name}: server start-up {data['startup_s']:.0f} s (not counted); prompt {data['prompt']}.")
    return out


def _build(name: str, directory: Path) -> None:
    from lorasync.testing import make_tiny_model

    overrides, arch = MODELS[name]
    if arch == "llama":
        make_tiny_model(directory, **overrides)
        return
    # Qwen3 shape: the same tiny tokenizer and peaked LM head, Qwen3's architecture (q/k norms).
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lorasync.testing._tiny import _tokenizer, tiny_config

    base = tiny_config(**overrides).to_dict()
    for key in ("architectures", "model_type", "transformers_version", "mlp_bias", "pretraining_tp"):
        base.pop(key, None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**base)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
        model.lm_head.weight[:4].zero_()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    _tokenizer().save_pretrained(str(directory))


def _trainers(base_dir: Path, seeds: tuple[int, ...]) -> list[Any]:
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_peft_model

    return [make_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), r=16, alpha=32, seed=seed, std=0.02) for seed in seeds]


def _next_token(model: Any, prompt: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([prompt])).logits[0, -1].argmax())


def _tmpfs(opts: Options, tmp: Path) -> Path:
    """Where lorasync's store, the bare load's files and ``peer-tmpfs`` write: ``--root``, else
    ``/dev/shm`` (lorasync's default root is there), else the benchmark's temp folder."""
    parent = opts.root or (Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp)
    parent.mkdir(parents=True, exist_ok=True)
    return parent


def _one_model(name: str, tmp: Path, parent: Path, python: Path, repeats: int, warmup: int, show: bool) -> dict[str, Any]:
    import tempfile

    import httpx

    from lorasync import Adapter, Publisher
    from lorasync.engines import connect
    from lorasync.exporters.fsdp import export
    from lorasync.testing.vllm_server import VLLMServer

    base_dir = tmp / "base"
    _build(name, base_dir)
    trainers = _trainers(base_dir, seeds=(11, 12))
    prompt = list(PROMPTS[0])
    for candidate in PROMPTS:
        refs = [_next_token(t, list(candidate)) for t in trainers]
        if len(set(refs)) == len(refs):
            prompt = list(candidate)
            break
    refs = [_next_token(t, prompt) for t in trainers]
    adapter_bytes = export(trainers[0]).nbytes
    samples = {m: {"publish": [], "first": [], "total": [], "served_new": [], "stages": []} for m in MODES}
    transports: list[str] = []
    say(f"starting a vLLM CPU server on the {name} model for the benchmark of record (a minute or more; log {tmp / 'vllm.log'})", show=show)
    t0 = time.perf_counter()
    with VLLMServer(
        base_dir,
        python=python,
        served_model_name=SERVED_BASE,
        max_lora_rank=16,
        max_loras=6,
        max_cpu_loras=8,
        log_path=tmp / "vllm.log",
        startup_timeout=600.0,
        extra_args=("--worker-extension-cls", "lorasync.engines.vllm_worker.LoraSyncWorkerExtension"),
    ) as server:
        startup = time.perf_counter() - t0
        say(f"vLLM server up after {startup:.0f} s; timing its rounds", show=show)
        engine = connect("vllm", server.url, timeout=300)
        raw = httpx.Client(base_url=server.url, timeout=300)
        engine.generate(prompt, model=SERVED_BASE, max_tokens=1)  # the first request compiles
        fast = Path(tempfile.mkdtemp(prefix="lorasync-bench-peer-", dir=parent))
        pub = Publisher([engine], name="bench-peer", root=fast / "store", keep=2)
        peer_loaded: list[str] = []
        naive_loaded = False

        def check(response: httpx.Response) -> None:
            if response.status_code != 200:
                raise RuntimeError(f"{response.request.url.path}: {response.status_code} {response.text[:200]}")

        def step(mode: str, i: int) -> tuple[str, dict[str, float]]:
            nonlocal naive_loaded
            model = trainers[i % 2]
            if mode.startswith("peer"):
                path = (tmp if mode == "peer" else fast) / mode / f"step{i}"
                model.save_pretrained(str(path))
                check(raw.post("/v1/load_lora_adapter", json={"lora_name": f"{mode}-{i}", "lora_path": str(path)}))
                peer_loaded.append(f"{mode}-{i}")
                if len(peer_loaded) > 4:  # two steps of each peer way
                    old = peer_loaded.pop(0)
                    check(raw.post("/v1/unload_lora_adapter", json={"lora_name": old}))
                return f"{mode}-{i}", {}
            if mode == "lorasync":
                report = pub.publish(export(model), version=i + 1).raise_for_errors()
                transports.append(report.results[0].transport or "?")
                return report.served_name, {**{k: v for k, v in report.timings.items() if k != "total"}, **report.results[0].timings}
            path = Adapter.save(export(model), fast / "naive" / f"v{i}")
            if naive_loaded:
                engine.unload_adapter("naive")
            engine.load_adapter("naive", path)
            naive_loaded = True
            return "naive", {}

        try:
            for i in progress(range(warmup + repeats), desc=f"vLLM {name} rounds", show=show):
                # Rotate who goes first so no way always runs right after the same other one.
                order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]
                for mode in order:
                    start = time.perf_counter()
                    served, stages = step(mode, i)
                    published = time.perf_counter()
                    completion = engine.generate(prompt, model=served, max_tokens=1, logprobs=None)
                    done = time.perf_counter()
                    if i >= warmup:
                        s = samples[mode]
                        s["publish"].append(published - start)
                        s["first"].append(done - published)
                        s["total"].append(done - start)
                        s["served_new"].append(int(completion.token_ids[0]) == refs[i % 2])
                        s["stages"].append(stages)
                shutil.rmtree(tmp / "peer" / f"step{i - 3}", ignore_errors=True)
                shutil.rmtree(fast / "peer-tmpfs" / f"step{i - 3}", ignore_errors=True)
                shutil.rmtree(fast / "naive" / f"v{i - 1}", ignore_errors=True)
        finally:
            pub.close()
            shutil.rmtree(fast, ignore_errors=True)
            raw.close()
            engine.close()
    return {"modes": samples, "transports": transports, "adapter_bytes": adapter_bytes, "startup_s": startup, "prompt": prompt}


def plot(ax: Any, data: dict[str, Any]) -> None:
    """Stacked bars (publish call + first completion) per model and way, ratio to the peer."""
    labels, pub, first, ratios = [], [], [], []
    for name, d in data.items():
        peer = statistics.median(d["modes"]["peer"]["total"])
        for mode in MODES:
            s = d["modes"][mode]
            labels.append(f"{name}\n{mode}")
            pub.append(statistics.median(s["publish"]) * 1e3)
            first.append(statistics.median(s["first"]) * 1e3)
            ratios.append(statistics.median(s["total"]) / peer)
    ax.barh(labels, pub, color="#4a90d9", label="publish call")
    ax.barh(labels, first, left=pub, color="#f0a040", label="first completion")
    for y, (p, f, r) in enumerate(zip(pub, first, ratios)):
        ax.text(p + f, y, f"  {r:.2f}x peer", va="center", fontsize=8)
    ax.set_xlabel("ms (median)")
    ax.set_title("Trainer weights → first completion (real vLLM CPU)")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
