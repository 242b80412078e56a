"""The canonical adapter and what describes it: :class:`~._adapter.Adapter` (HF PEFT tensors
and config, validated, hashed), its config (:mod:`._config`), the PEFT key grammar
(:mod:`._keys`), served names and versions (:mod:`._names`), the MoE forms (:mod:`._moe`,
:mod:`._moe_peft`) and the trainer's :class:`~._probe.Probe`. ``lorasync.transforms`` (public)
builds on these.

May import: :mod:`lorasync.errors`, :mod:`lorasync.wire`, :mod:`lorasync.runtime`.
"""
