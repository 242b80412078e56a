"""Real vLLM on the GPU: trainer weights → first completion served by them, and merged full-weight
sync against adapter sync (the ``engines`` section of ``benchmarks/gpu_bench.py``).

Per model shape (random bf16 weights drawn on the GPU: Qwen3-0.6B, Qwen3-8B) and LoRA rank (r16,
r64, all linear modules), one vLLM OpenAI server on the GPU and a PEFT trainer on the same GPU.
Each round runs every way once, in a rotated order (interleaved: the machine's noise hits each
alike); each way ends with one completion (1 token) on the weights just synced, whose token is
checked against the trainer's own greedy token:

* ``lorasync`` — ``pub.publish(fsdp.export(model), version=step)``: the export keeps the GPU
  tensors where they are, the default transport picks CUDA IPC into the server's GPU, keep=2; ``lorasync-disk`` the same with
  ``transport="disk"`` named; ``lorasync-ipc`` with ``transport="ipc"``: CUDA IPC into the worker;
* ``peer`` — what TRL / ART / SkyRL do: ``save_pretrained`` + ``POST /v1/load_lora_adapter`` of a
  new name + unload of step-2;
* ``bare`` — vLLM's own cost: ``Adapter.save``, unload and load of one fixed name;
* ``floor`` — no sync: the same completion on an adapter already loaded.

Merged: ``fold`` = lorasync's ``transport="merged"`` (the adapted linear weights folded into the
pristine base and pushed); ``every-param`` = every parameter of the merged model pushed through
``update_weights`` in 1 GiB buckets, what TRL's GRPOTrainer does each step. Bytes and time against
the adapter's.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["GOALS", "run_shape"]

WAYS = ("lorasync", "lorasync-disk", "lorasync-ipc", "peer", "bare", "floor")
SERVED_BASE = "base"
#: (name, what it measures, limit): each is met when the measured ratio is <= limit.
GOALS = (
    ("ipc_vs_peer_8b", "CUDA IPC publish → first completion / peer, Qwen3-8B shape", 0.5),
    ("overhead_vs_peer", "lorasync's overhead above the no-sync floor / the peer's", 0.5),
    ("adapter_vs_merged_bytes", "adapter sync bytes / merged full-weight sync bytes (≥ 50× fewer)", 1 / 50),
    ("merged_gpu_s", "merged full-weight sync from GPU tensors → first completion, seconds (issue 34: ≤ 2 s on the 8B shape)", 2.0),
)


def _tests_helpers() -> Any:
    """The GPU tests' model builders (one definition of the shapes), importable from here."""
    root = Path(__file__).resolve().parents[1] / "tests" / "gpu"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import _vllm_setup

    return _vllm_setup


def run_shape(shape: str, ranks: tuple[int, ...], tmp: Path, *, repeats: int, warmup: int, merged_reps: int, log_dir: Path, save: Any, profile: bool = False) -> dict[str, Any]:
    """Every way for one shape and each rank; ``save(partial)`` is called after each part.
    ``profile``: warm-up rounds run under cProfile, written to ``log_dir``: the trainer's publishes
    of every warm-up round after the first (``client-publish-r*.txt``) and the worker's adds of the
    first rank's warm-up rounds (``worker-adds.<pid>.txt``); the measured rounds are not profiled."""
    import httpx

    from lorasync.engines import connect
    from lorasync.engines.vllm import WORKER_EXTENSION
    from lorasync.testing.vllm_server import VLLMServer

    h = _tests_helpers()
    out: dict[str, Any] = {"shape": shape, "ranks": {}}
    t0 = time.perf_counter()
    base_dir = h.build_model_dir(tmp / f"{shape}-base", h.qwen3_config(shape), device=h.DEVICE, dtype=h.DTYPE)
    out["build_s"] = time.perf_counter() - t0
    base_model = h.load_model(base_dir)
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in base_model.parameters())
    vocab = base_model.config.vocab_size
    prompt = h.prompt_ids(1, 16, vocab)
    gpu = [] if h.REHEARSAL else ["--gpu-memory-utilization", "0.4" if shape == "8b" else "0.25"]
    t0 = time.perf_counter()
    with VLLMServer(
        base_dir, python=sys.executable, served_model_name=SERVED_BASE, max_lora_rank=max(ranks), max_loras=4,
        max_cpu_loras=16, log_path=log_dir / f"vllm-bench-{shape}.log", startup_timeout=900,
        extra_args=("--dtype", h.DTYPE_NAME, "--max-model-len", "2048", "--worker-extension-cls", WORKER_EXTENSION, *gpu),
        # the first rank's warm-up adds: two lorasync ways load tensors per round
        env={"LORASYNC_PROFILE_ADDS": f"{2 * warmup}:{log_dir / 'worker-adds'}"} if profile and warmup else None,
    ) as server:  # fmt: skip
        out["startup_s"] = time.perf_counter() - t0
        engine = connect("vllm", server.url, timeout=600)
        raw = httpx.Client(base_url=server.url, timeout=600)
        engine.generate(prompt, model=SERVED_BASE, max_tokens=1)
        try:
            out["round_trips"] = _round_trips(raw)
            for r in ranks:
                out["ranks"][r] = _one_rank(h, r, base_model, engine, raw, tmp / f"r{r}", prompt, repeats, warmup, log_dir if profile else None)
                save(out)
            if merged_reps:
                out["merged"] = _merged(h, base_model, base_dir, engine, tmp / "merged", prompt, merged_reps)
                save(out)
        finally:
            raw.close()
            engine.close()
    del base_model
    torch.cuda.empty_cache() if h.DEVICE == "cuda" else None
    return out


def _one_rank(h: Any, r: int, base_model: Any, engine: Any, raw: Any, tmp: Path, prompt: list[int], repeats: int, warmup: int, profile_dir: Path | None = None) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    from lorasync import Adapter, Publisher
    from lorasync.exporters.fsdp import export

    model = h.peft_model(base_model, seed=100 + r, r=r, alpha=2 * r)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    snapshots = [[p.detach().clone() for p in lora], [(p.detach() * -1.0) for p in lora]]  # two "steps" of weights

    def load_step(i: int) -> int:
        with torch.no_grad():
            for p, v in zip(lora, snapshots[i % 2]):
                p.copy_(v)
        logits = model(torch.tensor([prompt], device=h.DEVICE)).logits[0, -1]
        return int(logits.argmax())

    refs = [load_step(0), load_step(1)]
    live = h.gpu_adapter(model)  # the parameters themselves: each round's values, read at publish
    adapter_bytes = live.nbytes
    pubs = {
        "lorasync": Publisher([engine], name=f"ls-r{r}", root=tmp / "s0", keep=2),
        "lorasync-disk": Publisher([engine], name=f"lsd-r{r}", root=tmp / "s1", keep=2, transport="disk"),
        "lorasync-ipc": Publisher([engine], name=f"lsi-r{r}", root=tmp / "s2", keep=2, transport="ipc"),
    }
    samples: dict[str, dict[str, list]] = {w: {"sync": [], "first": [], "total": [], "served_new": [], "stages": []} for w in WAYS}
    transports: dict[str, set[str]] = {w: set() for w in pubs}
    peer_loaded: list[str] = []
    state = {"bare": False, "floor": None}
    client_profile = cProfile.Profile() if profile_dir is not None else None

    def ok(response: Any) -> None:
        if response.status_code != 200:
            raise RuntimeError(f"{response.request.url.path}: {response.status_code} {response.text[:300]}")

    def sync(way: str, i: int) -> tuple[str, dict[str, float]]:
        if way in pubs:
            # The default way is what the README shows a trainer: publish(export(model)); export
            # keeps GPU tensors on the GPU (the live parameters, no copy), like ``live`` below.
            t0 = time.perf_counter()
            adapter = export(model) if way == "lorasync" else live
            exported = {"export": time.perf_counter() - t0} if way == "lorasync" else {}
            profiled = client_profile is not None and 0 < i < warmup and way != "lorasync-disk"
            if profiled:  # the publish runs on the publisher's loop thread: profile that thread
                pubs[way]._loop.run(_call(client_profile.enable))
            try:
                report = pubs[way].publish(adapter, version=i + 1).raise_for_errors()
            finally:
                if profiled:
                    pubs[way]._loop.run(_call(client_profile.disable))
            transports[way].add(report.results[0].transport or "?")
            return report.served_name, {**exported, **{k: v for k, v in report.timings.items() if k != "total"}, **report.results[0].timings}
        if way == "peer":
            path = tmp / "peer" / f"step{i}"
            model.save_pretrained(str(path))
            ok(raw.post("/v1/load_lora_adapter", json={"lora_name": f"peer-r{r}-{i}", "lora_path": str(path)}))
            peer_loaded.append(f"peer-r{r}-{i}")
            if len(peer_loaded) > 2:
                ok(raw.post("/v1/unload_lora_adapter", json={"lora_name": peer_loaded.pop(0)}))
            return f"peer-r{r}-{i}", {}
        if way == "bare":
            path = Adapter.save(export(model), tmp / "bare" / f"v{i}")
            if state["bare"]:
                engine.unload_adapter(f"bare-r{r}")
            engine.load_adapter(f"bare-r{r}", path)
            state["bare"] = True
            return f"bare-r{r}", {}
        # floor: the adapter of this step, loaded before the clock started
        return state["floor"], {}

    try:
        for i in range(warmup + repeats):
            expected = refs[i % 2]
            load_step(i)
            floor_path = Adapter.save(export(model), tmp / "floor" / f"v{i}")
            engine.load_adapter(f"floor-r{r}-{i}", floor_path)
            state["floor"] = f"floor-r{r}-{i}"
            order = WAYS[i % len(WAYS) :] + WAYS[: i % len(WAYS)]
            for way in order:
                if h.DEVICE == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                served, stages = sync(way, i)
                synced = time.perf_counter()
                completion = engine.generate(prompt, model=served, max_tokens=1, logprobs=None)
                done = time.perf_counter()
                if way in pubs and i >= warmup:
                    stages.update(_worker_times(raw, served))  # after the clock: the engine's own account
                if i >= warmup:
                    s = samples[way]
                    s["sync"].append(synced - start)
                    s["first"].append(done - synced)
                    s["total"].append(done - start)
                    s["served_new"].append(int(completion.token_ids[0]) == expected)
                    s["stages"].append(stages)
            engine.unload_adapter(f"floor-r{r}-{i}")
            if client_profile is not None and i == warmup - 1 and warmup > 1:
                text = io.StringIO()
                for order in ("cumulative", "tottime"):
                    pstats.Stats(client_profile, stream=text).sort_stats(order).print_stats(45)
                (profile_dir / f"client-publish-r{r}.txt").write_text(text.getvalue())
            for sub, keep in (("peer", 3), ("bare", 1), ("floor", 1)):
                shutil.rmtree(tmp / sub / (f"step{i - keep}" if sub == "peer" else f"v{i - keep}"), ignore_errors=True)
    finally:
        for pub in pubs.values():
            pub.close()
        for name in peer_loaded:
            raw.post("/v1/unload_lora_adapter", json={"lora_name": name})
        if state["bare"]:
            engine.unload_adapter(f"bare-r{r}")
    model.unload() if hasattr(model, "unload") else None
    med = {w: statistics.median(samples[w]["total"]) for w in WAYS}
    return {"adapter_bytes": adapter_bytes, "samples": samples, "median_total_s": med, "transports": {k: sorted(v) for k, v in transports.items()}}


async def _call(fn: Any) -> None:
    fn()


def _round_trips(raw: Any, n: int = 15) -> dict[str, float]:
    """Median ms of the engine's own request paths with nothing to do, back to back and after
    100 ms idle: the API server alone (``GET /v1/models``), and the API server, the engine core
    and the worker (``/collective_rpc`` of the worker extension's ping). A load's time above its
    worker stages is one such trip, so these say how much of the sync call is the path itself."""
    routes = {
        "models": lambda: raw.get("/v1/models"),
        "worker_rpc": lambda: raw.post("/collective_rpc", json={"method": "lorasync_ping", "args": []}),
    }
    out: dict[str, float] = {}
    for name, call in routes.items():
        for idle in (0.0, 0.1):
            times = []
            for _ in range(n):
                time.sleep(idle)
                t0 = time.perf_counter()
                call().raise_for_status()
                times.append(time.perf_counter() - t0)
            out[f"{name}{'_after_idle' if idle else ''}"] = statistics.median(times[2:]) * 1e3
    return out


def _worker_times(raw: Any, served: str) -> dict[str, float]:
    """Where the engine spent the load of ``served`` (lorasync's worker: the stage file read and the
    tensors mapped, then vLLM's ``LoRAModel`` built, and the whole add around them), seconds;
    nothing for a load from files."""
    answer = raw.post("/collective_rpc", json={"method": "lorasync_load_timings", "args": []})
    results = answer.json().get("results") if answer.status_code == 200 else None
    mine = [t for t in results[0] if t.get("name") == served] if isinstance(results, list) and results and isinstance(results[0], list) else []
    if not mine:
        return {}
    out = {"worker_stage": mine[-1]["stage_s"], "worker_build": mine[-1]["build_s"]}
    if mine[-1].get("add_s") is not None:  # the worker's whole add: build, registration, slot write
        out["worker_add"] = mine[-1]["add_s"]
    return out


def _next_adapter(model: Any) -> Any:
    """The trainer's next step, as far as the merged rows care: every ``lora_B`` moved a little,
    then exported (a distinct adapter, so no publish is an unchanged no-op)."""
    from lorasync.exporters.fsdp import export

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(1e-3)
    return export(model)


def _merged(h: Any, base_model: Any, base_dir: Path, engine: Any, tmp: Path, prompt: list[int], reps: int) -> dict[str, Any]:
    """lorasync's merged fold vs pushing every parameter (TRL's per-step full sync), r16."""
    from lorasync import BaseWeights, Publisher
    from lorasync.exporters.fsdp import export

    model = h.peft_model(base_model, seed=7, r=16, alpha=32)
    adapter = export(model)
    out: dict[str, Any] = {"adapter_bytes": adapter.nbytes, "fold": [], "fold_gpu_base": [], "every_param": [], "fold_bytes": None}
    # W0 from the trainer's own frozen base on the GPU (BaseWeights.from_model): nothing read from
    # disk or the host. Its block runs first and restores the base before the checkpoint's block.
    # The same with the pre-2026-12-07 default bucket (256 MiB) for the comparison: each bucket
    # is one weight-update call into the engine, whatever its size.
    out["fold_gpu_base_256MiB"] = []
    for key, buckets in (("fold_gpu_base", None), ("fold_gpu_base_256MiB", 256 << 20)):
        live = Publisher([engine], name="merged-live", transport="merged", root=tmp / f"live-{key}", base=BaseWeights.from_model(model), bucket_bytes=buckets)
        try:
            for i in range(reps):
                adapter = _next_adapter(model)
                start = time.perf_counter()
                report = live.publish(adapter, version=i + 1).raise_for_errors()
                engine.generate(prompt, model=SERVED_BASE, max_tokens=1, logprobs=None)
                out[key].append(time.perf_counter() - start)
                out[f"{key}_load_s"] = out.get(f"{key}_load_s", []) + [report.results[0].timings.get("load")]
        finally:
            live.restore_base()
            live.close()
    pub = Publisher([engine], name="merged", transport="merged", root=tmp, base=base_dir)
    try:
        for i in range(reps):
            adapter = _next_adapter(model)  # distinct every repeat: an identical one is a no-op publish, not a sync
            start = time.perf_counter()
            report = pub.publish(adapter, version=i + 1).raise_for_errors()
            engine.generate(prompt, model=SERVED_BASE, max_tokens=1, logprobs=None)
            out["fold"].append(time.perf_counter() - start)
            out["fold_bytes"] = report.results[0].bytes_moved
        # Every parameter of the merged model, bucketed (TRL pushes each parameter every step).
        merged = {k.removeprefix("base_model.model."): v for k, v in model.merge_and_unload().state_dict().items()}
        out["every_param_bytes"] = sum(t.numel() * t.element_size() for t in merged.values())
        for _ in range(reps):
            start = time.perf_counter()
            engine.begin_weight_update()
            try:
                bucket: dict[str, torch.Tensor] = {}
                size = 0
                for name, tensor in merged.items():
                    bucket[name] = tensor
                    size += tensor.numel() * tensor.element_size()
                    if size >= 1 << 30:
                        engine.update_weights(bucket)
                        bucket, size = {}, 0
                if bucket:
                    engine.update_weights(bucket)
            finally:
                engine.end_weight_update()
            engine.generate(prompt, model=SERVED_BASE, max_tokens=1, logprobs=None)
            out["every_param"].append(time.perf_counter() - start)
    finally:
        pub.restore_base()
        pub.close()
    return out


# -- report ----------------------------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of issue 26, measured, met or missed (``why`` filled in by the docs)."""
    rows = []
    by_shape = {r["shape"]: r for r in results.get("shapes", [])}
    eight = by_shape.get("8b")
    for r, data in (eight or {}).get("ranks", {}).items():
        med = data["median_total_s"]
        rows.append({"goal": f"{GOALS[0][1]}, r{r}", "value": med["lorasync-ipc"] / med["peer"], "limit": GOALS[0][2]})
    for shape, res in by_shape.items():
        for r, data in res.get("ranks", {}).items():
            med = data["median_total_s"]
            for way in ("lorasync", "lorasync-ipc"):
                over, peer_over = med[way] - med["floor"], med["peer"] - med["floor"]
                rows.append({"goal": f"{GOALS[1][1]}: {way}, {shape} r{r}", "value": over / peer_over if peer_over > 0 else float("inf"), "limit": GOALS[1][2]})
        merged = res.get("merged")
        if merged:
            rows.append({"goal": f"{GOALS[2][1]}: {shape} (every parameter)", "value": merged["adapter_bytes"] / merged["every_param_bytes"], "limit": GOALS[2][2]})
            if merged.get("fold_bytes"):
                rows.append({"goal": f"{GOALS[2][1]}: {shape} (lorasync's fold: adapted weights only)", "value": merged["adapter_bytes"] / merged["fold_bytes"], "limit": GOALS[2][2]})
            if merged.get("fold_gpu_base"):
                rows.append({"goal": f"{GOALS[3][1]}: {shape}", "value": statistics.median(merged["fold_gpu_base"]), "limit": GOALS[3][2]})
    for row in rows:
        row["met"] = row["value"] <= row["limit"]
    return rows


def table(results: dict[str, Any]) -> str:
    """Markdown tables: per shape and rank the ways side by side; merged vs adapter; goals."""
    lines = []
    for res in results.get("shapes", []):
        for r, data in res.get("ranks", {}).items():
            med = data["median_total_s"]
            n = len(data["samples"]["peer"]["total"])
            lines += [
                f"**Qwen3-{res['shape'].upper()} shape, r{r} all-linear bf16 adapter ({data['adapter_bytes'] / 1e6:.1f} MB)**: "
                f"trainer weights → first completion (median of {n} interleaved rounds, ms; server start {res.get('startup_s', 0):.0f} s, not counted)",
                "",
                "| way | sync call | first completion | total | × peer | above floor | first token = trainer's |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
            for way in WAYS:
                s = data["samples"][way]
                total = med[way]
                lines.append(
                    f"| {way} | {_ms(statistics.median(s['sync']))} | {_ms(statistics.median(s['first']))} | **{_ms(total)}** | "
                    f"{total / med['peer']:.2f} | {_ms(total - med['floor'])} | {sum(s['served_new'])}/{len(s['served_new'])} |"
                )
            lines.append("")
            for way in ("lorasync", "lorasync-ipc"):
                stages = data["samples"][way].get("stages") or []
                keys = sorted({k for st in stages for k in st})
                if keys:
                    parts = [f"{k} {_ms(statistics.median([st[k] for st in stages if k in st]))}" for k in keys]
                    lines += [f"{way}, the sync call by stage (median ms; worker_*: inside the engine): " + ", ".join(parts), ""]
        trips = res.get("round_trips")
        if trips:
            lines += ["The engine's request paths with nothing to do (median ms): " + ", ".join(f"{k} {v:.1f}" for k, v in trips.items()), ""]
        merged = res.get("merged")
        if merged:
            lines += [
                f"**Qwen3-{res['shape'].upper()} shape: merged full-weight sync vs adapter sync (r16)**",
                "",
                "| sync | bytes | time to first completion (median, ms) |",
                "| --- | --- | --- |",
                f"| adapter (lorasync-ipc, r16) | {merged['adapter_bytes'] / 1e6:.1f} MB | "
                f"{_ms(res['ranks'].get(16, res['ranks'].get('16', {})).get('median_total_s', {}).get('lorasync-ipc', float('nan')))} |",
                f"| merged, lorasync fold (adapted weights), W0 from the base checkpoint | {(merged['fold_bytes'] or 0) / 1e9:.2f} GB | {_ms(statistics.median(merged['fold']))} |",
                f"| merged, lorasync fold, W0 the trainer's GPU base (`BaseWeights.from_model`) | {(merged['fold_bytes'] or 0) / 1e9:.2f} GB | "
                f"{_ms(statistics.median(merged['fold_gpu_base'])) if merged.get('fold_gpu_base') else '-'} |",
                f"| the same in 256 MiB buckets (the default before 2026-12-07) | {(merged['fold_bytes'] or 0) / 1e9:.2f} GB | "
                f"{_ms(statistics.median(merged['fold_gpu_base_256MiB'])) if merged.get('fold_gpu_base_256MiB') else '-'} |",
                f"| merged, every parameter (TRL GRPOTrainer) | {merged['every_param_bytes'] / 1e9:.2f} GB | {_ms(statistics.median(merged['every_param']))} |",
                "",
            ]
    lines += ["| goal | measured | limit | met |", "| --- | --- | --- | --- |"]
    for g in goals(results):
        lines.append(f"| {g['goal']} | {g['value']:.3f} | {g['limit']:.3f} | {'met' if g['met'] else '**missed**'} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [(res["shape"], r, data) for res in results.get("shapes", []) for r, data in res.get("ranks", {}).items()]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (shape, r, data) in zip(axes[0], panels):
        med = data["median_total_s"]
        values = [1e3 * med[w] for w in WAYS]
        ax.barh(list(WAYS), values, color=["tab:green", "tab:green", "tab:blue", "tab:red", "grey", "lightgrey"])
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
        ax.set_title(f"Qwen3-{shape} shape, r{r}", fontsize=10)
        ax.set_xlabel("weights → first completion, ms")
        ax.invert_yaxis()
    fig.suptitle(f"real vLLM {results.get('vllm', '?')} on {results.get('device', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
