"""Every vLLM name lorasync imports, resolved in one place (the import surface).

vLLM main moved its modules (seen at commit 055e47c2, after the 0.33.0 release): the LoRA code to
``vllm/runtime/modeling/lora/`` and the exceptions to ``vllm/foundation/system/``, with alias
shims left at the old paths (``vllm/lora/*.py``, ``vllm/exceptions.py``), which a later release
may drop. No release has the move yet: the 0.33.0 and 0.34.0 wheels have neither ``vllm/runtime``
nor ``vllm/foundation``, and LoRA is still ``vllm/lora/`` (tests/engines/data/
vllm_release_surfaces.json). So which home comes first is decided by what the installed vLLM
*has*, never by a version number that could name the wrong release: the moved layout is in use
where its package (:data:`MOVED_PACKAGE`) exists. lorasync never writes ``from vllm... import
...`` elsewhere (tests/engines/test_vllm_surface.py checks that), but asks :func:`resolve`:

* **public** names (documented by vLLM: ``vllm.LLM``, ``vllm.SamplingParams``,
  ``vllm.lora.request.LoRARequest``, ``vllm.exceptions``) come from their documented home, and
  from the new module only where that home is gone;
* **private** names (the worker extension's PEFT parsing helpers) come from the old path
  (``vllm/lora/...``, every release through 0.34) unless the installed vLLM has the moved
  layout, then from its canonical module first (its shims may warn or go); the other home is
  the fallback either way.

Each home is tried in order; a name no home has raises
:class:`~lorasync.errors.CapabilityError` naming the vLLM version and every module tried, before
the engine is touched. tests/engines/test_vllm_surface.py checks :data:`SURFACE` against vLLM
main's source as recorded (tests/engines/data/vllm_main_surface.json, with its commit), against
the 0.33.0 and 0.34.0 wheels as recorded, and against the installed vLLM.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from typing import Any

from lorasync.errors import CapabilityError

__all__ = ["MOVED_PACKAGE", "SURFACE", "Name", "moved_layout", "order", "resolve", "version_text", "vllm_version"]

#: The package vLLM main moved its LoRA code to; where it exists, the moved layout is in use. No
#: release through 0.34.0 has it (a version gate would have to guess the first that does).
MOVED_PACKAGE = "vllm.runtime.modeling.lora"


@dataclass(frozen=True)
class Name:
    """One vLLM name lorasync uses.

    Attributes:
        attr: the attribute to take from the module.
        homes: ``(module, moved)`` in order of preference; ``moved`` marks a module of the moved
            layout (vLLM main after 0.34), False a module every release through 0.34 has.
        public: documented by vLLM (its first home is its public one).
        why: what lorasync uses it for.
    """

    attr: str
    homes: tuple[tuple[str, bool], ...]
    public: bool
    why: str


_LORA = MOVED_PACKAGE
SURFACE: dict[str, Name] = {
    "LLM": Name("LLM", (("vllm", False),), True, "the in-process engine's type checks"),
    "SamplingParams": Name("SamplingParams", (("vllm", False),), True, "greedy verification requests"),
    "LoRARequest": Name("LoRARequest", (("vllm.lora.request", False), (f"{_LORA}.request", True)), True, "selecting an adapter in-process"),
    "LoRAAdapterNotFoundError": Name(
        "LoRAAdapterNotFoundError",
        (("vllm.exceptions", False), ("vllm.foundation.system.exceptions", True)),
        True,
        "the worker extension's answer for a staged adapter that is gone",
    ),
    "VLLMNotFoundError": Name(
        "VLLMNotFoundError",
        (("vllm.exceptions", False), ("vllm.foundation.system.exceptions", True)),
        True,
        "the in-process engine's refusal of a retired version, as a not-found error vLLM re-raises as is",
    ),
    "PEFTHelper": Name(
        "PEFTHelper",
        (("vllm.lora.peft_helper", False), (f"{_LORA}.peft_helper", True)),
        False,
        "validating a staged adapter's config as vLLM does",
    ),
    "parse_fine_tuned_lora_name": Name(
        "parse_fine_tuned_lora_name", (("vllm.lora.utils", False), (f"{_LORA}.utils", True)), False, "checking staged tensor names"
    ),
    "is_base_embedding_weights": Name(
        "is_base_embedding_weights", (("vllm.lora.utils", False), (f"{_LORA}.utils", True)), False, "skipping base embedding weights"
    ),
    "LoRAModel": Name(
        "LoRAModel", (("vllm.lora.lora_model", False), (f"{_LORA}.lora_model", True)), False, "skipping modules as vLLM's disk loader does"
    ),
    "_is_remote_expert_key": Name(
        "_is_remote_expert_key",
        (("vllm.lora.lora_model", False), (f"{_LORA}.lora_model", True)),
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


def moved_layout() -> bool:
    """Whether the installed vLLM has the moved layout (:data:`MOVED_PACKAGE` exists)."""
    try:
        return importlib.util.find_spec(MOVED_PACKAGE) is not None
    except (ImportError, ValueError):  # a parent package is missing (every release through 0.34)
        return False


def order(name: Name, moved: bool) -> list[str]:
    """The modules to try for ``name``: a public name's documented home first; a private name's
    modules of the installed layout (``moved``, see :func:`moved_layout`) first, the others after."""
    homes = [m for m, _ in name.homes]
    if name.public:
        return homes
    return [m for m, in_moved in name.homes if in_moved == moved] + [m for m, in_moved in name.homes if in_moved != moved]


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
    for module_name in order(name, moved_layout()):
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
