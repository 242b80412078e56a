"""What the vLLM clients do differently per release, where a release serves adapters in a way
lorasync depends on (the table is ``_lora_compat.RELEASES``; docs/engines/vllm.md has it too).

* ``LoRARequest`` equality (name alone before 0.34): loading a name again while requests of its
  unloaded version still run gives vLLM two LoRA ids it takes for one adapter. The HTTP client
  refuses such a load on those releases (:func:`refuse_name_in_use`); the in-process engine asks
  its frontend (``_frontend.Frontend.check_name_free``).
* ``load_inplace`` persisted (0.32 and before): :func:`warn_inplace` says what it costs there.
* Unload keeps the slot (every release through 0.34.0): :func:`notes`.

Operations here are sans-IO, like the client's own (they yield ``Call``s).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from lorasync.engines._http import Call, Operation, body_json
from lorasync.engines.vllm._errors import dig
from lorasync.engines.vllm._lora_compat import LoaderRules, rules_for
from lorasync.errors import AdapterAlreadyLoadedError, LoraSyncWarning


__all__ = ["notes", "refuse_name_in_use", "reused_name_error", "server_version", "warn_inplace"]


def notes(rules: LoaderRules) -> list[str]:
    """What ``capabilities().notes`` says of a release's unload and ``load_inplace``."""
    out = []
    if not rules.unload_frees:
        out.append("unload forgets the name but keeps the weights in the engine's LoRA cache until evicted (vLLM #54839)")
    if rules.inplace_persists:
        out.append("load_inplace re-reads the adapter files on every step (vLLM 0.32 and before); versioned names are used instead")
    else:
        out.append(
            "load_inplace swaps the weights under running requests (no longer re-read every step since vLLM 0.33); "
            "versioned names are used instead"
        )
    if not rules.request_identity_has_id:
        out.append("a name is loaded again only once no request of its unloaded version runs (LoRARequest equality, vLLM before 0.34)")
    return out


def server_version() -> Operation[str | None]:
    """The server's ``/version`` (None when it does not say)."""
    response = yield Call("GET", "/version")
    version = dig(body_json(response), "version") if response.status_code == 200 else None
    return str(version) if version else None


def warn_inplace(url: str, name: str, path: str) -> Operation[None]:
    """Warn, on a release that keeps ``load_inplace`` set (or one that does not say), what an
    in-place load costs there (the server at ``url``)."""
    version = yield from server_version()
    if rules_for(version).inplace_persists:
        warnings.warn(
            f"vLLM {version or '(version unknown)'} at {url} keeps load_inplace=True on the request it caches for "
            f"{name!r}, so its worker re-reads {path} on every step: keep those files until the name is unloaded "
            "(deleting them kills the EngineCore), and a reload from the same path may serve stale prefix-cache blocks. "
            "vLLM 0.33 fixed the re-reading; publish versioned names instead (the Publisher's default)",
            LoraSyncWarning,
            stacklevel=4,
        )


def reused_name_error(kind: str, url: str, name: str, version: str | None) -> AdapterAlreadyLoadedError:
    """The refusal of a load of ``name`` while requests of its unloaded version still run."""
    return AdapterAlreadyLoadedError(
        f"{kind} at {url}: requests of the unloaded {name!r} are still running, and vLLM "
        f"{version or '(version unknown)'} tells adapters apart by name alone (LoRARequest equality; 0.34 adds the "
        f"LoRA id): loading {name!r} again now gives it a second LoRA id that vLLM takes for the first, so one of "
        "them would run on the other's slot or the EngineCore would die. Nothing was loaded: wait until "
        f"adapters_in_use() no longer lists {name!r} and load again, load under a new versioned name, or run vLLM 0.34+",
        engine=kind,
        url=url,
        adapter=name,
    )


def refuse_name_in_use(name: str, *, kind: str, url: str, in_use: Callable[[], Operation[frozenset[str] | None]]) -> Operation[None]:
    """Before ``name`` is loaded again (this client unloaded it): refuse on a release before 0.34
    while vLLM's ``/metrics`` (``in_use``, the client's own reading of it) still names it among
    running or waiting requests. A server without the gauge cannot be asked, and the load goes
    ahead."""
    version = yield from server_version()
    if rules_for(version).request_identity_has_id:
        return
    names = yield from in_use()
    if names is not None and name in names:
        raise reused_name_error(kind, url, name, version)
