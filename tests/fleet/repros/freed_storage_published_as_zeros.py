"""A no-copy Adapter whose tensor's storage the trainer freed (``untyped_storage().resize_(0)``,
what FSDP's reshard does to the unsharded parameters after forward / when summon_full_params
exits) is published by a Fleet round (transport="disk") as "loaded", and the engine serves zeros
for that tensor. Nothing refuses it.

lorasync refuses tensors without data when an Adapter is built (``_without_data``: meta, fake,
sparse), but a no-copy Adapter's tensors can lose their data afterwards. The round's unchanged
check (``_fleet_hash.content_hash``) reads ``nbytes`` bytes at ``data_ptr()`` (0 here: xxhash
takes the NULL buffer as empty), the write pass writes the file, and the engine loads zeros
where the trainer's weights were. Expected: a typed refusal (AdapterError/ExportError), never a
version "loaded" with bytes the trainer never had.

Lower severity than the other repros (a careless export under FSDP), pre-existing (not from
aa91b4e/302ad5b).

Run: python tests/fleet/repros/freed_storage_published_as_zeros.py
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
from tests.reliability._trust import lora_params, served_lora, trainer

root = Path(tempfile.mkdtemp())
make_tiny_model(root / "m")
model = trainer(root / "m", seed=1)
engine = PeftEngine(base_model_path=root / "m")
adapter = export(model)  # no copy: the trainer's own tensors
name, param = next((n, p) for n, p in model.named_parameters() if ".lora_B" in n)
assert param.abs().sum() > 0
param.untyped_storage().resize_(0)  # the trainer frees the parameter's memory (FSDP reshard)
bug = None
with Fleet([engine], root=root / "store", transport="disk") as fleet:
    fleet.register("a", keep=1, grace=0.0)
    report = fleet.publish({"a": adapter}, versions={"a": 1})["a"]
    print("round:", report.status, repr(report.error)[:200])
    if report.ok:
        served = served_lora(engine, report.served_name)[name.replace(".default.", ".")]
        print("served", name, "->", served.flatten()[:6].tolist())
        bug = f"an adapter whose tensor {name} has no memory left is reported {report.status!r}; the engine serves {'zeros' if not served.any() else 'bytes the trainer never had'} for it"
engine.close()
print("BUG:", bug or "none")
sys.exit(1 if bug else 0)
