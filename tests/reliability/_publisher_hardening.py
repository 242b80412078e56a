"""The publisher's own resources under cancellation, a full disk and a full engine (issue 15's
publisher rows), as scenarios shared by pytest and summary.py.

* Cancelling ``apublish`` at every await point (``asyncio.wait_for``), while it waits for the
  publisher's lock included, leaves nothing held: the next publish completes, no temp directory
  is left. (Before: a publish cancelled while waiting for the lock took it later and never gave it
  back; every later publish hung.)
* A full disk (a real 2 MiB tmpfs): a publish too big for it fails typed and removes its temp
  directory, and publishes that fit go through. (Before: each failure left its ``.tmp-vN-<pid>``
  behind, so later publishes that fit failed too.)
* An engine whose only slot serves a version with a request: the publish is refused with
  ``CapacityError`` before anything is unloaded, reports ``retired=[]``, and says what can be
  done. (Before: it unloaded the older version first, reported nothing, and advised "lower keep"
  at keep=1.)
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from lorasync import Adapter, AdapterConfig, Publisher
from lorasync.engines import Capabilities
from lorasync.errors import CapacityError, StorageError
from lorasync.testing import FakeEngine, MemoryEngine

M = "model.layers.0.self_attn.q_proj"


def _adapter(seed: int, width: int = 32, r: int = 4) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    return Adapter(
        {f"base_model.model.{M}.lora_A.weight": torch.randn(r, width, generator=g), f"base_model.model.{M}.lora_B.weight": torch.randn(width, r, generator=g)},
        AdapterConfig(r=r, lora_alpha=8),
    )


class _Engine:
    """A FakeEngine that serves what it loads and can hang one chosen operation call."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.hang_at: int | None = None  # index of the operation call to hang (None: never)
        self.count = 0
        self.engine = FakeEngine(self._handle)

    async def _handle(self, op: str, **kw: Any) -> Any:
        index, self.count = self.count, self.count + 1
        if index == self.hang_at:
            await asyncio.Event().wait()  # until cancelled
        if op == "capabilities":
            return Capabilities(engine="fake", tensor_load=False)
        if op == "list_adapters":
            return list(self.loaded)
        if op == "load_adapter":
            self.loaded.append(kw["name"])
        elif op == "unload_adapter" and kw["name"] in self.loaded:
            self.loaded.remove(kw["name"])
        return None


def _tmp_dirs(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".tmp-*")]


async def _cancel_everywhere(root: Path) -> tuple[int, list[str]]:
    """Cancel one publish at each await point in turn; every time, the next one must work."""
    violations: list[str] = []
    probe = _Engine()
    async with contextlib.AsyncExitStack():
        pub = Publisher([probe.engine], name="p", keep=1, transport="disk", root=root / "count")
        await pub.apublish(_adapter(1), version=1)
        await pub.apublish(_adapter(2), version=2)
        points = probe.count - 1  # operation calls of a steady-state publish (the first one probes caps)
        await pub.aclose()
    cases = 0
    for point in range(points + 1):
        fake = _Engine()
        pub = Publisher([fake.engine], name="p", keep=1, transport="disk", root=root / f"cut{point}")
        await pub.apublish(_adapter(1), version=1)
        fake.hang_at = fake.count + point
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(pub.apublish(_adapter(2), version=2), timeout=0.5)
        fake.hang_at = None
        try:
            report = await asyncio.wait_for(pub.apublish(_adapter(3), version=3), timeout=10)
            if not report.ok:
                violations.append(f"cancel at await point {point}: the next publish failed: {report}")
            await report.asettled()  # its retirement writes through `.tmp-` names after it returns
        except asyncio.TimeoutError:
            violations.append(f"cancel at await point {point}: the next publish hung (a lock or gate stayed held)")
        leftovers = _tmp_dirs(root / f"cut{point}")
        if leftovers:
            violations.append(f"cancel at await point {point}: temp directories left: {leftovers}")
        await pub.aclose()
        cases += 1
    # Cancelled while waiting for the publisher's lock (another publish holds it).
    fake = _Engine()
    pub = Publisher([fake.engine], name="p", keep=1, transport="disk", root=root / "lock")
    await pub.apublish(_adapter(1), version=1)
    fake.hang_at = fake.count + 1  # the holder hangs in its first engine call after the caps
    holder = asyncio.ensure_future(pub.apublish(_adapter(2), version=2))
    await asyncio.sleep(0.2)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(pub.apublish(_adapter(3), version=3), timeout=0.3)  # waits for the lock
    holder.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await holder
    fake.hang_at = None
    try:
        report = await asyncio.wait_for(pub.apublish(_adapter(4), version=4), timeout=10)
        if not report.ok:
            violations.append(f"after a cancel while waiting for the lock, the next publish failed: {report}")
    except asyncio.TimeoutError:
        violations.append("a publish cancelled while waiting for the publisher's lock left it held: the next one hung")
    await pub.aclose()
    return cases + 1, violations


def _disk_full(root: Path) -> tuple[int, list[str], str | None]:
    """On a real 2 MiB tmpfs: too big fails typed and clean; what fits goes through."""
    mount = root / "tiny-tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        return 0, [], f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})"
    violations: list[str] = []
    try:
        engine = MemoryEngine()
        pub = Publisher([engine], name="p", keep=1, transport="disk", root=mount)
        big = pub.publish(_adapter(1, width=65536, r=8), version=1)  # 4 MiB of fp32: does not fit
        error = big.results[0].error
        if not isinstance(error, StorageError) or "full" not in str(error):
            violations.append(f"a publish too big for the disk: expected a StorageError saying the disk is full, got {error!r}")
        for version in (2, 3):
            report = pub.publish(_adapter(version), version=version)
            if not report.ok:
                violations.append(f"after a too-big publish, v{version} (which fits) failed: {report}")
            # The retirement runs after the publish returns and writes its holders file through a
            # `.tmp-` name (atomic rename): only what is left once it finished is a leak.
            report.settled(timeout=30)
        left = _tmp_dirs(mount)
        if left:
            violations.append(f"temp directories left on the full disk: {left}")
        pub.close()
    finally:
        # lazily: this process keeps its run's owner lock open until it exits
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    return 3, violations, None


def _capacity(root: Path) -> tuple[int, list[str]]:
    engine = MemoryEngine(max_loras=1)
    pub = Publisher([engine], name="p", keep=1, root=root / "capacity")
    pub.publish(_adapter(1), version=1)
    violations: list[str] = []
    with engine.request("p@v1"):
        result = pub.publish(_adapter(2), version=2).results[0]
    if not isinstance(result.error, CapacityError):
        violations.append(f"one slot serving a request: expected CapacityError, got {result}")
    if result.retired or engine.list_adapters() != ["p@v1"]:
        violations.append(f"a refused publish unloaded {result.retired}; the engine serves {engine.list_adapters()}")
    if "lower keep" in str(result.error) or "more adapter slots" not in str(result.error):
        violations.append(f"the CapacityError's advice cannot be followed: {result.error}")
    pub.close()
    return 1, violations


def run_publisher_hardening() -> dict[str, Any]:
    """Every scenario; ``{"cancel_points", "disk_full", "capacity", "skipped", "violations"}``."""
    with tempfile.TemporaryDirectory(prefix="lorasync-hardening-") as tmp:
        root = Path(tmp)
        cancels, violations = asyncio.run(_cancel_everywhere(root))
        full, more, skipped = _disk_full(root)
        violations += more
        capacity, more = _capacity(root)
        violations += more
    return {"cancel_points": cancels, "disk_full": full, "capacity": capacity, "skipped": skipped, "violations": violations}
