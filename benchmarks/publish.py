"""Publish latency against floors, one run side by side.

Disk: lorasync's full ``Publisher.publish`` (transport ``disk``, a counting engine whose load is a
no-op) vs (a) a raw write of the same bytes to the same tmpfs and (b) PEFT's own
``save_pretrained`` of the same adapter (a PEFT model over a meta-device base of the same
shapes). The SHA-256 content hash (what makes an unchanged adapter move zero bytes) is timed
separately. IPC: ``write_segment`` + ``read_segment`` in a second process vs a memcpy of the same
bytes into shared memory (and vs the memcpy-in + copy-out floor of any copy-out handoff).

Default: Qwen3-8B, r16, all-linear, bf16 (87.3 MB). Run: ``lorasync bench publish [--shape S]
[--rank R] [--scope SCOPE]`` or ``python -m benchmarks.publish``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import warnings
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._engines import CONFIG_KEY, CountingEngine, ShmReader, safetensors_data_bytes
from benchmarks._harness import Case, Goal, Options, Report, Table, Timing, fmt_bytes, fmt_ms, timeit_many
from benchmarks._shapes import ModelShape
from benchmarks._synth import synth_adapter
from lorasync import Adapter, Publisher
from lorasync.transports import DiskStore
from lorasync.wire.shm import write_segment

__all__ = ["run"]

NAME = "publish"


def run(opts: Options) -> Report:
    shape = ModelShape.load(opts.shapes[0] if opts.shapes else "qwen3-8b")
    rank = opts.ranks[0] if opts.ranks else 16
    scope = opts.scope or "all-linear"
    repeats, warmup = opts.reps(15, 7), opts.warm(2, 1)
    adapter = synth_adapter(shape, rank=rank, scope=scope, dtype=torch.bfloat16)
    nbytes = adapter.nbytes
    title = f"Publish latency vs floors: {shape.name} r{rank} {scope} bf16 ({fmt_bytes(nbytes)})"
    report = Report(NAME, title)
    show = opts.progress
    parent = str(opts.root) if opts.root else ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    if opts.root:
        opts.root.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[float]] = {"hash": [], "write": [], "load": [], "other": [], "total": []}

    with tempfile.TemporaryDirectory(prefix="lorasync-bench-publish-", dir=parent) as tmp, ShmReader() as reader, ShmReader(threads=1) as reader1:
        root = Path(tmp)
        tensors = [t.reshape(-1).view(torch.uint8).numpy() for t in adapter.tensors.values()]
        fresh: list[Adapter] = []
        pubs: list[Publisher] = []

        def new_adapter() -> None:
            fresh[:] = [Adapter(adapter.tensors, adapter.config)]  # same tensors, hash not cached

        def raw_write() -> None:
            with open(root / "raw.bin", "wb") as f:
                for t in tensors:
                    f.write(t.data)
                f.flush()
                os.fsync(f.fileno())

        def safetensors_save() -> None:
            from safetensors.torch import save_file

            save_file(dict(adapter.tensors), str(root / "st.safetensors"), metadata={"format": "pt"})

        store = DiskStore(root / "store")

        def publish_setup(transport: str) -> None:
            new_adapter()
            engine = CountingEngine(reader=reader if transport == "ipc" else None)
            pubs[:] = [Publisher([engine], name="bench", transport=transport, root=root / "pub")]

        def publish() -> None:
            rep = pubs[0].publish(fresh[0], version=1).raise_for_errors()
            t, r = rep.timings, rep.results[0].timings
            parts["hash"].append(t["hash"])
            parts["write"].append(r["write"])
            parts["load"].append(r["load"])
            parts["total"].append(t["total"])
            parts["other"].append(t["total"] - t["hash"] - r["write"] - r["load"])

        # Every-step use: one Publisher, a new version per step (two contents alternate so no
        # step is "unchanged"); keep=2 also unloads and deletes the version two steps back.
        other = synth_adapter(shape, rank=rank, scope=scope, dtype=torch.bfloat16, seed=1)
        steady_pub = Publisher([CountingEngine()], name="steady", transport="disk", root=root / "steady", keep=2)
        step = [0]
        steady_hash: list[float] = []

        def steady_setup() -> None:
            step[0] += 1
            src = adapter if step[0] % 2 else other
            fresh[:] = [Adapter(src.tensors, src.config)]

        def steady() -> None:
            rep = steady_pub.publish(fresh[0], version=step[0]).raise_for_errors()
            steady_hash.append(rep.timings["hash"])

        def publish_teardown() -> None:
            pubs[0].close()
            shutil.rmtree(root / "pub", ignore_errors=True)

        def handoff() -> None:
            with write_segment(adapter.tensors, meta) as seg:
                reader.read(seg.name, seg.nbytes)

        def handoff_one_thread() -> None:
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with write_segment(adapter.tensors, meta) as seg:
                    reader1.read(seg.name, seg.nbytes)
            finally:
                torch.set_num_threads(before)

        def memcpy_in() -> shared_memory.SharedMemory:
            shm = shared_memory.SharedMemory(create=True, size=nbytes)
            offset = 0
            for t in tensors:
                shm.buf[offset : offset + t.nbytes] = t.data
                offset += t.nbytes
            return shm

        def memcpy_floor() -> None:
            shm = memcpy_in()
            shm.close()
            shm.unlink()

        def memcpy_in_out() -> None:
            shm = memcpy_in()
            reader.copy(shm.name, nbytes)
            shm.close()
            shm.unlink()

        host_dst = np.empty(nbytes, dtype=np.uint8)

        def host_memcpy() -> None:  # the floor of any in-memory pass over these bytes
            offset = 0
            for t in tensors:
                host_dst[offset : offset + t.size] = t
                offset += t.size

        adapter.save(root / "loadme")
        meta = {CONFIG_KEY: "{}"}
        cases = {
            "host_memcpy": Case(host_memcpy),
            "save": Case(lambda: adapter.save(root / "saved"), teardown=lambda: shutil.rmtree(root / "saved")),
            "load": Case(lambda: Adapter.load(root / "loadme")),
            "raw": Case(raw_write, teardown=lambda: (root / "raw.bin").unlink()),
            "safetensors": Case(safetensors_save, teardown=lambda: (root / "st.safetensors").unlink()),
            "hash": Case(lambda: fresh[0].content_hash, setup=new_adapter),
            "store": Case(lambda: store.write(fresh[0], "bench", 1), setup=lambda: (new_adapter(), fresh[0].content_hash), teardown=lambda: store.remove("bench", 1)),
            "publish": Case(publish, setup=lambda: publish_setup("disk"), teardown=publish_teardown),
            "steady": Case(steady, setup=steady_setup),
        }
        # Timed as a separate group: torch's OpenMP workers spin for a while after the IPC
        # copies, which would slow whichever disk case ran next.
        ipc_cases = {
            "memcpy": Case(memcpy_floor),
            "memcpy2": Case(memcpy_in_out),
            "ipc": Case(handoff),
            "ipc_1t": Case(handoff_one_thread),
            "ipc_publish": Case(lambda: pubs[0].publish(fresh[0], version=1).raise_for_errors(), setup=lambda: publish_setup("ipc"), teardown=publish_teardown),
        }
        peft_note = ""
        try:
            peft_model = _peft_model(shape, adapter)
        except Exception as exc:  # a geometry PEFT/transformers cannot build on meta
            peft_model, peft_note = None, f"PEFT floor skipped: cannot build a PEFT model of {shape.name} on the meta device ({type(exc).__name__}: {exc})"
        if peft_model is not None:
            peft_model.save_pretrained(str(root / "peft"))
            saved = safetensors_data_bytes(root / "peft" / "adapter_model.safetensors")
            if saved != nbytes:
                raise AssertionError(f"PEFT saved {saved} tensor bytes, the adapter has {nbytes}: not the same adapter")
            shutil.rmtree(root / "peft")
            cases["peft"] = Case(lambda: peft_model.save_pretrained(str(root / "peft")), teardown=lambda: shutil.rmtree(root / "peft"))
        times = timeit_many(cases, repeats=repeats, warmup=warmup, label="disk publish vs floors (rounds)", show=show)
        times.update(timeit_many(ipc_cases, repeats=repeats, warmup=warmup, label="IPC handoff vs memcpy (rounds)", show=show))
        for key in parts:
            parts[key] = parts[key][warmup:]
        steady_hash = steady_hash[warmup:]
        steady_pub.close()
        peft_model = None  # the meta-device model is no longer needed

    med = {k: v.median for k, v in times.items()}
    pmed = {k: statistics.median(v) for k, v in parts.items()}
    # Hash excluded, per run (publish total minus that run's hash), then the median.
    nohash = Timing([p - h for p, h in zip(times["publish"].samples, parts["hash"], strict=True)])
    publish_nohash = nohash.median
    steady_nohash = Timing([p - h for p, h in zip(times["steady"].samples, steady_hash, strict=True)]).median
    rows = [
        ["raw write of the same bytes (floor a)", fmt_ms(med["raw"]), "1.00", _ratio(med, "raw", "peft")],
        ["safetensors save_file (what PEFT and lorasync call)", fmt_ms(med["safetensors"]), f"{med['safetensors'] / med['raw']:.2f}", _ratio(med, "safetensors", "peft")],
        ["PEFT save_pretrained (floor b)", fmt_ms(med["peft"]) if "peft" in med else "n/a", _ratio(med, "peft", "raw"), "1.00" if "peft" in med else "n/a"],
        ["lorasync content_hash (XXH3-128, alone)", fmt_ms(med["hash"]), f"{med['hash'] / med['raw']:.2f}", _ratio(med, "hash", "peft")],
        ["lorasync DiskStore.write (hashed in the write pass)", fmt_ms(med["store"]), f"{med['store'] / med['raw']:.2f}", _ratio(med, "store", "peft")],
        ["**lorasync disk publish, all-in**", fmt_ms(med["publish"]), f"{med['publish'] / med['raw']:.2f}", _ratio(med, "publish", "peft")],
        ["**lorasync disk publish, hash excluded**", fmt_ms(publish_nohash), f"{publish_nohash / med['raw']:.2f}", f"{publish_nohash / med['peft']:.2f}" if "peft" in med else "n/a"],
        ["lorasync every-step publish (keep=2: + unload and delete of step−2), all-in", fmt_ms(med["steady"]), f"{med['steady'] / med['raw']:.2f}", _ratio(med, "steady", "peft")],
        ["lorasync every-step publish, hash excluded", fmt_ms(steady_nohash), f"{steady_nohash / med['raw']:.2f}", f"{steady_nohash / med['peft']:.2f}" if "peft" in med else "n/a"],
    ]
    report.tables.append(Table(f"Disk publish (median of {repeats} rounds after {warmup} warm-up, all paths interleaved; ms; tmpfs)", ["path", "ms", "× raw write", "× PEFT save"], rows))
    report.tables.append(Table(
        f"Adapter passes over CPU tensors beside a raw host memcpy of the same {fmt_bytes(nbytes)} (median; GB/s of tensor bytes)",
        ["pass", "ms", "GB/s", "× memcpy time"],
        [[label, fmt_ms(med[key]), f"{nbytes / med[key] / 1e9:.2f}", f"{med[key] / med['host_memcpy']:.2f}"] for label, key in (
            ("raw host memcpy (floor)", "host_memcpy"), ("content_hash (XXH3-128)", "hash"), ("Adapter.save (tmpfs, fsync-free)", "save"),
            ("Adapter.load (tmpfs)", "load"), ("raw write to tmpfs + fsync", "raw"))],
    ))
    report.tables.append(Table(
        "Inside lorasync disk publish (medians, ms)",
        ["hash", "write (DiskStore)", "engine load (no-op)", "other (threads, pre-flight, GC)", "total"],
        [[fmt_ms(pmed["hash"]), fmt_ms(pmed["write"]), fmt_ms(pmed["load"]), fmt_ms(pmed["other"]), fmt_ms(pmed["total"])]],
    ))
    report.tables.append(Table(
        f"IPC handoff to a second process (median of {repeats}; ms)",
        ["path", "ms", "× memcpy into shm", "× memcpy in + copy out"],
        [
            ["memcpy of the same bytes into shared memory (floor)", fmt_ms(med["memcpy"]), "1.00", f"{med['memcpy'] / med['memcpy2']:.2f}"],
            ["memcpy in + raw copy out in the second process", fmt_ms(med["memcpy2"]), f"{med['memcpy2'] / med['memcpy']:.2f}", "1.00"],
            ["**write_segment + read_segment in the second process**", fmt_ms(med["ipc"]), f"{med['ipc'] / med['memcpy']:.2f}", f"{med['ipc'] / med['memcpy2']:.2f}"],
            ["same, torch.set_num_threads(1) in both processes", fmt_ms(med["ipc_1t"]), f"{med['ipc_1t'] / med['memcpy']:.2f}", f"{med['ipc_1t'] / med['memcpy2']:.2f}"],
            ["lorasync ipc publish, all-in (hash + handoff)", fmt_ms(med["ipc_publish"]), f"{med['ipc_publish'] / med['memcpy']:.2f}", f"{med['ipc_publish'] / med['memcpy2']:.2f}"],
        ],
    ))
    report.goals += [
        Goal("disk publish (hash excluded) / raw write", publish_nohash / med["raw"], 1.25, "hash reported separately"),
        Goal("disk publish (all-in) / raw write", med["publish"] / med["raw"], 1.25, f"XXH3-128 alone is {med['hash'] / med['raw']:.2f}× raw write"),
    ]
    if "peft" in med:
        report.goals += [
            Goal("disk publish (hash excluded) / PEFT save_pretrained", publish_nohash / med["peft"], 0.5),
            Goal("disk publish (all-in) / PEFT save_pretrained", med["publish"] / med["peft"], 0.5),
        ]
    report.goals += [
        Goal("IPC handoff / memcpy into shm", med["ipc"] / med["memcpy"], 1.2, "the handoff copies twice (into shm, out in the reader)"),
        Goal("IPC handoff / (memcpy in + copy out)", med["ipc"] / med["memcpy2"], 1.2, "the floor of any copy-out design"),
    ]
    report.notes.append(
        f"torch intra-op threads: {torch.get_num_threads()}. _shm copies tensor by tensor with torch copy_/clone, which fan out to OpenMP "
        "workers per tensor; with hundreds of mid-size tensors on a busy host that hand-off dominates (compare the one-thread row)."
    )
    if peft_note:
        report.notes.append(peft_note)
    report.notes.append(f"{fmt_bytes(nbytes)} of tensors in {len(adapter)} tensors; tmpfs at {parent}; floors and lorasync run in the same process, interleaved in one run.")
    report.data = {
        "shape": shape.name, "rank": rank, "scope": scope, "nbytes": nbytes, "repeats": repeats, "warmup": warmup,
        "timings": {k: v.to_dict() for k, v in times.items()}, "publish_parts_median_s": pmed, "publish_hash_excluded_s": publish_nohash, "steady_hash_excluded_s": steady_nohash,
        "torch_threads": torch.get_num_threads(),
    }
    report.plot = lambda fig: _plot(fig, times, pmed, nbytes)
    return report


def _ratio(med: dict[str, float], num: str, den: str) -> str:
    if num not in med or den not in med:
        return "n/a"
    return f"{med[num] / med[den]:.2f}"


def _peft_model(shape: ModelShape, adapter: Adapter) -> Any:
    """A PEFT LoRA model over a meta-device base of ``shape`` whose LoRA weights are exactly
    ``adapter``'s tensors (shared, not copied), so ``save_pretrained`` runs PEFT's real path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # PEFT's save may look at the hub otherwise
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if shape.experts:
        raise ValueError("transformers stores MoE experts as fused 3-D parameters, not per-expert Linear layers")
    cfg = adapter.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=shape.dtype)
            model = get_peft_model(base, LoraConfig(r=cfg.r, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.target_modules), lora_dropout=0.0))
    modules = dict(model.named_modules())
    for module in adapter.modules:
        a, b = adapter.pair(module)
        layer = modules[f"base_model.model.{module}"]
        layer.lora_A["default"].weight = torch.nn.Parameter(a, requires_grad=False)
        layer.lora_B["default"].weight = torch.nn.Parameter(b, requires_grad=False)
    return model


def _plot(fig: Any, times: dict[str, Timing], pmed: dict[str, float], nbytes: int) -> None:
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[3, 2])
    labels = [("raw", "raw write (floor a)"), ("safetensors", "safetensors save_file"), ("peft", "PEFT save_pretrained (floor b)"), ("store", "lorasync DiskStore.write"), ("publish", "lorasync disk publish")]
    labels = [(k, lbl) for k, lbl in labels if k in times]
    y = list(range(len(labels)))
    ax1.barh(y, [times[k].median * 1e3 for k, _ in labels], color=["#999999", "#bbbbbb", "#e08040", "#4a90d9", "#1f5fa8"][: len(labels)])
    hash_ms = pmed["hash"] * 1e3
    ax1.barh([y[-1]], [hash_ms], color="#9fc5f0", label="of which SHA-256 content hash")
    for i, (k, _) in enumerate(labels):
        lo, hi = times[k].spread
        ax1.errorbar(times[k].median * 1e3, i, xerr=[[max(0.0, (times[k].median - lo) * 1e3)], [max(0.0, (hi - times[k].median) * 1e3)]], color="black", capsize=3)
    ax1.set_yticks(y, [lbl for _, lbl in labels])
    ax1.set_xlabel("ms (median; bars: interquartile range)")
    ax1.set_title(f"Disk publish of {nbytes / 1e6:.1f} MB to tmpfs")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.grid(True, axis="x", alpha=0.3)
    ipc = [("memcpy", "memcpy into shm (floor)"), ("memcpy2", "memcpy in + copy out"), ("ipc", "lorasync write_segment\n+ read_segment (2nd process)"), ("ipc_1t", "same, 1 torch thread")]
    ax2.barh(range(len(ipc)), [times[k].median * 1e3 for k, _ in ipc], color=["#999999", "#bbbbbb", "#1f5fa8", "#4a90d9"])
    ax2.set_yticks(range(len(ipc)), [lbl for _, lbl in ipc])
    ax2.set_xlabel("ms (median)")
    ax2.set_title("IPC handoff to a 2nd process")
    ax2.grid(True, axis="x", alpha=0.3)


if __name__ == "__main__":  # pragma: no cover
    from benchmarks._runner import main

    raise SystemExit(main(NAME))
