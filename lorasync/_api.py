"""The function API: ``publish_adapter`` and ``apublish_adapter``, each with a throwaway
:class:`~lorasync.Publisher` (as ``httpx.get`` opens a throwaway client)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from lorasync._probe import Probe
from lorasync._publish import AdapterLike, Publisher, _aclose_all
from lorasync._report import PublishReport
from lorasync._retention import Retention
from lorasync.engines._engine import Engine
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._store import default_root, new_run_id

__all__ = ["apublish_adapter", "publish_adapter"]


def publish_adapter(
    adapter: AdapterLike,
    engines: Iterable[Engine | str] | Engine | str,
    *,
    name: str,
    version: int,
    transport: str = "auto",
    keep: int = 2,
    verify: Probe | None = None,
    root: str | os.PathLike[str] | None = None,
    run: str | None = None,
    base: BaseWeights | str | os.PathLike[str] | None = None,
) -> PublishReport:
    """Publish ``adapter`` as ``name@v<version>`` to every engine and report what happened.

    Stateless: versions already loaded on each engine are read from the engine itself, so a
    restarted trainer keeps monotonic versions and retention. Calls of one process share one run
    in the store (per root and name) unless ``run=`` says otherwise. For every-step use, keep a
    :class:`Publisher` (it caches capabilities and state).

    Args:
        adapter: an :class:`Adapter`, or a PEFT model / state dict (exported first).
        engines: engine clients or specs like ``"vllm:http://127.0.0.1:8000"``.
        name (`str`): adapter name (ASCII letters, digits, ``._-``).
        version (`int`): monotonic version, e.g. the trainer step.
        transport (`str`): ``"auto"``, ``"disk"``, ``"ipc"`` or ``"merged"``.
        keep (`int`): versions kept loaded per engine.
        verify (`Probe`, *optional*): checked through each engine after loading.
        root: disk transport root. run: the store run. base: pristine base weights for the merged fallback.

    Returns:
        `PublishReport`: ``report.served_name`` is the name to request; ``report.ok`` tells
        whether every engine serves it.

    Raises:
        InvalidNameError, ConfigError, AdapterError: bad arguments (nothing was sent).

    Example:
        >>> report = publish_adapter(adapter, ["vllm:http://127.0.0.1:8000"], name="policy", version=12)  # doctest: +SKIP
        >>> report.served_name
        'policy@v12'
    """
    # A throwaway publisher retires before it returns (nothing would wait for it afterwards).
    retention = Retention(keep=keep, background=False)
    publisher = Publisher(engines, name=name, transport=transport, root=root, run=run or _process_run(root), base=base, verify=verify, retention=retention)
    try:
        return publisher.publish(adapter, version=version)
    finally:
        publisher._release()  # the caller's engine objects stay open


async def apublish_adapter(
    adapter: AdapterLike,
    engines: Iterable[Engine | str] | Engine | str,
    *,
    name: str,
    version: int,
    transport: str = "auto",
    keep: int = 2,
    verify: Probe | None = None,
    root: str | os.PathLike[str] | None = None,
    run: str | None = None,
    base: BaseWeights | str | os.PathLike[str] | None = None,
) -> PublishReport:
    """Async twin of :func:`publish_adapter`. Engines given as specs are closed before it returns."""
    specs = [engines] if isinstance(engines, (Engine, str)) else list(engines)
    retention = Retention(keep=keep, background=False)
    publisher = Publisher(specs, name=name, transport=transport, root=root, run=run or _process_run(root), base=base, verify=verify, retention=retention)
    try:
        return await publisher.apublish(adapter, version=version)
    finally:
        publisher.store.close()
        # Clients this call made from specs are its own; the caller's engine objects stay open.
        await _aclose_all(e for e, spec in zip(publisher.engines, specs) if isinstance(spec, str))


_RUNS: dict[str, str] = {}
_RUNS_GUARD = threading.Lock()


def _process_run(root: str | os.PathLike[str] | None) -> str:
    """One run per process and root for the stateless calls (their versions retire each other)."""
    key = os.path.abspath(os.fspath(root)) if root is not None else str(default_root())
    with _RUNS_GUARD:
        return _RUNS.setdefault(key, new_run_id())
