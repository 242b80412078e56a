"""A Fleet round over file-loading engines reports a tenant "unchanged" under a served name that
no engine serves, when the trainer steps away and back (ABA) between the round's hash and its
publish; every later round with those weights then fails.

Trainer: a tentative SGD step (B) that it rejects right away, putting the weights back (A, the
version the engine serves). The round's unchanged check hashes B -> "changed"; the tenant's
publish (transport="disk", no owned copy) reads the trainer's memory again, finds A, which the
engine already serves as a@v1, and moves nothing. The round still moves the tenant to v2:
TenantReport(status="unchanged", version=2, served_name="a@v2"), tenant.lease() yields "a@v2",
but the engine lists only "a@v1" and v2's files were discarded. The next round (same weights)
hashes A == the tenant's recorded hash, calls it unchanged, finds a@v2 "lost" and fails to
restore it from files that are gone (StorageError), and so on for every round until the weights
change.

The revert is timed by the engine's listing (a round over an engine with an adapter limit hashes
every tenant, then lists the engines, then publishes): a real trainer thread hits the same window
by chance (see the note at the end; ~2 runs in 3 within 400 rounds).

Run: python tests/fleet/repros/fleet_files_aba_unchanged_names_unserved_version.py
Exits 1 when the bug shows.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from lorasync import Fleet
from lorasync.engines.peft import PeftEngine
from lorasync.exporters.fsdp import export
from lorasync.testing import make_tiny_model
from tests.reliability._trust import lora_params, optimizer_step, trainer

root = Path(tempfile.mkdtemp())
make_tiny_model(root / "m")
model = trainer(root / "m", seed=1)
params = lora_params(model)
optimizer = torch.optim.SGD(params, lr=0.05)
revert_now: list = []


class Engine(PeftEngine):
    """The real in-process PEFT engine; its listing only marks the moment the trainer's revert lands."""

    def list_adapters(self) -> list[str]:
        if revert_now:
            revert_now.pop()()
        return super().list_adapters()


engine = Engine(base_model_path=root / "m", max_loras=4)
problems = []
with Fleet([engine], root=root / "store", transport="disk") as fleet:
    fleet.register("a", keep=2, grace=0.0)
    first = fleet.publish({"a": export(model)}, versions={"a": 1})["a"]
    assert first.status == "loaded", first

    keep = [p.detach().clone() for p in params]
    optimizer_step(optimizer, model, seed=5)  # the tentative step (B)

    def reject() -> None:  # the trainer puts the weights back (A): a loss that went up
        with torch.no_grad():
            for p, k in zip(params, keep):
                p.copy_(k)

    revert_now.append(reject)
    report = fleet.publish({"a": export(model)}, versions={"a": 2})["a"]
    listed = engine.list_adapters()
    print("round 2:", report.status, "version", report.version, "served_name", report.served_name, "| engine lists", listed)
    if report.ok and report.served_name not in listed:
        problems.append(f"round 2 reports {report.status!r} with served_name {report.served_name!r}, which no engine serves (engine lists {listed})")
    with fleet.tenants["a"].lease() as name:
        if name not in listed:
            problems.append(f"tenant.lease() yields {name!r}, not served")
    for version in (3, 4):
        again = fleet.publish({"a": export(model)}, versions={"a": version})["a"]
        print(f"round {version}:", again.status, repr(again.error)[:160])
        if not again.ok:
            problems.append(f"round {version} (weights unchanged, engine healthy) fails: {again.error!r}"[:220])
engine.close()
for p in problems:
    print("BUG:", p)
sys.exit(1 if problems else 0)
