"""Transport selection: one function from (what was asked, the engine's capabilities, the adapter)
to the transport that will serve it, with the reason reported to the user."""

from __future__ import annotations

from collections.abc import Mapping

from lorasync._adapter import Adapter
from lorasync.engines._engine import Capabilities, Engine
from lorasync.errors import AdapterRejectedError, CapabilityError, ConfigError, LoraNotEnabledError, LoraSyncError
from lorasync.transports._transport import Transport

__all__ = ["TRANSPORTS", "choose_transport"]

TRANSPORTS = ("auto", "disk", "ipc", "merged")


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
        CapabilityError, ConfigError, AdapterRejectedError, LoraNotEnabledError: nothing can serve it.
    """
    if in_place is not None:
        why = in_place.unsupported(caps)
        if why is not None:
            raise CapabilityError(f"{caps.engine} at {caps.url or '?'}: {why}", engine=caps.engine, url=caps.url)
        engine.check_adapter(adapter, caps)
        return in_place, "in place: the name switched atomically"
    if requested != "auto":
        chosen = candidates[requested]
        if chosen is None:
            raise ConfigError("transport='merged' needs base= (the pristine base checkpoint or BaseWeights)")
        why = chosen.unsupported(caps)
        if why is not None:
            raise CapabilityError(f"transport {requested!r} cannot serve {caps.engine} at {caps.url or '?'}: {why}", engine=caps.engine, url=caps.url)
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
        on_gpu = caps.tensor_load and caps.same_host and _one_gpu(adapter)
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
    raise CapabilityError(
        f"no transport can reach {caps.engine} at {caps.url or '?'}: "
        + "; ".join(f"{n}: {t.unsupported(caps) if t else 'needs base='}" for n, t in candidates.items()),
        engine=caps.engine,
        url=caps.url,
    )


def _one_gpu(adapter: Adapter) -> bool:
    """Whether every tensor of ``adapter`` lives on one and the same GPU."""
    devices = {t.device for t in adapter.tensors.values()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"
