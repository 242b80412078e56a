"""Scenario runners for issue 15's hardening items that need no model: foreign served names,
inputs that used to raise untyped errors, and a directory rewritten under its reader.

Each runner returns ``{"tried": n, "handled": m, "violations": [...]}`` (``handled`` counts the
cases that ended as the item requires); the tests assert on it and ``summary.py`` prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lorasync import Adapter, AdapterConfig, Publisher
from lorasync.adapter._names import parse_served_name
from lorasync.errors import ConfigError, DtypeMismatchError, LoraSyncError
from lorasync.testing import MemoryEngine

from ._harness import tiny_adapter

# Names someone else loaded into an engine lorasync publishes "p" and "q" to, and what a
# misreading would have made of them.
FOREIGN_NAMES = (
    "q@v0000000000000000007",  # zero-padded: was read as q v7
    "q@v07",
    "p@v99999999999999999999",  # beyond MAX_VERSION: every later publish failed
    "p@v1000000000000000",  # exactly MAX_VERSION
    "p@v-1",
    "p@v 3",
    "p@v3 ",
    "p@v٣",  # an Arabic-Indic digit
    "p@v3@v4",
    "../p@v3",
    "p@v",
)


def run_foreign_names() -> dict[str, Any]:
    """Each foreign name sits in an engine (loaded by another tool) while lorasync publishes
    v5 then v8 of the name it resembles with ``keep=1``: both publishes load, nothing reports
    retiring the foreign name, and the engine still serves it afterwards."""
    tried = handled = 0
    violations: list[str] = []
    with tempfile.TemporaryDirectory(prefix="lorasync-foreign-") as tmp:
        root = Path(tmp)
        source = tiny_adapter(99).save(root / "foreign-source")
        for i, foreign in enumerate(FOREIGN_NAMES):
            tried += 1
            problems: list[str] = []
            if parse_served_name(foreign) is not None:
                problems.append(f"parse_served_name read {parse_served_name(foreign)}")
            name = foreign.split("@", 1)[0].lstrip("./") or "p"
            engine = MemoryEngine()
            engine.load_adapter(foreign, source)
            pub = Publisher([engine], name=name, keep=1, transport="disk", root=root / f"store{i}")
            for version in (5, 8):
                report = pub.publish(tiny_adapter(version), version=version).settled()
                result = report.results[0]
                if not report.ok or result.status != "loaded":
                    problems.append(f"v{version}: {result.status} {result.error!r:.160}")
                if any(r == foreign or (parse_served_name(r) or ("", -1))[1] == 7 for r in result.retired):
                    problems.append(f"v{version} reported retired={result.retired}")
            served = engine.list_adapters()
            if foreign not in served:
                problems.append(f"the foreign name was unloaded (engine serves {served})")
            if f"{name}@v8" not in served:
                problems.append(f"v8 does not serve (engine serves {served})")
            pub.close()
            if problems:
                violations.append(f"{foreign!r}: " + "; ".join(problems))
            else:
                handled += 1
    return {"tried": tried, "handled": handled, "violations": violations}


M = "model.layers.0.self_attn.q_proj"
KA, KB = f"base_model.model.{M}.lora_A.weight", f"base_model.model.{M}.lora_B.weight"


def _config_dir(base: Path, label: str, **changes: Any) -> Path:
    d = base / label
    tiny_adapter(5).save(d)
    data = json.loads((d / "adapter_config.json").read_text())
    data.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(data))
    return d


def run_untyped() -> dict[str, Any]:
    """Inputs that used to escape as ``re.error`` or be accepted silently: each must now be
    refused with a ``LoraSyncError`` leaf by ``AdapterConfig``, ``Adapter.load`` and the memory
    engine alike; float64/float8 factors are accepted (engines cast them) and the dtype message
    names every accepted dtype."""
    tried = handled = 0
    violations: list[str] = []

    def expect(label: str, call: Callable[[], Any], error: type[BaseException]) -> None:
        nonlocal tried, handled
        tried += 1
        try:
            call()
        except error:
            handled += 1
            return
        except Exception as exc:  # noqa: BLE001 - the finding
            violations.append(f"{label}: {type(exc).__name__} ({str(exc)[:120]}) instead of {error.__name__}")
            return
        violations.append(f"{label}: accepted")

    def accept(label: str, call: Callable[[], Any]) -> None:
        nonlocal tried, handled
        tried += 1
        try:
            call()
        except Exception as exc:  # noqa: BLE001
            violations.append(f"{label}: {type(exc).__name__} ({str(exc)[:120]})")
            return
        handled += 1

    pair = {KA: torch.randn(4, 16), KB: torch.randn(16, 4)}
    with tempfile.TemporaryDirectory(prefix="lorasync-untyped-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        base = Path(tmp)
        for field in ("rank_pattern", "alpha_pattern"):
            for regex in ("q_proj(", "[", "*q", "(?P<x"):
                value = 4 if field == "rank_pattern" else 8.0
                expect(f"{field} {regex!r}: AdapterConfig", lambda f=field, r=regex, v=value: Adapter(pair, AdapterConfig(r=4, lora_alpha=8, **{f: {r: v}})), ConfigError)  # fmt: skip
                d = _config_dir(base, f"{field}-{len(regex)}-{ord(regex[0])}", **{field: {regex: value}})
                expect(f"{field} {regex!r}: Adapter.load", lambda d=d: Adapter.load(d), LoraSyncError)
                expect(f"{field} {regex!r}: MemoryEngine", lambda d=d: MemoryEngine().load_adapter("x@v1", d), LoraSyncError)
        for bad_r in ("4", 4.0, True, None, [4]):
            d = _config_dir(base, f"r-{type(bad_r).__name__}-{bad_r}", r=bad_r)
            expect(f"config r={bad_r!r}: Adapter.load", lambda d=d: Adapter.load(d), LoraSyncError)
        for label, changes in (("rank_pattern value '4'", {"rank_pattern": {"q_proj": "4"}}),
                               ("rank_pattern value True", {"rank_pattern": {"q_proj": True}}),
                               ("lora_alpha true", {"lora_alpha": True})):  # fmt: skip
            d = _config_dir(base, label.replace(" ", "_").replace("'", ""), **changes)
            expect(f"config {label}: Adapter.load", lambda d=d: Adapter.load(d), LoraSyncError)
        tried += 1
        try:
            Adapter({KA: pair[KA].long(), KB: pair[KB].long()}, AdapterConfig(r=4, lora_alpha=8))
        except DtypeMismatchError as exc:
            if all(name in str(exc) for name in ("float32", "bfloat16", "float16", "float64", "float8")):
                handled += 1
            else:
                violations.append(f"integer factors: the message does not name every accepted dtype: {exc}")
        else:
            violations.append("integer factors: accepted")
        for dtype in (torch.float64, torch.float8_e4m3fn, torch.float8_e5m2):
            def round_trip(dtype: torch.dtype = dtype) -> None:
                adapter = Adapter({k: v.to(dtype) for k, v in pair.items()}, AdapterConfig(r=4, lora_alpha=8))
                d = adapter.save(base / f"dtype-{dtype}".replace(".", "_"))
                back = Adapter.load(d)
                assert back.dtype == dtype and back.content_hash == adapter.content_hash, (back.dtype, dtype)
                engine = MemoryEngine()
                engine.load_adapter("x@v1", d)
                assert engine.adapters["x@v1"].content_hash == adapter.content_hash
            accept(f"{dtype} factors: saved, loaded and served bit for bit", round_trip)
    return {"tried": tried, "handled": handled, "violations": violations}


_CHURN = textwrap.dedent(
    """
    import os, shutil, sys, threading, time
    import torch
    from lorasync import Adapter
    from lorasync.errors import LoraSyncError
    torch.set_num_threads(1)
    src, d, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    stop = threading.Event()
    Adapter.load(src)  # imports (PEFT's take seconds) before the clock starts

    def churn():
        # The three ways a directory changes under a reader: deleted and copied back, files
        # rewritten in place (truncate, then write), replaced by a rename.
        i = 0
        while not stop.is_set():
            i += 1
            if i % 10 == 0:
                shutil.rmtree(d, ignore_errors=True)
                shutil.copytree(src, d, dirs_exist_ok=True)
            elif i % 10 != 5:  # the rewrite is the one that used to kill the reader: mostly that
                os.makedirs(d, exist_ok=True)
                for n in os.listdir(src):
                    with open(os.path.join(src, n), "rb") as f, open(os.path.join(d, n), "wb") as g:
                        g.write(f.read())
            else:
                tmp = d + ".tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(src, tmp)
                shutil.rmtree(d, ignore_errors=True)
                os.rename(tmp, d)

    thread = threading.Thread(target=churn)
    thread.start()
    loads = typed = ok = 0
    untyped = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        loads += 1
        try:
            Adapter.load(d)
            ok += 1
        except LoraSyncError:
            typed += 1
        except Exception as exc:
            untyped.append(f"{type(exc).__name__}: {str(exc)[:80]}")
    stop.set()
    thread.join()
    print(f"LOADS {loads} OK {ok} TYPED {typed} UNTYPED {len(untyped)} {sorted(set(untyped))[:5]}")
    """
)


def run_vanishing(seconds: float = 6.0) -> dict[str, Any]:
    """``Adapter.load`` in a loop while another thread deletes, rewrites and renames the
    directory: every load either returns the adapter or raises a ``LoraSyncError``; the process
    survives (a mapped file truncated under its reader used to kill it with SIGBUS). Runs in a
    subprocess so that such a crash is a finding, not the end of the test run."""
    with tempfile.TemporaryDirectory(prefix="lorasync-vanish-") as tmp:
        src = tiny_adapter(11, width=1024).save(Path(tmp) / "src")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", _CHURN, str(src), str(Path(tmp) / "v"), str(seconds)],
                              capture_output=True, text=True, env=env, timeout=seconds + 120)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LOADS")), "")
    if proc.returncode != 0 or not line:
        return {"tried": 1, "handled": 0, "loads": 0, "violations": [f"the reader died (exit {proc.returncode}): {proc.stderr[-300:]}"]}
    fields = line.split()
    loads, ok, typed, untyped = (int(fields[i]) for i in (1, 3, 5, 7))
    violations = [f"{untyped} untyped errors: {' '.join(fields[8:])}"] if untyped else []
    if ok == 0:
        violations.append("no load succeeded: the churn never left a complete directory")
    return {"tried": loads, "handled": ok + typed, "loads": loads, "violations": violations}
