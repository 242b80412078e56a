"""lorasync's vLLM worker extension plus one test-only method: read back what vLLM holds for an
adapter in its LoRA slots (the MoE experts' stacked buffers, the router's and attention's).

vLLM's CPU build cannot run a forward pass of MoE LoRA (its MoE LoRA kernel is Triton-only), so
the MoE tests compare these buffers with the adapter instead of tokens. Loaded with
``worker_extension_cls="tests.engines.vllm_moe_ext.MoEProbeExtension"`` (the repository root is on
the engine's PYTHONPATH). Tensors travel as raw float32 bytes with their shape: the RPC answer
must be plain data.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from lorasync.engines.vllm.worker import LoraSyncWorkerExtension


def _wire(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to("cpu", torch.float32).contiguous()
    return {"shape": list(t.shape), "data": base64.b64encode(t.numpy().tobytes()).decode()}


class MoEProbeExtension(LoraSyncWorkerExtension):
    def moe_probe_buffers(self, lora_id: int) -> dict[str, Any]:
        """The slot buffers of LoRA ``lora_id``, activated first (vLLM's own ``activate_adapter``
        copies the cached weights into a slot with each layer's ``set_lora``).

        Returns ``{"experts": {module: {"w1_a", "w1_b", "w3_a", "w3_b", "w2_a", "w2_b"}}, "linear":
        {module: {"a": [...], "b": [...]}}, "scaling_folded": True}``: experts as
        ``[experts, rank, in]`` / ``[experts, out, rank]``, linears per packed slice.
        """
        from vllm.lora.layers import FusedMoEWithLoRA

        manager = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        manager.activate_adapter(lora_id)
        index = manager.lora_index_to_id.index(lora_id)
        experts: dict[str, Any] = {}
        linear: dict[str, Any] = {}
        for name, module in manager.modules.items():
            if isinstance(module, FusedMoEWithLoRA):
                a13, b13 = module.w13_lora_a_stacked, module.w13_lora_b_stacked
                experts[name] = {
                    "w1_a": _wire(a13[0][index]), "w1_b": _wire(b13[0][index]),
                    "w3_a": _wire(a13[-1][index]), "w3_b": _wire(b13[-1][index]),
                    "w2_a": _wire(module.w2_lora_a_stacked[0][index]), "w2_b": _wire(module.w2_lora_b_stacked[0][index]),
                }  # fmt: skip
            elif hasattr(module, "lora_a_stacked") and isinstance(module.lora_a_stacked, (tuple, list)):
                linear[name] = {
                    "a": [_wire(a[index, 0]) for a in module.lora_a_stacked],
                    "b": [_wire(b[index, 0]) for b in module.lora_b_stacked],
                }
        return {"experts": experts, "linear": linear}

    def moe_probe_router_paths(self) -> dict[str, Any]:
        """Who the forward pass reaches for each LoRA-wrapped MoE router (``...mlp.gate``): every
        attribute path in the model that holds the LoRA wrapper, and every one that still holds
        the bare gate (besides the wrapper's own ``base_layer``). The MoE runner computes the
        routing through its own reference to the gate, so router LoRA is applied only when that
        reference is the wrapper. ``fused_gate``: runners that concatenate raw gate weights (a
        shared-expert gate), which bypasses any wrapper."""
        manager = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        model = self.model_runner.model  # type: ignore[attr-defined]
        paths = list(model.named_modules(remove_duplicate=False))
        out: dict[str, Any] = {}
        for name, wrapper in manager.modules.items():
            if not name.endswith(".mlp.gate"):
                continue
            base = getattr(wrapper, "base_layer", None)
            out[name] = {
                "wrapper_at": sorted(p for p, m in paths if m is wrapper),
                "bare_at": sorted(p for p, m in paths if base is not None and m is base and not p.endswith(".base_layer")),
                "fused_gate": sorted(p for p, m in paths if getattr(m, "_fse_fuse_gate", False) and getattr(m, "gate", None) is wrapper),
            }
        return out
