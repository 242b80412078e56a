"""Every vLLM name lorasync imports, resolved in one place (the import surface).

vLLM moves its modules between releases: 0.33 put the LoRA code under
``vllm/runtime/modeling/lora/`` and the exceptions under ``vllm/foundation/system/``, and keeps
alias shims at the old paths (``vllm/lora/*.py``, ``vllm/exceptions.py``), which a later release
may drop. So lorasync never writes ``from vllm... import ...`` elsewhere (tests/engines/
test_vllm_surface.py checks that), but asks :func:`resolve` for a name:

* **public** names (documented by vLLM: ``vllm.LLM``, ``vllm.SamplingParams``,
  ``vllm.lora.request.LoRARequest``, ``vllm.exceptions``) come from their documented home, and
  from the new module only where that home is gone;
* **private** names (the worker extension's PEFT parsing helpers) come from the module the
  installed version's gate names first (the canonical module from 0.33 on, the old path before),
  then from the others.

Each home is tried in order; a name no home has raises
:class:`~lorasync.errors.CapabilityError` naming the vLLM version and every module tried, before
the engine is touched. tests/engines/test_vllm_surface.py checks :data:`SURFACE` against vLLM
main's source as recorded (tests/engines/data/vllm_main_surface.json, with its commit) and
against the installed vLLM.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from dataclasses import dataclass
from typing import Any

from lorasync.errors import CapabilityError

__all__ = ["SURFACE", "Name", "resolve", "version_text", "vllm_version"]

MOVED_IN = (0, 33)  # the release that moved vLLM's modules behind alias shims


@dataclass(frozen=True)
class Name:
    """One vLLM name lorasync uses.

    Attributes:
        attr: the attribute to take from the module.
        homes: ``(module, since)`` in order of preference; ``since`` is the first vLLM version
            whose gate prefers that module (None: any version).
        public: documented by vLLM (its first home is its public one).
        why: what lorasync uses it for.
    """

    attr: str
    homes: tuple[tuple[str, tuple[int, ...] | None], ...]
    public: bool
    why: str


_LORA = "vllm.runtime.modeling.lora"
SURFACE: dict[str, Name] = {
    "LLM": Name("LLM", (("vllm", None),), True, "the in-process engine's type checks"),
    "SamplingParams": Name("SamplingParams", (("vllm", None),), True, "greedy verification requests"),
    "LoRARequest": Name("LoRARequest", (("vllm.lora.request", None), (f"{_LORA}.request", MOVED_IN)), True, "selecting an adapter in-process"),
    "LoRAAdapterNotFoundError": Name(
        "LoRAAdapterNotFoundError",
        (("vllm.exceptions", None), ("vllm.foundation.system.exceptions", MOVED_IN)),
        True,
        "the worker extension's answer for a staged adapter that is gone",
    ),
    "VLLMNotFoundError": Name(
        "VLLMNotFoundError",
        (("vllm.exceptions", None), ("vllm.foundation.system.exceptions", MOVED_IN)),
        True,
        "the in-process engine's refusal of a retired version, as a not-found error vLLM re-raises as is",
    ),
    "PEFTHelper": Name(
        "PEFTHelper",
        ((f"{_LORA}.peft_helper", MOVED_IN), ("vllm.lora.peft_helper", None)),
        False,
        "validating a staged adapter's config as vLLM does",
    ),
    "parse_fine_tuned_lora_name": Name(
        "parse_fine_tuned_lora_name", ((f"{_LORA}.utils", MOVED_IN), ("vllm.lora.utils", None)), False, "checking staged tensor names"
    ),
    "is_base_embedding_weights": Name(
        "is_base_embedding_weights", ((f"{_LORA}.utils", MOVED_IN), ("vllm.lora.utils", None)), False, "skipping base embedding weights"
    ),
    "LoRAModel": Name(
        "LoRAModel", ((f"{_LORA}.lora_model", MOVED_IN), ("vllm.lora.lora_model", None)), False, "skipping modules as vLLM's disk loader does"
    ),
    "_is_remote_expert_key": Name(
        "_is_remote_expert_key",
        ((f"{_LORA}.lora_model", MOVED_IN), ("vllm.lora.lora_model", None)),
        False,
        "skipping other expert-parallel ranks' experts as vLLM's disk loader does",
    ),
}


def version_text() -> str:
    """The installed vLLM's ``__version__`` (``vllm/version.py``, imported first by vLLM itself)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def vllm_version() -> tuple[int, ...] | None:
    """The installed vLLM's ``(major, minor, patch)``; None when it does not say."""
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", version_text())
    return tuple(int(p or 0) for p in match.groups()) if match else None


def order(name: Name, version: tuple[int, ...] | None) -> list[str]:
    """The modules to try for ``name`` on vLLM ``version``: the homes its gate admits first."""
    admitted = [m for m, since in name.homes if since is None or (version is not None and version >= since)]
    if not name.public:
        # A private name: the newest module the version admits goes first.
        gated = sorted((since or (), m) for m, since in name.homes if m in admitted)
        admitted = [m for _, m in reversed(gated)]
    return admitted + [m for m, _ in name.homes if m not in admitted]


@functools.cache
def resolve(key: str) -> Any:
    """The vLLM object lorasync calls ``key`` (see :data:`SURFACE`).

    Raises:
        CapabilityError: no home of ``key`` exists in the installed vLLM.
    """
    name = SURFACE[key]
    try:
        import vllm  # noqa: F401 - only whether it is there
    except ImportError as exc:
        # Code that runs beside vLLM only (the in-process Frontend's rules) also runs where there is
        # none; it falls back on lorasync's own classes on this CapabilityError.
        raise CapabilityError(
            f"vLLM is not installed in this Python ({sys.executable}), and lorasync needs its {name.attr} for "
            f"{name.why}; install a vLLM release lorasync was tested with (see lorasync.engines._versions.KNOWN)",
            engine="vllm",
        ) from exc
    version = vllm_version()
    tried = []
    for module_name in order(name, version):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            tried.append(f"{module_name} ({type(exc).__name__})")
            continue
        if hasattr(module, name.attr):
            return getattr(module, name.attr)
        tried.append(f"{module_name} (no {name.attr})")
    shown = ".".join(map(str, version)) if version else "of unknown version"
    raise CapabilityError(
        f"vLLM {shown} has no {name.attr} where lorasync looks for it ({'; '.join(tried)}), which it needs for "
        f"{name.why}; run a vLLM release lorasync was tested with (see lorasync.engines._versions.KNOWN) or "
        "upgrade lorasync",
        engine="vllm",
    )
