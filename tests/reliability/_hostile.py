"""Hostile inputs: names, versions, tensors, adapter directories and files an attacker or a
broken trainer could hand to lorasync. Each must be refused with the named ``LoraSyncError``
leaf before anything reaches an engine or the store."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lorasync import Adapter, AdapterConfig, Publisher, publish_adapter
from lorasync.errors import (
    AdapterError,
    AdapterRejectedError,
    DtypeMismatchError,
    IncompatibleAdapterError,
    InvalidKeyError,
    InvalidNameError,
    LoraSyncError,
    MissingPairError,
    NonFiniteError,
    RankTooLargeError,
    ShapeMismatchError,
    StorageError,
)
from lorasync.testing import MemoryEngine
from lorasync.transports import DiskStore

from ._faultserver import FaultServer
from ._harness import client, tiny_adapter

HOSTILE_NAMES: tuple[Any, ...] = (
    "../x", "..", ".", "/abs", "a/b", "a\\b", "nul\x00x", "x" * 10_000, "x" * 97, "pоlicy",  # Cyrillic о
    "ｐolicy", "policy\u200b", "pol icy", "-flag", ".hidden", "a..b", "", "a:b", "a@v1", "line\nbreak",
    "C:\\x", "~", "$HOME", "%2e%2e", "a*", None, 123, b"policy",
)  # fmt: skip
HOSTILE_VERSIONS: tuple[Any, ...] = (
    "../1", -1, "1/2", 1.5, True, None, "1e3", " 1", "١", 10**15, 2**64, float("nan"), "0x10", "+1", "1_000", "", [1],
)  # fmt: skip

M = "model.layers.0.self_attn.q_proj"
KA, KB = f"base_model.model.{M}.lora_A.weight", f"base_model.model.{M}.lora_B.weight"


def _tensor_cases() -> list[tuple[str, Callable[[], Any], type[LoraSyncError]]]:
    cfg = AdapterConfig(r=4, lora_alpha=8)
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    nan = a.clone()
    nan[0, 0] = float("nan")
    return [
        ("ranks of A and B differ", lambda: Adapter({KA: a, KB: torch.randn(8, 3)}, cfg), ShapeMismatchError),
        ("A is 3-D", lambda: Adapter({KA: a.unsqueeze(0), KB: b}, cfg), ShapeMismatchError),
        ("A is a scalar", lambda: Adapter({KA: torch.tensor(1.0), KB: b}, cfg), ShapeMismatchError),
        ("integer tensors", lambda: Adapter({KA: a.long(), KB: b.long()}, cfg), DtypeMismatchError),
        ("mixed dtypes", lambda: Adapter({KA: a, KB: b.half()}, cfg), DtypeMismatchError),
        ("rank differs from config", lambda: Adapter({KA: a, KB: b}, AdapterConfig(r=8, lora_alpha=8)), ShapeMismatchError),
        ("B without A", lambda: Adapter({KB: b}, cfg), MissingPairError),
        ("traversal in a key", lambda: Adapter({"base_model.model.../../etc.lora_A.weight": a, KB: b}, cfg), InvalidKeyError),
        ("NUL in a key", lambda: Adapter({"base_model.model.m\x00.lora_A.weight": a, KB: b}, cfg), InvalidKeyError),
        ("base weight as a key", lambda: Adapter({f"base_model.model.{M}.weight": a, KA: a, KB: b}, cfg), InvalidKeyError),
        ("not a tensor", lambda: Adapter({KA: a.tolist(), KB: b}, cfg), AdapterError),
        ("NaN (check_finite)", lambda: Adapter({KA: nan, KB: b}, cfg, check_finite=True), NonFiniteError),
        ("no tensors", lambda: Adapter({}, cfg), AdapterError),
    ]


def _write_safetensors_header(path: Path, header: dict[str, Any] | bytes, payload: bytes = b"") -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


def _dir_cases(base: Path) -> list[tuple[str, Path, type[LoraSyncError]]]:
    """Adapter directories with something wrong; each is refused by ``Adapter.load``."""
    good = tiny_adapter(7)
    cases: list[tuple[str, Path, type[LoraSyncError]]] = []

    def make(label: str, change: Callable[[Path], None], error: type[LoraSyncError]) -> None:
        d = base / label.replace(" ", "_")
        good.save(d)
        change(d)
        cases.append((label, d, error))

    make("extra safetensors", lambda d: _copy(d / "adapter_model.safetensors", d / "evil.safetensors"), AdapterError)
    make("extra safetensors, hidden", lambda d: _copy(d / "adapter_model.safetensors", d / ".x.safetensors"), AdapterError)
    make("header claims a huge tensor", lambda d: _write_safetensors_header(
        d / "adapter_model.safetensors", {KA: {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 2**62]}}), StorageError)  # fmt: skip
    make("header length beyond the file", lambda d: (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}"), StorageError)
    make("shape and bytes disagree", lambda d: _write_safetensors_header(
        d / "adapter_model.safetensors", {KA: {"dtype": "F32", "shape": [4, 16], "data_offsets": [0, 8]}}, b"\0" * 8), StorageError)  # fmt: skip
    make("weights are a pickle", lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x80\x04\x95" + b"\0" * 64), StorageError)
    make("weights are a symlink to /etc/passwd", lambda d: _symlink(d / "adapter_model.safetensors", "/etc/passwd"), StorageError)
    make("config is not JSON", lambda d: (d / "adapter_config.json").write_text("{"), AdapterError)
    make("config is a list", lambda d: (d / "adapter_config.json").write_text("[]"), AdapterError)
    make("config nests 100000 deep", lambda d: (d / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000), AdapterError)
    make("config r is negative", lambda d: _patch(d, r=-1), LoraSyncError)
    make("config targets are an int", lambda d: _patch(d, target_modules=5), AdapterError)
    make("config is another PEFT type", lambda d: _patch(d, peft_type="PROMPT_TUNING"), AdapterError)
    make("config asks for DoRA", lambda d: _patch(d, use_dora=True), LoraSyncError)
    make("no weights file", lambda d: (d / "adapter_model.safetensors").unlink(), StorageError)
    make("key with traversal", lambda d: _resave(d, {"base_model.model.../../x.lora_A.weight": torch.randn(4, 16)}), InvalidKeyError)
    return cases


def _copy(src: Path, dst: Path) -> None:
    dst.write_bytes(src.read_bytes())


def _symlink(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def _patch(d: Path, **changes: Any) -> None:
    data = json.loads((d / "adapter_config.json").read_text())
    data.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(data))


def _resave(d: Path, extra: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "adapter_model.safetensors"))
    tensors.update(extra)
    save_file(tensors, str(d / "adapter_model.safetensors"))


def _publishing(engine: MemoryEngine, store: Path, *, name: Any = "p", version: Any = 1) -> Callable[[], Any]:
    return lambda: publish_adapter(tiny_adapter(3), engine, name=name, version=version, root=store)


def _untouched(engine: MemoryEngine, store: Path) -> Callable[[], str | None]:
    """Nothing reached the engine or the store."""
    return lambda: f"the engine saw {engine.ops}" if engine.ops else ("the store was written" if store.exists() else None)


def run_hostile() -> dict[str, Any]:
    """Every hostile input; ``rejected`` counts those refused with the expected error leaf."""
    tried = rejected = 0
    violations: list[str] = []

    def expect(label: str, call: Callable[[], Any], error: type[BaseException], after: Callable[[], str | None] | None = None) -> None:
        nonlocal tried, rejected
        tried += 1
        try:
            call()
        except error:
            problem = after() if after else None
            if problem:
                violations.append(f"{label}: refused, but {problem}")
            else:
                rejected += 1
            return
        except Exception as exc:  # noqa: BLE001 - anything else is the finding
            violations.append(f"{label}: {type(exc).__name__} ({str(exc)[:120]}) instead of {error.__name__}")
            return
        violations.append(f"{label}: accepted")

    adapter = tiny_adapter(3)
    with tempfile.TemporaryDirectory(prefix="lorasync-hostile-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PEFT warns about the foreign configs it is fed
        root = Path(tmp)
        for i, name in enumerate(HOSTILE_NAMES):
            engine, store = MemoryEngine(), root / f"name{i}"
            expect(f"name {name!r:.40}", _publishing(engine, store, name=name), InvalidNameError, _untouched(engine, store))
            expect(f"store path for name {name!r:.40}", lambda n=name: DiskStore(store).path_for(n, 1), InvalidNameError)
        for i, version in enumerate(HOSTILE_VERSIONS):
            engine, store = MemoryEngine(), root / f"version{i}"
            expect(f"version {version!r:.40}", _publishing(engine, store, version=version), InvalidNameError, _untouched(engine, store))
        for label, call, error in _tensor_cases():
            expect(f"tensors: {label}", call, error)
        engine = MemoryEngine(max_rank=2)
        expect(
            "tensors: rank above the engine's max",
            lambda: Publisher([engine], name="big", root=root / "big").publish(adapter, version=1).raise_for_errors(),
            RankTooLargeError,
            lambda: "bytes moved before the refusal" if (root / "big" / "big").exists() or "load_adapter" in engine.ops else None,
        )
        dirs = _dir_cases(root / "dirs")
        for label, directory, error in dirs:
            expect(f"dir: {label}", lambda d=directory: Adapter.load(d), error)
            mem = MemoryEngine()
            wrapped = LoraSyncError if error is StorageError else AdapterRejectedError  # no config: not found
            expect(f"dir via MemoryEngine: {label}", lambda d=directory, e=mem: e.load_adapter("x@v1", d), wrapped)
        # The engines' own load path refuses a directory SGLang would read differently, before sending.
        extra = next(d for label, d, _ in dirs if label == "extra safetensors")
        for protocol in ("vllm", "sglang"):
            with FaultServer(protocol) as server:
                engine = client(protocol, server.url)
                expect(
                    f"dir via {protocol} client: extra safetensors",
                    lambda e=engine: e.load_adapter("x@v1", str(extra)),
                    IncompatibleAdapterError,
                    lambda s=server: "the request reached the engine" if s.requests("load") else None,
                )
                engine.close()
        # The store never writes anything but the three files of a version.
        store = DiskStore(root / "clean")
        path, _ = store.write(adapter, "p", 1)
        tried += 1
        if sorted(os.listdir(path)) != ["adapter_config.json", "adapter_model.safetensors", "lorasync.json"]:
            violations.append(f"DiskStore wrote {sorted(os.listdir(path))}")
        else:
            rejected += 1
    return {"tried": tried, "rejected": rejected, "violations": violations}
