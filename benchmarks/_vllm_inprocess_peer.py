"""The engine-venv side of :mod:`benchmarks.vllm_inprocess`: a ``vllm.LLM`` in this process,
interleaved rounds of publish → first completion, samples written as JSON.

Run by ``benchmarks.vllm_inprocess`` with the engine venv's python (vLLM is not importable from
the library venv): ``python -m benchmarks._vllm_inprocess_peer SPEC.json``. It builds the LLM,
prints ``ready`` on stdout, waits for ``go`` on stdin (so its start-up can overlap the HTTP
server's and its rounds never overlap another measurement), runs the rounds and writes
``spec["result"]``. Only the standard library is imported at module level.

Ways, one round each in rotating order, each followed by one ``llm.generate`` (max_tokens=1,
temperature 0) on the new weights whose token is checked against the trainer's:

* ``in-process`` — ``Publisher(engine, keep=2).publish(Adapter(...))`` with the default transport
  (``auto``: tensors through ``collective_rpc`` and the worker extension), then
  ``llm.generate(..., lora_request=engine.lora_request(served))``;
* ``in-process disk`` — the same with ``transport="disk"`` (a store on tmpfs, ``add_lora`` of the
  directory);
* ``in-process bare add_lora`` — what colocated users do today without lorasync:
  ``peft_model.save_pretrained(dir)``, ``llm.llm_engine.add_lora(LoRARequest(name, id, dir))``,
  ``remove_lora`` of step−2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("in-process", "in-process disk", "in-process bare add_lora")
LLM_ARGS: dict[str, Any] = dict(
    enable_lora=True,
    max_lora_rank=16,
    max_loras=4,
    max_cpu_loras=8,
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    max_num_seqs=4,
)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from lorasync import Adapter, Publisher
    from lorasync.engines import connect
    from lorasync.engines.vllm import WORKER_EXTENSION

    llm = LLM(model=spec["base_dir"], worker_extension_cls=WORKER_EXTENSION, **LLM_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = [int(t) for t in spec["prompt"]]

    def first_token(request: Any) -> int:
        out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=request, use_tqdm=False)
        return int(out[0].outputs[0].token_ids[0])

    first_token(None)  # the first request compiles
    startup = time.perf_counter() - t0
    # One engine object for both publishers: vLLM keys adapters by integer id, and each engine
    # object numbers its own loads.
    engine = connect("vllm-inprocess", llm=llm)
    adapters = [Adapter.load(d) for d in spec["adapters"]]
    peft_models = _peft_models(spec["base_dir"], spec["peft_dirs"])
    work = Path(spec["work"])
    pubs = {
        "in-process": Publisher(engine, name="bench-inproc", root=work / "store-auto", keep=2),
        "in-process disk": Publisher(engine, name="bench-inproc-disk", transport="disk", root=work / "store-disk", keep=2),
    }
    bare: list[tuple[int, Path]] = []
    samples = {m: {"publish": [], "first": [], "total": [], "served_new": [], "token": [], "stages": [], "transport": []} for m in MODES}
    refs = spec["refs"]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    t_rounds = time.perf_counter()
    repeats, warmup = int(spec["repeats"]), int(spec["warmup"])
    try:
        for i in range(warmup + repeats):
            which = i % 2
            order = MODES[i % 3 :] + MODES[: i % 3]  # no way always runs right after the same other
            for mode in order:
                start = time.perf_counter()
                if mode in pubs:
                    fresh = Adapter(adapters[which].tensors, adapters[which].config)  # hash not cached
                    report = pubs[mode].publish(fresh, version=i + 1).raise_for_errors()
                    request = engine.lora_request(report.served_name)
                    transport = report.results[0].transport
                    stages = {**{k: v for k, v in report.timings.items() if k != "total"}, **report.results[0].timings}
                else:
                    path = work / "bare" / f"step{i}"
                    peft_models[which].save_pretrained(str(path))
                    saved = time.perf_counter()
                    request = LoRARequest(lora_name=f"bare-{i}", lora_int_id=100_000 + i, lora_path=str(path))
                    if not llm.llm_engine.add_lora(request):
                        raise RuntimeError(f"add_lora({path}) returned False")
                    bare.append((request.lora_int_id, path))
                    if len(bare) > 2:
                        old_id, old_path = bare.pop(0)
                        llm.llm_engine.remove_lora(old_id)
                        shutil.rmtree(old_path, ignore_errors=True)
                    transport, stages = "files (PEFT dir)", {"save_pretrained": saved - start, "add_lora + remove_lora": time.perf_counter() - saved}
                published = time.perf_counter()
                token = first_token(request)
                done = time.perf_counter()
                if i >= warmup:
                    s = samples[mode]
                    for key, value in (("publish", published - start), ("first", done - published), ("total", done - start), ("token", token), ("served_new", token == refs[which]), ("stages", stages), ("transport", transport)):
                        s[key].append(value)
    finally:
        for pub in pubs.values():
            pub.close()
    rounds = time.perf_counter() - t_rounds
    partial = Path(spec["result"] + ".partial")
    partial.write_text(json.dumps({"modes": samples, "startup_s": startup, "rounds_s": rounds, "vllm": _version()}))
    os.replace(partial, spec["result"])  # the parent polls for the file: it appears whole
    return 0


def _peft_models(base_dir: str, peft_dirs: list[str]) -> list[Any]:
    """The trainer's PEFT models, rebuilt from their ``save_pretrained`` directories."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return [PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), d) for d in peft_dirs]


def _version() -> str:
    import vllm

    return str(vllm.__version__)


if __name__ == "__main__":  # vLLM starts its engine core in a child process: guard the top level
    raise SystemExit(main(sys.argv[1]))
