"""GPU trainer, file-loading engine (transport="disk"): every Fleet round whose weights did not
change reports the tenant "unchanged" under a served name that no engine serves; the tenant moves
to a version that was never loaded.

The round's unchanged check (lorasync/_fleet_hash.py content_hash) hashes a CUDA adapter through
Adapter.content_hash, which for tensors on one GPU is the device hash ("dev128:..."), while the
tenant's recorded hash comes from the disk write pass ("xxh3-128:...", the host bytes). The two
kinds never compare equal (by design: "at worst published again"), so every round is "changed"
and publishes vN+1; the publisher's ledger sees identical xxh3 content already served as vN and
moves nothing (status "unchanged", served_name name@vN). Fleet's step() then moves the tenant to
vN+1 anyway: TenantReport(status="unchanged", version=N+1, served_name="name@vN+1"), lease()
yields name@vN+1, and the engine lists only name@vN. So it is not "at worst published again":
every unchanged round on a GPU trainer with a file-loading engine (a vLLM server loading LoRA
from tmpfs, the usual deployment) names a version that does not exist.

Same step() flaw as fleet_files_aba_unchanged_names_unserved_version.py, here deterministic, no
race, no second thread. Needs CUDA (exits 77 without it).

Run: python tests/fleet/repros/fleet_gpu_adapter_files_unchanged_names_unserved_version.py
Exits 1 when the bug shows.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    print("needs a CUDA GPU")
    sys.exit(77)

from transformers import AutoModelForCausalLM

from lorasync import Fleet
from lorasync.engines.peft import PeftEngine
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model

root = Path(tempfile.mkdtemp())
make_tiny_model(root / "m")
model = make_peft_model(AutoModelForCausalLM.from_pretrained(root / "m"), seed=1).to("cuda")  # the trainer, on the GPU
engine = PeftEngine(base_model_path=root / "m")  # loads the files the disk transport writes
problems = []
with Fleet([engine], root=root / "store", transport="disk") as fleet:
    fleet.register("a", keep=2, grace=0.0)
    adapter = export(model)
    print("adapter on", {t.device for t in adapter.tensors.values()}, "| check hash", adapter.content_hash[:16])
    first = fleet.publish({"a": adapter}, versions={"a": 1})["a"]
    print("round 1:", first.status, first.served_name, "recorded", fleet.tenants["a"].content_hash[:16])
    for version in (2, 3, 4):  # the trainer did not step: nothing changed
        report = fleet.publish({"a": export(model)}, versions={"a": version})["a"]
        listed = engine.list_adapters()
        with fleet.tenants["a"].lease() as leased:
            pass
        print(f"round {version}:", report.status, "version", report.version, "served_name", report.served_name, "| lease", leased, "| engine lists", listed)
        if report.ok and (report.served_name not in listed or leased not in listed):
            problems.append(f"round {version}: {report.status!r}, served_name {report.served_name!r} / lease {leased!r} not served (engine lists {listed})")
engine.close()
for p in problems:
    print("BUG:", p)
sys.exit(1 if problems else 0)
