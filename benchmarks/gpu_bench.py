"""GPU-resident adapters on one GPU: device-to-host export, CUDA IPC handoff, merged fold.

Measures, on whatever CUDA device is present (written for the H200):

* ceilings: device-memory copy bandwidth (bytes read + written), pinned D2H / H2D bandwidth;
* export of a Qwen3-8B r16 all-linear bf16 adapter (36 layers x 7 modules, 504 tensors,
  ~87 MB) to host memory: per-tensor ``.cpu()`` against ``lorasync.wire.d2h``;
* CUDA IPC handoff of the same adapter to a second process (export, map, copy, confirm, free);
* the merged fold W0 + s*B*A over Qwen3-8B's linear weights, W0 on the GPU and streamed from host;
* with ``--engines``: a real vLLM on the GPU (:mod:`benchmarks.gpu_engines`): trainer weights →
  first completion for lorasync, the peer, vLLM's bare load and the no-sync floor, and merged
  full-weight sync against adapter sync, on the Qwen3-0.6B and Qwen3-8B shapes at r16 and r64.

Usage: ``python benchmarks/gpu_bench.py [--out DIR] [--quick]``. Prints a table; writes
``gpu_bench.json`` (and ``gpu_bench.png`` when matplotlib is installed) into ``--out``.
``--engines [--shapes 0.6b,8b] [--ranks 16,64]`` runs the real-engine section instead and writes
``gpu_engines.json`` (after every part, so a killed run keeps what it measured), ``.md``, ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, RANK = 4096, 12288, 32, 8, 128, 36, 16
SHAPES = {  # module -> (out, in), Qwen3-8B
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (INTER, HIDDEN),
    "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


# -- helpers -------------------------------------------------------------------------------------


def wall(fn: Callable[[], object], *, warmup: int = 3, repeat: int = 20) -> list[float]:
    """Seconds per call, host clock, the device synchronised before and after each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def events(fn: Callable[[], object], *, warmup: int = 3, repeat: int = 20) -> list[float]:
    """Seconds per call measured with CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def profile_to(path: Path | None, fn: Callable[[], object], n: int = 10) -> None:
    """cProfile ``n`` calls of ``fn`` into a text file (where the host time goes)."""
    if path is None:
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    path.write_text(text.getvalue())


PROFILE_DIR: Path | None = None


def make_adapter(layers: int = LAYERS, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    from lorasync import Adapter, AdapterConfig

    g = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, (out, inp) in SHAPES.items():
            m = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{m}.lora_A.weight"] = (torch.randn(RANK, inp, device="cuda", generator=g) * 0.02).to(dtype)
            tensors[f"{m}.lora_B.weight"] = (torch.randn(out, RANK, device="cuda", generator=g) * 0.02).to(dtype)
    return Adapter(tensors, AdapterConfig(r=RANK, lora_alpha=2 * RANK))


def make_base(layers: int, where: str, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = {}
    for i in range(layers):
        for name, (out, inp) in SHAPES.items():
            w = (torch.randn(out, inp, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
            if where == "pinned":
                host = torch.empty(w.shape, dtype=w.dtype, pin_memory=True)
                w = host.copy_(w)
            elif where == "pageable":
                w = w.cpu()
            base[f"model.layers.{i}.{name}.weight"] = w
    torch.cuda.synchronize()
    return base


# -- sections ------------------------------------------------------------------------------------


def ceilings(results: dict, quick: bool) -> None:
    n = (1 << 30) if quick else (2 << 30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = med(events(lambda: dst.copy_(src), repeat=10))
    results["hbm_copy_GBps"] = 2 * n / t / 1e9
    del src, dst
    for label, nbytes in (("87MB", 87_293_952), ("1GiB", 1 << 30)):
        dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t_wall = med(wall(lambda: host.copy_(dev, non_blocking=True), repeat=30))
        t_ev = med(events(lambda: host.copy_(dev, non_blocking=True), repeat=30))
        results[f"d2h_pinned_{label}_ms_wall"] = t_wall * 1e3
        results[f"d2h_pinned_{label}_ms_events"] = t_ev * 1e3
        results[f"d2h_pinned_{label}_GBps"] = nbytes / t_ev / 1e9
        if label == "1GiB":
            t_h2d = med(events(lambda: dev.copy_(host, non_blocking=True), repeat=30))
            results["h2d_pinned_1GiB_GBps"] = nbytes / t_h2d / 1e9
        del dev, host


def export(results: dict, quick: bool) -> None:
    from lorasync.wire.d2h import serialize

    adapter = make_adapter()
    tensors = dict(adapter.tensors)
    results["adapter_tensors"] = len(tensors)
    results["adapter_bytes"] = adapter.nbytes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    serialize(tensors)
    results["serialize_first_call_ms"] = (time.perf_counter() - t0) * 1e3  # pinned buffer allocated
    repeat = 10 if quick else 30
    results["per_tensor_cpu_ms"] = med(wall(lambda: {k: t.cpu() for k, t in tensors.items()}, repeat=10)) * 1e3
    results["serialize_per_tensor_async_ms"] = med(wall(lambda: serialize(tensors, chunk_bytes=0), repeat=repeat)) * 1e3
    results["serialize_ms"] = med(wall(lambda: serialize(tensors), repeat=repeat)) * 1e3
    results["serialize_8MiB_ms"] = med(wall(lambda: serialize(tensors, chunk_bytes=8 << 20), repeat=repeat)) * 1e3
    results["to_host_ms"] = med(wall(lambda: adapter.to_host(), repeat=repeat)) * 1e3
    # The same two measurements again: their spread is the noise floor of this table.
    results["serialize_ms_again"] = med(wall(lambda: serialize(tensors), repeat=repeat)) * 1e3
    results["to_host_ms_again"] = med(wall(lambda: adapter.to_host(), repeat=repeat)) * 1e3

    # Host time until every transfer is queued (the rest of serialize overlaps the transfers).
    from lorasync.wire.d2h import DEFAULT_CHUNK_BYTES, gather_into
    from lorasync.wire.layout import plan as layout

    def launch() -> float:
        plan = layout(tensors)
        section = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
        t0 = time.perf_counter()
        done = gather_into(section, plan, list(tensors.values()), chunk_bytes=DEFAULT_CHUNK_BYTES)
        t1 = time.perf_counter()
        for event in done:
            event.synchronize()
        return t1 - t0

    results["serialize_launch_ms"] = med([launch() for _ in range(repeat)]) * 1e3

    def to_shm() -> None:
        serialize(tensors).to_shm().release()

    results["serialize_to_shm_ms"] = med(wall(to_shm, repeat=repeat)) * 1e3
    profile_to(PROFILE_DIR and PROFILE_DIR / "profile_serialize.txt", lambda: adapter.to_host())
    flat = results["d2h_pinned_87MB_ms_wall"]
    results["serialize_vs_flat_copy"] = flat / results["serialize_ms"]
    results["to_host_vs_flat_copy"] = flat / results["to_host_ms"]
    results["serialize_again_vs_flat_copy"] = flat / results["serialize_ms_again"]
    results["to_host_again_vs_flat_copy"] = flat / results["to_host_ms_again"]


def consumer_main() -> None:
    """Second process: map, copy, confirm; one JSON line in, one out."""
    from lorasync.engines.vllm_worker import LoraSyncWorkerExtension
    from lorasync.wire.cuda_ipc import close_mappings, import_tensors

    class _Manager:
        def _load_adapter(self, request: object) -> object:
            raise NotImplementedError

    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(lora_manager=_Manager()))
    torch.cuda.init()
    prof = None
    if os.environ.get("BENCH_PROFILE"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for line in sys.stdin:
        msg = json.loads(line)
        t0 = time.perf_counter()
        steps: dict[str, float] = {}
        if msg["mode"] == "steps":
            n = len(import_steps(json.loads(msg["spec"]), steps))
        elif msg["mode"] in ("import", "import_unmapped"):
            tensors, _ = import_tensors(json.loads(msg["spec"]))
            n = len(tensors)
            del tensors
            if msg["mode"] == "import_unmapped":  # as before the mapping cache: unmapped every step
                close_mappings()
        else:
            answer = LoraSyncWorkerExtension.lorasync_stage_adapter_cuda(worker, msg["spec"])  # type: ignore[arg-type]
            n = answer.get("tensors", 0)
        t1 = time.perf_counter()
        if msg["mode"] == "worker":
            LoraSyncWorkerExtension.lorasync_release_adapter(worker, json.loads(msg["spec"])["token"])  # type: ignore[arg-type]
        print(json.dumps({"consumer_s": t1 - t0, "tensors": n, "steps": steps}), flush=True)
    if prof is not None:
        import pstats

        prof.disable()
        with open(os.environ["BENCH_PROFILE"], "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)


def import_steps(spec: dict, steps: dict[str, float]) -> dict[str, torch.Tensor]:
    """``import_tensors`` step by step (same calls), timing each step into ``steps``."""
    from lorasync.wire.cuda_ipc import _local_index, _map, parse_spec
    from lorasync.wire.views import apply_views

    t = time.perf_counter()

    def step(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        steps[name] = now - t
        t = now

    f = parse_spec(spec)
    local = _local_index(f["device_uuid"])
    step("parse")
    own = torch.empty(f["nbytes"], dtype=torch.uint8, device=local)
    step("alloc")
    shared = _map(local, f)
    step("map+event")
    own.copy_(shared, non_blocking=True)
    step("queue_copy")
    out = apply_views(own, f["plan"])
    step("views")
    torch.cuda.current_stream(local).synchronize()
    step("wait")
    return out


def handoff(results: dict, quick: bool) -> None:
    from lorasync.engines.vllm import CONFIG_KEY
    from lorasync.wire.cuda_ipc import share_tensors

    adapter = make_adapter(seed=2)
    config = json.dumps(adapter.config.to_peft().to_dict(), default=sorted)
    env = dict(os.environ)
    if PROFILE_DIR is not None:
        env["BENCH_PROFILE"] = str(PROFILE_DIR / "profile_consumer.txt")
    proc = subprocess.Popen([sys.executable, __file__, "--consumer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for mode in ("steps", "import", "import_unmapped", "worker"):
            rows = []
            for i in range(5 + (10 if quick else 30)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                exp = share_tensors(adapter.tensors, {CONFIG_KEY: config})
                spec = json.dumps({"token": f"t{i}", **exp.spec})
                t1 = time.perf_counter()
                proc.stdin.write(json.dumps({"mode": mode, "spec": spec}) + "\n")
                proc.stdin.flush()
                answer = json.loads(proc.stdout.readline())
                t2 = time.perf_counter()
                exp.release()
                t3 = time.perf_counter()
                assert answer["tensors"] == len(adapter.tensors), answer
                if i >= 5:
                    rows.append((t3 - t0, t1 - t0, answer["consumer_s"], t3 - t2, answer["steps"]))
            results[f"ipc_{mode}_total_ms"] = med([r[0] for r in rows]) * 1e3
            results[f"ipc_{mode}_export_ms"] = med([r[1] for r in rows]) * 1e3
            results[f"ipc_{mode}_consumer_ms"] = med([r[2] for r in rows]) * 1e3
            results[f"ipc_{mode}_release_ms"] = med([r[3] for r in rows]) * 1e3
            results[f"ipc_{mode}_total_p90_ms"] = p90([r[0] for r in rows]) * 1e3
            for name in rows[0][4]:
                results[f"ipc_{mode}_step_{name}_ms"] = med([r[4][name] for r in rows]) * 1e3
            results[f"ipc_{mode}_total_max_ms"] = max(r[0] for r in rows) * 1e3
        profile_to(PROFILE_DIR and PROFILE_DIR / "profile_export.txt", lambda: share_tensors(adapter.tensors, {CONFIG_KEY: config}).release())
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    torch.cuda.synchronize()
    results["ipc_allocated_after_MB"] = torch.cuda.memory_allocated() / 1e6


def fold(results: dict, quick: bool) -> None:
    from lorasync import BaseWeights
    from lorasync.wire.d2h import serialize
    from lorasync.transports._fold import fold_buckets

    def run(adapter, base, device=None, to_host=False) -> None:
        for bucket in fold_buckets(adapter, BaseWeights.from_tensors(base), bucket_bytes=256 << 20, fused=FUSED, device=device):
            if to_host:
                serialize(bucket)
        torch.cuda.synchronize()

    layers = 8 if quick else LAYERS
    base = make_base(layers, "cuda")
    w_bytes = sum(w.numel() * w.element_size() for w in base.values())
    bf16 = make_adapter(layers, seed=3)
    f32 = make_adapter(layers, dtype=torch.float32, seed=3)
    results["fold_layers"] = layers
    results["fold_weight_GB"] = w_bytes / 1e9
    t = med(wall(lambda: run(bf16, base), warmup=1, repeat=5))
    results["fold_gpu_w0_bf16_ms"] = t * 1e3
    results["fold_gpu_w0_bf16_GBps"] = 2 * w_bytes / t / 1e9  # W0 read once, W written once
    results["fold_gpu_w0_bf16_vs_hbm"] = results["fold_gpu_w0_bf16_GBps"] / results["hbm_copy_GBps"]
    # The fused fold kernel, W0 on the GPU: W0 read (2 B per element), W written (2 B).
    results["fold_gpu_w0_bf16_traffic_GBps"] = 2 * w_bytes / t / 1e9
    pairs = [(base[f"{m}.weight"], *bf16.pair(m), bf16.config.scale_for(m)) for m in bf16.modules]
    from lorasync.transports import _fold_gpu

    def blocked() -> None:  # the fold before this version: fp32 product, then one add
        for w, a, b, s in pairs:
            torch.add(w, torch.mm(b.float(), a.float()), alpha=s, out=torch.empty_like(w))

    def kernel(config):
        return lambda: [_fold_gpu.fold_fused(w, a, b, s, w.device, config=config) for w, a, b, s in pairs]

    # Interleaved: cuBLAS's addmm (the reference), the fold kernel in three tilings, the old
    # two-kernel fold.
    configs = {"64x128w4": (64, 128, 4), "128x128w8": (128, 128, 8), "64x256w8": (64, 256, 8)}
    times: dict[str, list[float]] = {"addmm": [], "blocked": [], **{c: [] for c in configs}}
    for _ in range(3):
        times["addmm"] += events(lambda: [torch.addmm(w, b, a, alpha=s) for w, a, b, s in pairs], warmup=1, repeat=3)
        for name, config in configs.items():
            times[name] += events(kernel(config), warmup=1, repeat=3)
        times["blocked"] += events(blocked, warmup=1, repeat=3)
    results["fold_gpu_fused_addmm_ms"] = med(times["addmm"]) * 1e3
    results["fold_gpu_fused_addmm_GBps"] = 2 * w_bytes / med(times["addmm"]) / 1e9
    for name in configs:
        results[f"fold_gpu_kernel_{name}_ms"] = med(times[name]) * 1e3
    results["fold_gpu_blocked_kernels_ms"] = med(times["blocked"]) * 1e3
    results["fold_vs_addmm"] = results["fold_gpu_w0_bf16_ms"] / results["fold_gpu_fused_addmm_ms"]
    # Rounding: elements of one module outside one bf16 rounding of a float64 reference, with
    # W0 and the delta of one size so that they cancel (as tests/gpu/test_fold_gpu.py draws them).
    g = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(4096, 4096, device="cuda", generator=g).to(torch.bfloat16)
    a = torch.randn(16, 4096, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(4096, 16, device="cuda", generator=g).to(torch.bfloat16)
    ref64 = w.double() + 0.5 * (b.double() @ a.double())
    bound = ref64.abs() * torch.finfo(torch.bfloat16).eps + 1e-4
    got_fold = _fold_gpu.fold_fused(w, a, b, 0.5, w.device)
    got_addmm = torch.addmm(w, b, a, alpha=0.5)
    results["fold_rounding_violations_addmm"] = int(((got_addmm.double() - ref64).abs() > bound).sum())
    results["fold_rounding_violations_fold"] = int(((got_fold.double() - ref64).abs() > bound).sum())
    del w, a, b, ref64, bound, got_fold, got_addmm
    t = med(wall(lambda: run(f32, base), warmup=1, repeat=3))
    results["fold_gpu_w0_f32factors_ms"] = t * 1e3
    del base, pairs, f32
    torch.cuda.empty_cache()

    sub = 4
    small = make_adapter(sub, seed=4)
    for where in ("pinned", "pageable"):
        host_base = make_base(sub, where)
        nbytes = sum(w.numel() * w.element_size() for w in host_base.values())
        t = med(wall(lambda: run(small, host_base, device="cuda"), warmup=1, repeat=3))
        results[f"fold_host_{where}_w0_GBps"] = nbytes / t / 1e9  # bytes of W0 brought over
        if where == "pinned":
            t = med(wall(lambda: run(small, host_base, device="cuda", to_host=True), warmup=1, repeat=3))
            results["fold_host_pinned_roundtrip_GBps"] = 2 * nbytes / t / 1e9  # W0 over, W back
        del host_base
    gpu_base = make_base(sub, "cuda")
    nbytes = sum(w.numel() * w.element_size() for w in gpu_base.values())
    t = med(wall(lambda: run(small, gpu_base, to_host=True), warmup=1, repeat=3))
    results["fold_gpu_w0_to_host_GBps"] = nbytes / t / 1e9  # merged weights delivered to host


def publish_merged(results: dict, quick: bool) -> None:
    """The merged fallback through ``Publisher.publish`` with W0 the trainer's own GPU tensors
    (``BaseWeights.from_model`` hands these out), into an engine that takes the buckets where
    they are (vLLM's worker copies them into its weights): lorasync's side of "merged 8B in
    2 s", interleaved with the floor, ``fold_buckets`` alone over the same W0 and adapter."""
    import tempfile

    from benchmarks._engines import CountingEngine
    from lorasync import BaseWeights, Publisher
    from lorasync.transports._fold import fold_buckets

    layers = 8 if quick else LAYERS
    base = make_base(layers, "cuda")
    results["publish_merged_layers"] = layers
    results["publish_merged_weight_GB"] = sum(w.numel() * w.element_size() for w in base.values()) / 1e9
    adapters = [make_adapter(layers, seed=10 + i) for i in range(8)]  # distinct: an equal one is a no-op publish
    engine = CountingEngine()
    times: dict[str, list[float]] = {"publish": [], "fold_buckets": []}
    with tempfile.TemporaryDirectory() as root:
        pub = Publisher([engine], name="merged", transport="merged", root=root, base=BaseWeights.from_tensors(base))
        try:
            for i, adapter in enumerate(adapters):
                torch.cuda.synchronize()
                start = time.perf_counter()
                pub.publish(adapter, version=i + 1).raise_for_errors()
                torch.cuda.synchronize()
                times["publish"].append(time.perf_counter() - start)
                start = time.perf_counter()
                for _ in fold_buckets(adapter, BaseWeights.from_tensors(base), bucket_bytes=256 << 20, fused=FUSED):
                    pass
                torch.cuda.synchronize()
                times["fold_buckets"].append(time.perf_counter() - start)
        finally:
            pub.restore_base()
            pub.close()
    warm = 2  # the first publishes compile the fold kernel and import PEFT
    results["publish_merged_gpu_base_ms"] = med(times["publish"][warm:]) * 1e3
    results["publish_merged_gpu_base_ms_all"] = [t * 1e3 for t in times["publish"]]
    results["publish_merged_fold_buckets_ms"] = med(times["fold_buckets"][warm:]) * 1e3
    results["publish_merged_vs_fold"] = results["publish_merged_gpu_base_ms"] / results["publish_merged_fold_buckets_ms"]
    results["publish_merged_bytes_pushed"] = engine.counts.weights
    del base, adapters
    torch.cuda.empty_cache()


def device_hash(results: dict, quick: bool) -> None:
    """The content hash of the Qwen3-8B r16 adapter on its GPU, fp32 as PEFT keeps it (174.6 MB,
    504 tensors): the fused Triton pass against the torch form (a dozen elementwise kernels per
    lane), interleaved, each ending with the 16 bytes on the host; equal values checked."""
    from lorasync.wire import device_hash as dh

    adapter = make_adapter(8 if quick else LAYERS, dtype=torch.float32)
    tensors = [adapter.tensors[k] for k in sorted(adapter.tensors)]
    fused_fn = dh.lanes_fused

    def torch_form() -> tuple[int, int]:
        dh.lanes_fused = lambda *a, **k: None  # the torch form, as without Triton
        try:
            return dh.lanes(tensors)
        finally:
            dh.lanes_fused = fused_fn

    assert dh.lanes(tensors) == torch_form(), "the fused pass and the torch form disagree"
    times: dict[str, list[float]] = {"fused": [], "torch": []}
    for _ in range(3):
        dh.lanes(tensors), torch_form()
    for _ in range(5 if quick else 20):
        for name, fn in (("fused", lambda: dh.lanes(tensors)), ("torch", torch_form)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    results["device_hash_bytes"] = adapter.nbytes
    results["device_hash_fused_ms"] = med(times["fused"]) * 1e3
    results["device_hash_torch_ms"] = med(times["torch"]) * 1e3
    results["device_hash_content_hash_ms"] = med(wall(lambda: adapter.content_hash, repeat=10)) * 1e3  # with the header, as a publish takes it


# -- report --------------------------------------------------------------------------------------


def table(r: dict) -> str:
    rows = [
        ("device memory copy (read+write)", f"{r['hbm_copy_GBps']:.0f} GB/s"),
        ("pinned D2H, one 87 MB copy", f"{r['d2h_pinned_87MB_ms_wall']:.2f} ms wall, {r['d2h_pinned_87MB_GBps']:.1f} GB/s"),
        ("pinned D2H / H2D, 1 GiB", f"{r['d2h_pinned_1GiB_GBps']:.1f} / {r['h2d_pinned_1GiB_GBps']:.1f} GB/s"),
        (f"adapter: {r['adapter_tensors']} tensors, {r['adapter_bytes'] / 1e6:.1f} MB bf16", ""),
        ("  per-tensor .cpu()", f"{r['per_tensor_cpu_ms']:.2f} ms"),
        ("  host time to queue every transfer", f"{r['serialize_launch_ms']:.2f} ms"),
        ("  serialize, per-tensor async copies", f"{r['serialize_per_tensor_async_ms']:.2f} ms"),
        ("  serialize (pieces of 8 MiB growing to 32 MiB)", f"{r['serialize_ms']:.2f} ms = {100 * r['serialize_vs_flat_copy']:.0f}% of flat copy"),
        ("  serialize, pieces up to 8 MiB", f"{r['serialize_8MiB_ms']:.2f} ms"),
        ("  to_host -> Adapter", f"{r['to_host_ms']:.2f} ms = {100 * r['to_host_vs_flat_copy']:.0f}% of flat copy"),
        ("  serialize / to_host, measured again", f"{r['serialize_ms_again']:.2f} / {r['to_host_ms_again']:.2f} ms"),
        ("  serialize + shared memory", f"{r['serialize_to_shm_ms']:.2f} ms"),
        ("  first call (pinned allocation)", f"{r['serialize_first_call_ms']:.1f} ms"),
        ("CUDA IPC, GPU copy in 2nd process", f"{r['ipc_import_total_ms']:.2f} ms (export {r['ipc_import_export_ms']:.2f}, consumer {r['ipc_import_consumer_ms']:.2f}, p90 {r['ipc_import_total_p90_ms']:.2f}, max {r['ipc_import_total_max_ms']:.2f})"),
        ("  consumer steps", " ".join(f"{k.split('_step_')[1][:-3]} {v:.2f}" for k, v in r.items() if "_step_" in k)),
        ("CUDA IPC, unmapped every step (as before)", f"{r['ipc_import_unmapped_total_ms']:.2f} ms (consumer {r['ipc_import_unmapped_consumer_ms']:.2f})"),
        ("CUDA IPC, vLLM worker staging", f"{r['ipc_worker_total_ms']:.2f} ms (consumer {r['ipc_worker_consumer_ms']:.2f}, p90 {r['ipc_worker_total_p90_ms']:.2f})"),
        (f"fold, W0 on GPU ({r['fold_weight_GB']:.1f} GB bf16)", f"{r['fold_gpu_w0_bf16_ms']:.1f} ms = {r['fold_gpu_w0_bf16_GBps']:.0f} GB/s of W0+W ({100 * r['fold_gpu_w0_bf16_vs_hbm']:.0f}% of copy bw), {r['fold_gpu_w0_bf16_traffic_GBps']:.0f} GB/s traffic"),
        ("  vs cuBLAS addmm, default flags (reference)", f"{r['fold_vs_addmm']:.2f}x of {r['fold_gpu_fused_addmm_ms']:.1f} ms = {r['fold_gpu_fused_addmm_GBps']:.0f} GB/s"),
        ("  fold kernel, no Python: 64x128w4 / 128x128w8 / 64x256w8", " / ".join(f"{r[f'fold_gpu_kernel_{n}_ms']:.1f}" for n in ("64x128w4", "128x128w8", "64x256w8")) + " ms"),
        ("  old fold kernels (fp32 mm + add)", f"{r['fold_gpu_blocked_kernels_ms']:.1f} ms"),
        ("  elements off one rounding: addmm / fold", f"{r['fold_rounding_violations_addmm']} / {r['fold_rounding_violations_fold']} of 16.8 M"),
        ("  fp32 factors", f"{r['fold_gpu_w0_f32factors_ms']:.1f} ms"),
        ("fold, W0 pinned host -> GPU", f"{r['fold_host_pinned_w0_GBps']:.1f} GB/s of W0"),
        ("fold, W0 pageable host -> GPU", f"{r['fold_host_pageable_w0_GBps']:.1f} GB/s of W0"),
        ("fold + buckets to host, W0 pinned", f"{r['fold_host_pinned_roundtrip_GBps']:.1f} GB/s (W0 in + W out)"),
        ("fold + buckets to host, W0 on GPU", f"{r['fold_gpu_w0_to_host_GBps']:.1f} GB/s of W"),
        (f"Publisher.publish, merged, W0 the trainer's GPU tensors ({r['publish_merged_weight_GB']:.1f} GB)", f"{r['publish_merged_gpu_base_ms']:.1f} ms = {r['publish_merged_vs_fold']:.2f}x of fold_buckets alone ({r['publish_merged_fold_buckets_ms']:.1f} ms)"),
    ]
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = ["flat pinned copy", "per-tensor .cpu()", "per-tensor async", "serialize", "to_host", "CUDA IPC handoff"]
    values = [r["d2h_pinned_87MB_ms_wall"], r["per_tensor_cpu_ms"], r["serialize_per_tensor_async_ms"], r["serialize_ms"], r["to_host_ms"], r["ipc_import_total_ms"]]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(labels, values, color=["grey", "tab:red", "tab:orange", "tab:green", "tab:green", "tab:blue"])
    ax.set_xscale("log")
    ax.set_xlabel("ms (log scale)")
    ax.set_title(f"Qwen3-8B r16 adapter ({r['adapter_bytes'] / 1e6:.0f} MB) off {r['device']}")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 8 fold layers")
    parser.add_argument("--profile", action="store_true", help="write cProfile summaries of the host work")
    parser.add_argument("--consumer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engines", action="store_true", help="the real-vLLM section (benchmarks/gpu_engines.py)")
    parser.add_argument("--shapes", default="0.6b,8b", help="--engines: model shapes")
    parser.add_argument("--ranks", default="16,64", help="--engines: LoRA ranks")
    parser.add_argument("--repeats", type=int, default=8, help="--engines: measured rounds per rank")
    parser.add_argument("--warmup", type=int, default=2, help="--engines: warm-up rounds per rank")
    parser.add_argument("--merged-shapes", default="0.6b,8b", help="--engines: shapes that also time merged full-weight sync")
    parser.add_argument("--sections", default=None, help="only these sections, comma-separated (JSON printed, no table or plot)")
    args = parser.parse_args()
    if args.consumer:
        consumer_main()
        return
    if args.engines:
        engines_main(args)
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_bench needs a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global PROFILE_DIR
    PROFILE_DIR = out if args.profile else None
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.gpu_model_export import model_export

    sections = {f.__name__: f for f in (ceilings, export, handoff, fold, publish_merged, device_hash, model_export)}
    chosen = list(sections) if args.sections is None else args.sections.split(",")
    for name in chosen:
        t0 = time.perf_counter()
        sections[name](results, args.quick)
        print(f"[{name} done in {time.perf_counter() - t0:.1f} s]", flush=True)
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
    if args.sections is not None:
        print(json.dumps(results, indent=2))
        return
    plot(results, out / "gpu_bench.png")
    print(table(results))


def engines_main(args: argparse.Namespace) -> None:
    """The real-vLLM section; JSON rewritten after every shape and rank."""
    import importlib.util
    import tempfile

    import vllm

    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # vLLM's sampler imports it unless told not to

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu_engines

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "vllm": str(vllm.__version__), "shapes": []}

    def save(partial: dict) -> None:
        shapes = [s for s in results["shapes"] if s["shape"] != partial["shape"]] + [partial]
        results["shapes"] = shapes
        (out / "gpu_engines.json").write_text(json.dumps(results, indent=1, default=str))

    ranks = tuple(int(r) for r in args.ranks.split(","))
    with tempfile.TemporaryDirectory(prefix="lorasync-gpu-engines-") as tmp:
        for shape in args.shapes.split(","):
            t0 = time.perf_counter()
            merged_reps = 3 if shape in args.merged_shapes.split(",") else 0
            save(gpu_engines.run_shape(shape, ranks, Path(tmp), repeats=args.repeats, warmup=args.warmup, merged_reps=merged_reps, log_dir=out, save=save, profile=args.profile))
            print(f"[engines {shape} done in {time.perf_counter() - t0:.0f} s]", flush=True)
            (out / "gpu_engines.md").write_text(gpu_engines.table(results))
    gpu_engines.plot(results, out / "gpu_engines.png")
    text = gpu_engines.table(results)
    (out / "gpu_engines.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
