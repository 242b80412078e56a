"""Transport selection: one function from (what was asked, the engine's capabilities, the adapter)
to the transport that will serve it, with the reason reported to the user."""

from __future__ import annotations

from collections.abc import Mapping

from lorasync.adapter._adapter import Adapter
from lorasync.engines._engine import Capabilities, Engine
from lorasync.errors import AdapterRejectedError, CapabilityError, ConfigError, LoraNotEnabledError, LoraSyncError, RuntimeLoraDisabledError
from lorasync.transports._transport import Transport

__all__ = ["TRANSPORTS", "choose_transport"]

TRANSPORTS = ("auto", "disk", "ipc", "merged")

# What each transport needs of an engine, by Capabilities field, in the order a fix is told.
_NEEDS = {
    "disk": ("lora", "runtime_lora", "same_host"),
    "ipc": ("lora", "runtime_lora", "tensor_load", "same_host"),
    "merged": ("weight_update",),
    "in_place": ("lora", "runtime_lora", "load_inplace"),
}
_MERGED_NEEDS_BASE = "pass base= (the pristine base checkpoint the engine serves, or BaseWeights; CLI: --base DIR)"


def _fix(engine: Engine, caps: Capabilities, transports: tuple[str, ...]) -> str:
    """``"; to fix: ..."`` from the engine's own remedies for what ``transports`` need and
    ``caps`` lacks (empty when the engine names none)."""
    missing = [need for t in transports for need in _NEEDS.get(t, ()) if not getattr(caps, need, True)]
    remedies = list(dict.fromkeys(r for need in missing if (r := engine.remedies.get(need))))
    return f"; to fix: {'; or '.join(remedies)}" if remedies else ""


def choose_transport(
    requested: str,
    engine: Engine,
    caps: Capabilities,
    adapter: Adapter,
    candidates: Mapping[str, Transport | None],
    *,
    in_place: Transport | None = None,
) -> tuple[Transport, str]:
    """Pick the transport for one engine.

    Args:
        requested (`str`): ``"auto"`` or a transport name from ``TRANSPORTS``.
        engine (`Engine`): whose ``check_adapter`` rules apply to every LoRA transport.
        caps (`Capabilities`): the engine's capabilities.
        adapter (`Adapter`): what will be published.
        candidates (`Mapping[str, Transport | None]`): ``disk``, ``ipc`` and ``merged`` (None: not
            configured, e.g. no base weights for merged).
        in_place (`Transport`, *optional*): the in-place transport, when the publisher serves one
            plain name.

    Returns:
        ``(transport, reason)``.

    Raises:
        CapabilityError, ConfigError, AdapterRejectedError, LoraNotEnabledError: nothing can serve it;
            each message says what to change (the engine's flag or variable, ``base=``,
            ``transport=``).
        RuntimeLoraDisabledError (a CapabilityError): LoRA is on but the engine cannot load
            adapters while running, and no merged fallback is configured.
    """
    if in_place is not None:
        why = in_place.unsupported(caps)
        if why is not None:
            raise CapabilityError(
                f"{caps.engine} at {caps.url or '?'}: {why}{_fix(engine, caps, ('in_place',))}; or publish versioned "
                "names (in_place=False, the default)",
                engine=caps.engine,
                url=caps.url,
            )
        engine.check_adapter(adapter, caps)
        return in_place, "in place: the name switched atomically"
    if requested != "auto":
        chosen = candidates[requested]
        if chosen is None:
            raise ConfigError(f"transport='merged' needs base=: {_MERGED_NEEDS_BASE}")
        why = chosen.unsupported(caps)
        if why is not None:
            fix = _fix(engine, caps, (requested,))
            other = "" if requested == "disk" or "transport=" in fix else "; or publish with transport='auto'"
            raise CapabilityError(
                f"transport {requested!r} cannot serve {caps.engine} at {caps.url or '?'}: {why}{fix}{other}",
                engine=caps.engine,
                url=caps.url,
            )
        if chosen.versioned:
            engine.check_adapter(adapter, caps)
        return chosen, "requested"
    lora_refusal: LoraSyncError | None = None
    try:
        engine.check_adapter(adapter, caps)
    except (AdapterRejectedError, LoraNotEnabledError) as exc:
        lora_refusal = exc
    if lora_refusal is None:
        # A GPU adapter goes device to device where the engine takes tensors on this host (CUDA
        # IPC into the worker's GPU, or straight into an in-process worker): no byte crosses the
        # host, which a disk publish of GPU tensors would cost (design invariant 14).
        on_gpu = caps.tensor_load and caps.device_tensors and _one_gpu(adapter)
        order = ("ipc", "disk") if caps.in_process or on_gpu else ("disk", "ipc")
        for name in order:
            transport = candidates[name]
            if transport is not None and transport.unsupported(caps) is None:
                if name == "ipc":
                    if caps.in_process:
                        why = "in-process engine: tensors handed over directly"
                    elif on_gpu:
                        why = "GPU adapter, engine on this host: CUDA IPC into the engine's GPU (no host copy)"
                    else:
                        why = "engine loads adapters from shared memory"
                else:
                    why = "engine loads LoRA at runtime from this host's tmpfs"
                return transport, why
    merged = candidates.get("merged")
    if merged is not None and merged.unsupported(caps) is None:
        return merged, f"merged fallback: {lora_refusal or 'engine cannot load this adapter at runtime'}"
    if lora_refusal is not None:
        raise lora_refusal
    reasons = "; ".join(f"{n}: {t.unsupported(caps) if t else 'needs base='}" for n, t in candidates.items())
    fixes = [_fix(engine, caps, ("ipc",) if caps.in_process else ("disk",)).removeprefix("; to fix: ")]
    merged_fix = _fix(engine, caps, ("merged",)).removeprefix("; to fix: ")
    if merged is None:
        merged_fix = _MERGED_NEEDS_BASE + (f" and {merged_fix}" if merged_fix else "")
    fixes.append(f"for merged updates of the base weights instead: {merged_fix}" if merged_fix else "")
    fix = "; or ".join(f for f in fixes if f)
    cls = RuntimeLoraDisabledError if caps.lora and not caps.runtime_lora else CapabilityError
    raise cls(
        f"no transport can reach {caps.engine} at {caps.url or '?'} ({reasons})" + (f"; to fix: {fix}" if fix else ""),
        engine=caps.engine,
        url=caps.url,
    )


def _one_gpu(adapter: Adapter) -> bool:
    """Whether every tensor of ``adapter`` lives on one and the same GPU."""
    devices = {t.device for t in adapter.tensors.values()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"
