"""Export a Megatron-Bridge LoRA adapter (LoRA, CanonicalLoRA, MultiLoRA slots, MoE experts)
to a PEFT :class:`~lorasync.Adapter`.

Offline, :func:`export` takes every rank's adapter state dict at once, keyed by
:class:`ShardKey` (or a ``(pp, tp[, ep[, vp]])`` tuple). Online, :func:`export_distributed`
does the same inside a running job: every rank calls it with its own state dict and process
groups, tensors are gathered one module at a time to ``dst``, and only ``dst`` gets the Adapter.

What the export does, in order (trainer-formats.md §1-3, §6):

1. names → modules through one rule table (``_names.RULES``), whose inverse
   :func:`megatron_name` is derived from it; stage-local layer numbers become global ones;
2. TP gather: column-parallel A on the rank axis, row-parallel A on its input axis, B on its
   output axis; packed ``[n_local, ...]`` expert adapters are also concatenated over EP;
3. max-rank padding is trimmed (and proven zero) when ``rank`` is given;
4. fused tensors are split: QKV de-interleaved per query group, fc1 split per TP rank into
   gate/up; the shared A is copied to every projection; grouped experts get one copy each;
5. ``r`` = rank, ``lora_alpha`` = alpha, ``use_rslora`` = False.

Refused with :class:`~lorasync.errors.InexactExportError`, never approximated: DoRA magnitudes
(``adapter.weight_magnitude``) and expert ``linear_fc2`` adapters at expert-TP > 1 (Megatron
computes something no PEFT LoRA reproduces there). docs/exporters/megatron.md lists what is
supported and refused, each line with the test that backs it.

Layout of this package (each module imports only the ones above it in this list):

- ``_names``: the rule table, name parsing and its inverse;
- ``_inputs``: shard keys, the parallel grid and option values, checked at the public entry;
- ``_layout``: the base model's geometry, layer offsets, fused-tensor splits;
- ``_plan``: the export plan from shard metadata (every value-free check);
- ``_convert``: gathered factors → PEFT tensors and the Adapter;
- ``_export``: the offline :func:`export`; ``_dist``: the collective :func:`export_distributed`.
"""

from lorasync.exporters.megatron._dist import export_distributed
from lorasync.exporters.megatron._export import export
from lorasync.exporters.megatron._names import RULES, MegatronRef, megatron_name
from lorasync.exporters.megatron._inputs import ShardKey

__all__ = ["RULES", "MegatronRef", "ShardKey", "export", "export_distributed", "megatron_name"]
