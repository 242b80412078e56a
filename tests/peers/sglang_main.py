"""The contract peer's ``--lora-protocol streamed`` mode: SGLang main's streamed adapters (PR #36384).

SGLang main cannot be installed here or in CI (no release after 0.5.23 on PyPI, and its
repository snapshot is over the fetch limit), so this mode runs SGLang 0.5.23's real app, request
classes, registry, LoRA manager checks and weight-update session with the routes and rules of
SGLang main as recorded in ``sglang_main_facts.json`` (routes, fields, messages; no SGLang code):

* ``/load_lora_adapter_from_tensors`` is gone; ``POST /register_lora_adapter {lora_name,
  config_dict, pinned}`` creates a name with zero weights (SGLang's own
  ``LoRAManager._load_lora_adapter_from_tensors`` validates it), or zeroes an existing one again;
  a new name past ``--max-loaded-loras`` is refused, and streamed adapters are never LRU-evicted.
* ``/update_weights_from_tensor`` inside SGLang's own begin/end session takes tensors named
  ``"{lora_name}:{key}"`` into a per-session stash (a ``lora_A``/``lora_B`` tensor without the
  prefix is refused); ``end_weight_update`` closes the session, then applies each stashed
  adapter whole (refusing a tensor set that differs from the adapter's previous one).

``GET /_contract/stash`` shows the stash and the applied tensor sets (sha256 per key), so tests
compare what SGLang holds with what the trainer sent.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict

__all__ = ["FACTS", "StreamedLoRA", "install_routes"]

FACTS: dict[str, Any] = json.loads((Path(__file__).with_name("sglang_main_facts.json")).read_text())


def _sha256(tensor: Any) -> str:
    import torch

    return hashlib.sha256(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


class StreamedLoRA:
    """The scheduler half: registration with zero weights, the stash and its application."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.refs: dict[str, Any] = {}  # lora_name -> LoRARef (its lora_id is the tokenizer's)
        self.configs: dict[str, dict[str, Any]] = {}
        self.stash: dict[str, dict[str, Any]] = {}
        self.applied: dict[str, frozenset[str]] = {}
        self.digests: dict[str, dict[str, str]] = {}  # lora_name -> {key: sha256} of the applied weights

    def _zeros(self, config: dict[str, Any]) -> dict[str, Any]:
        """Zero lora_A/lora_B for every target module of every layer (SGLang's fresh adapter)."""
        import torch

        r = int(config["r"])
        targets = set(config.get("target_modules") or [])
        out = {}
        for path, module in self.scheduler.model.named_modules():
            if path.rsplit(".", 1)[-1] in targets and hasattr(module, "in_features"):
                out[f"base_model.model.{path}.lora_A.weight"] = torch.zeros(r, module.in_features)
                out[f"base_model.model.{path}.lora_B.weight"] = torch.zeros(module.out_features, r)
        return out

    def _install(self, name: str, tensors: dict[str, Any]) -> Any:
        lm = self.scheduler.lora_manager
        ref = self.refs[name]
        if ref.lora_id in lm.loras:
            lm._unload_lora_adapter(ref)
        return lm._load_lora_adapter_from_tensors(ref, tensors, self.configs[name], None)

    def register(self, ref: Any, config: dict[str, Any]) -> Any:
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        try:
            zeros = self._zeros(config)
        except (KeyError, TypeError, ValueError) as exc:
            return LoRAUpdateOutput(success=False, error_message=f"invalid config_dict: {exc!r}")
        old = (self.refs.get(ref.lora_name), self.configs.get(ref.lora_name))
        self.refs[ref.lora_name], self.configs[ref.lora_name] = ref, dict(config)
        out = self._install(ref.lora_name, zeros)
        if not out.success:  # SGLang's own validation refused the config: nothing changes
            if old[0] is None:
                self.refs.pop(ref.lora_name, None)
                self.configs.pop(ref.lora_name, None)
            else:
                self.refs[ref.lora_name], self.configs[ref.lora_name] = old  # type: ignore[assignment]
            return out
        self.applied.pop(ref.lora_name, None)  # a re-registered name is a new identity
        self.digests[ref.lora_name] = {k: _sha256(t) for k, t in zeros.items()}
        return out

    def forget(self, name: str) -> None:
        for table in (self.refs, self.configs, self.applied, self.digests):
            table.pop(name, None)

    def split(self, named_tensors: Any) -> tuple[list[tuple[str, Any]], str | None]:
        """Stash the prefixed tensors (copied); return the base ones, or a refusal."""
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        base = []
        for key, tensor in items:
            if ":" in key:
                name, hf_key = key.split(":", 1)
                self.stash.setdefault(name, {})[hf_key] = tensor.detach().clone()
            elif ".lora_A." in key or ".lora_B." in key:
                return [], FACTS["stream"]["unprefixed_lora_tensor"].format(name=key)
            else:
                base.append((key, tensor))
        return base, None

    def apply(self) -> tuple[bool, str]:
        stash, self.stash = self.stash, {}
        if stash and not self.scheduler.lora_enabled:
            return False, FACTS["stream"]["needs_lora"]
        for name in sorted(stash):
            tensors = stash[name]
            if name not in self.refs:
                return False, f"streamed adapter {name!r} is not registered; call /register_lora_adapter first"
            names = frozenset(tensors)
            previous = self.applied.get(name)
            if previous is not None and previous != names:
                return False, FACTS["stream"]["partial_stream"].format(name=name)
            out = self._install(name, tensors)
            if not out.success:
                self._install(name, self._zeros(self.configs[name]))  # the identity stays, zeroed
                return False, out.error_message
            self.applied[name] = names
            self.digests[name] = {k: _sha256(t) for k, t in tensors.items()}
        return True, "Success"

    def view(self) -> dict[str, Any]:
        return {
            "stash": {name: sorted(t) for name, t in self.stash.items()},
            "applied": {name: sorted(keys) for name, keys in self.applied.items()},
            "digests": self.digests,
            "registered": sorted(self.refs),
        }


def install_routes(app: Any, manager: Any) -> None:
    """SGLang main's route set on SGLang 0.5.23's app: drop the removed routes, add registration."""
    from fastapi import Body, Request
    from fastapi.responses import ORJSONResponse
    from typing_extensions import Annotated

    from sglang.srt.utils.auth import AuthLevel, auth_level
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    removed = set(FACTS["routes"]["removed"])
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in removed]
    app.openapi_schema = None  # rebuilt from the routes now served

    register_struct = _register_struct()

    async def register_lora_adapter(obj: Any, request: Request) -> Any:
        """Create or refresh a streamed LoRA adapter's identity and config (weights zeroed)."""
        result = await manager.register_lora_adapter(obj)
        return ORJSONResponse(msgspec_to_builtins(result), status_code=200 if result.success else 400)

    # Real types for FastAPI (this module's annotations are strings; the struct is local).
    register_lora_adapter.__annotations__ = {"obj": Annotated[register_struct, Body()], "request": Request}
    register_lora_adapter = auth_level(AuthLevel.ADMIN_OPTIONAL)(register_lora_adapter)

    app.add_api_route("/register_lora_adapter", register_lora_adapter, methods=["POST"])


def _register_struct() -> Any:
    """``RegisterLoRAAdapterReqInput`` with the recorded fields, on SGLang's request base class."""
    from sglang.srt.managers.io_struct import BaseReq

    fields = FACTS["structs"]["RegisterLoRAAdapterReqInput"]
    assert set(fields) == {"lora_name", "config_dict", "pinned"}, fields

    class RegisterLoRAAdapterReqInput(BaseReq, kw_only=True):
        lora_name: str
        config_dict: Dict[str, Any]
        pinned: bool = False

    return RegisterLoRAAdapterReqInput


async def register_lora_adapter(manager: Any, obj: Any) -> Any:
    """The tokenizer half of registration (TokenizerManager.register_lora_adapter on main)."""
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.managers.io_struct import LoRAUpdateOutput
    from sglang.srt.runtime_context import get_lora

    manager.auto_create_handle_loop()
    try:
        if not get_lora().enable_lora:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        async with manager.lora_update_lock:
            registered = manager.lora_registry.get_all_adapters()
            existing = registered.get(obj.lora_name)
            cap = get_lora().max_loaded_loras
            count = manager.lora_registry.num_registered_loras
            if existing is None and cap is not None and count >= cap:
                raise ValueError(FACTS["register"]["refusal_at_cap"].format(name=obj.lora_name, count=count, cap=cap))
            ref = existing or LoRARef(lora_name=obj.lora_name, lora_path=FACTS["register"]["lora_path"], pinned=obj.pinned)
            result = manager.scheduler.streamed.register(ref, obj.config_dict)
            if result.success and existing is None:
                await manager.lora_registry.register(ref)
                manager.lora_ref_cache[obj.lora_name] = ref
            return result
    except ValueError as exc:
        return LoRAUpdateOutput(success=False, error_message=str(exc))


def never_evict_streamed(registry: Any) -> None:
    """0.5.23's registry evicts the least recently used unpinned adapter; main skips streamed ones."""
    stream_path = FACTS["register"]["lora_path"]

    async def lru_lora_name(exclude_pinned: bool = False) -> str | None:
        async with registry._registry_lock.reader_lock:
            for lora_name, ref in registry._registry.items():
                if ref.lora_path == stream_path or (exclude_pinned and ref.pinned):
                    continue
                return str(lora_name)
            return None

    registry.lru_lora_name = lru_lora_name
