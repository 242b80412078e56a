"""Adapter: the canonical in-memory LoRA adapter every exporter produces and every transport
consumes.

Over 400 lines on purpose: the class, its PEFT on-disk writer and its content hash stay together
because the write pass and the hash must see the same bytes (:meth:`Adapter.save_hashed`).

Tensors use PEFT's on-disk keys (``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``.lora_B.weight`` ``[out, r]``; an embedding's ``.lora_embedding_A`` ``[r, num_embeddings]`` and
``.lora_embedding_B`` ``[embedding_dim, r]``); the config is an :class:`AdapterConfig`. Construction
validates everything an engine would otherwise reject late or, worse, serve wrongly.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from lorasync.adapter._config import AdapterConfig, leaf_names
from lorasync.adapter._memory import host_views, tensor_header, write_views
from lorasync.adapter._keys import normalize_trainer_key, parse_peft_key, peft_key, split_peft_key
from lorasync.adapter._moe_peft import convert, model_type_of_saved, refuse_fused, split_peft_config
from lorasync.errors import (
    AdapterError,
    DtypeMismatchError,
    LoraSyncError,
    MissingPairError,
    NonFiniteError,
    ShapeMismatchError,
    StorageError,
    UnsupportedDtypeError,
)
from lorasync.wire import device_hash
from lorasync.wire.d2h import DEFAULT_CHUNK_BYTES, serialize, start_copy
from lorasync.wire.layout import plan
from lorasync.wire.views import raw_bytes

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "HASH_PREFIX", "Adapter", "extra_weight_files"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: What every :attr:`Adapter.content_hash` starts with: the algorithm (older releases wrote bare SHA-256 hex).
HASH_PREFIX = "xxh3-128:"
# Set only while lorasync.inspection validates meta tensors built from a file's header: every
# check but "has data" applies (the verdict must be exactly what Adapter.load refuses).
_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("lorasync_adapter_shapes_only", default=False)


class Adapter:
    """A validated LoRA adapter: PEFT-keyed tensors plus their config.

    Args:
        tensors (`Mapping[str, torch.Tensor]`):
            PEFT keys to tensors. Every module needs both ``lora_A`` ``[r_m, in]`` and
            ``lora_B`` ``[out, r_m]``; all tensors share one floating dtype.
        config (`AdapterConfig`):
            Hyper-parameters. ``target_modules`` defaults to the leaf names of the tensors.
        check_finite (`bool`, *optional*, defaults to `False`):
            Also reject NaN/inf (one pass over the data).

    Raises:
        InvalidKeyError, MissingPairError, ShapeMismatchError, DtypeMismatchError,
        NonFiniteError: naming the offending key.
        AdapterError: a tensor without data (meta, FakeTensor, sparse), naming the fix.
    """

    __slots__ = ("_config", "_embeddings", "_modules", "_tensors")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        config: AdapterConfig,
        *,
        check_finite: bool = False,
    ) -> None:
        if not tensors:
            raise AdapterError("an adapter needs at least one lora_A/lora_B pair; got no tensors")
        modules: dict[str, dict[str, torch.Tensor]] = {}
        named: dict[tuple[str, str], str] = {}  # (module, side) -> its key, as given (canonical)
        kinds: dict[str, bool] = {}  # module -> is an embedding (lora_embedding_* keys)
        for key, tensor in tensors.items():
            module, side, embedding = split_peft_key(key)
            named[module, side] = key
            if not isinstance(tensor, torch.Tensor):
                raise AdapterError(f"{key}: expected a torch.Tensor, got {type(tensor).__name__}", key=key)
            if kinds.setdefault(module, embedding) != embedding:
                raise AdapterError(
                    f"{module} has both lora_A/lora_B.weight and lora_embedding_* factors; a module is either a "
                    "linear layer or an embedding: export one key form per module",
                    key=key,
                )
            modules.setdefault(module, {})[side] = tensor
        self._embeddings = frozenset(m for m, emb in kinds.items() if emb)
        if not config.target_modules:
            config = config.with_(target_modules=leaf_names(modules))
        _validate(modules, config, lambda m, s: named.get((m, s)) or self.key(m, s), check_finite=check_finite)
        self._modules = {m: modules[m] for m in sorted(modules)}
        self._tensors = MappingProxyType({named[m, s]: pair[s] for m, pair in self._modules.items() for s in ("A", "B")})
        self._config = config

    def __reduce__(self) -> tuple[Any, ...]:
        # The tensor mapping is a read-only MappingProxyType, which stdlib pickle refuses:
        # rebuild through the constructor (it validates again) from a plain dict.
        return (type(self), (dict(self._tensors), self._config))

    # -- views ----------------------------------------------------------------------------

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Read-only PEFT key → tensor mapping, sorted by module."""
        return self._tensors

    @property
    def config(self) -> AdapterConfig:
        return self._config

    @property
    def modules(self) -> tuple[str, ...]:
        """Module paths (``model.layers.0.self_attn.q_proj`` ...), sorted."""
        return tuple(self._modules)

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lora_A, lora_B)`` of ``module``."""
        entry = self._modules[module]
        return entry["A"], entry["B"]

    def key(self, module: str, side: str) -> str:
        """The PEFT key of ``module``'s factor ``side`` (``"A"``/``"B"``): ``...lora_A.weight``, or
        ``...lora_embedding_A`` for an embedding module."""
        return peft_key(module, side, embedding=module in self._embeddings)  # type: ignore[arg-type]

    def is_embedding(self, module: str) -> bool:
        """Whether ``module`` is an embedding (its factors are ``lora_embedding_A/B``)."""
        return module in self._embeddings

    def delta(self, module: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ΔW = scale · B · A of ``module`` in ``dtype`` (PEFT's per-module scale), in the layout of
        the module's weight: ``[out, in]`` for a linear layer, ``[num_embeddings, dim]`` (the
        transpose) for an embedding, as PEFT's ``get_delta_weight`` gives it."""
        a, b = self.pair(module)
        delta = (b.to(dtype) @ a.to(dtype)) * self._config.scale_for(module)
        return delta.T if module in self._embeddings else delta

    @property
    def engine_safe_scaling(self) -> bool:
        """True when every engine applies PEFT's scale: no rsLoRA and every module's
        alpha_m/r_m equals the global lora_alpha/r (see ``normalize_scaling``)."""
        cfg = self._config
        return not cfg.use_rslora and all(cfg.scale_for(m) == cfg.global_scale for m in self._modules)

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self._tensors.values())).dtype

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what a transport moves, headers excluded)."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def content_hash(self) -> str:
        """``"xxh3-128:<hex>"`` over config, keys, dtypes, shapes and bytes; independent of dict
        order. An adapter whose tensors all live on one GPU is hashed there instead
        (``"dev128:<hex>"``, same coverage, no device-to-host copy: design invariant 14); the two
        kinds never compare equal, so a moved adapter is at worst published again, never taken
        for unchanged.

        Computed from the bytes at every access, never cached: an Adapter may wrap the trainer's
        own tensors (``export`` does not copy), which change in place between publishes. One
        pass at memory speed (XXH3-128); :meth:`save_hashed` gets it out of the write pass.
        """
        if _one_cuda_device(self._tensors):
            return self._device_hash()
        h = _hasher()
        views = host_views(self._tensors)
        if views is not None:  # plain host tensors: read in place, no per-tensor torch calls
            h.update(_canonical_config(self._config).encode())
            for header, buf in views:
                h.update(header)
                h.update(buf)
        else:
            for _ in self._hashed_chunks(h):
                pass
        return HASH_PREFIX + h.hexdigest()

    def _device_hash(self) -> str:
        """``"dev128:<hex>"``: the same coverage as the host hash, with the bytes hashed on the
        device they live on (:mod:`lorasync.wire.device_hash`): no device-to-host copy."""
        keys = sorted(self._tensors)
        header = _canonical_config(self._config).encode() + b"".join(
            tensor_header(k, self._tensors[k].dtype, self._tensors[k].shape) for k in keys
        )
        return device_hash.tensors_digest(self._tensors, header)

    def matches_hash(self, digest: str) -> bool:
        """Whether ``digest`` (a recorded :attr:`content_hash`) names this adapter's content now.

        Digests of lorasync before 0.2 (bare SHA-256 hex, as old stores recorded them) are
        recomputed with SHA-256 and compared; anything else never matches.
        """
        if digest.startswith(HASH_PREFIX):
            return digest == self.content_hash
        if digest.startswith(device_hash.PREFIX):
            return digest == self._device_hash()
        if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            h = hashlib.sha256()
            for _ in self._hashed_chunks(h):
                pass
            return digest == h.hexdigest()
        return False

    def _hashed_chunks(self, h: Any) -> Iterator[Any]:
        """Feed ``h`` the hashed stream and yield each tensor's bytes (CPU, contiguous, in key
        order) right after it was hashed, so a writer can put it on disk in the same pass."""
        h.update(_canonical_config(self._config).encode())
        for key, tensor in _on_host(self._tensors).items():
            cpu = _cpu_contiguous(tensor)
            h.update(tensor_header(key, cpu.dtype, cpu.shape))
            raw = raw_bytes(cpu)  # the tensor's memory in place: no staging copy
            h.update(raw)
            yield raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return (
            f"Adapter(modules={len(self._modules)}, r={self._config.r}, "
            f"alpha={self._config.lora_alpha}, dtype={self.dtype}, nbytes={self.nbytes})"
        )

    # -- transforms -----------------------------------------------------------------------

    def to(self, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> Adapter:
        """A copy with tensors cast/moved (same config)."""
        tensors = {k: t.to(device=device, dtype=dtype) for k, t in self._tensors.items()}
        return Adapter(tensors, self._config)

    def to_host(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Adapter:
        """This adapter with every tensor in host memory, in one transfer per GPU and one wait.

        Returns ``self`` when nothing is on a GPU. The new adapter's tensors are views of one
        page-locked buffer laid out as ``adapter_model.safetensors``; validation and the content
        hash are unchanged.

        Args:
            chunk_bytes (`int`, defaults to 32 MiB): device-side gather size per transfer
                (``0``: one transfer per tensor, no extra GPU memory).
        """
        if not _any_cuda(self._tensors):
            return self
        buffer, wait = start_copy(self._tensors, chunk_bytes=chunk_bytes)
        host = self._with_tensors(buffer.tensors)  # while the transfers run
        wait()
        return host

    def _with_tensors(self, tensors: Mapping[str, torch.Tensor]) -> Adapter:
        """This adapter over ``tensors``: the same keys, shapes, dtype and bytes elsewhere (e.g.
        copied to the host), so validation carries over."""
        new = object.__new__(Adapter)
        # Keys alternate A, B in module order (see __init__): no key parsing needed.
        keys = list(self._tensors)
        new._modules = {m: {"A": tensors[keys[2 * i]], "B": tensors[keys[2 * i + 1]]} for i, m in enumerate(self._modules)}
        new._tensors = MappingProxyType({k: tensors[k] for k in keys})
        new._config = self._config
        new._embeddings = self._embeddings
        return new

    # -- PEFT on-disk format ----------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``directory``.

        The config is written by PEFT's own ``LoraConfig.save_pretrained``, so
        ``PeftModel.from_pretrained(base, directory)`` loads it.

        Returns:
            `Path`: the directory.

        Raises:
            StorageError: the directory cannot be written.
        """
        return self._write(Path(directory), None)[0]

    def save_hashed(self, directory: str | os.PathLike[str], *, parents: bool = True) -> tuple[Path, str]:
        """:meth:`save`, and the :attr:`content_hash` of exactly the bytes written, computed in
        the same pass (each tensor hashed right before its memory is written).

        Args:
            directory: where the files go (made if missing).
            parents (`bool`): also make missing folders above ``directory`` (False: its parent
                must exist; a store's temp folder whose run was removed is not made again).

        Returns:
            ``(directory, content_hash)``.

        Raises:
            StorageError: the directory cannot be written.
        """
        h = _hasher()
        path, hashed = self._write(Path(directory), h, parents=parents)
        if not hashed:  # a dtype the fast writer cannot lay out: hashed on its own
            for _ in self._hashed_chunks(h):
                pass
        return path, HASH_PREFIX + h.hexdigest()

    def _write(self, path: Path, h: Any, *, parents: bool = True) -> tuple[Path, bool]:
        """Save into ``path``, feeding ``h`` (when given) the hashed stream; whether it was fed."""
        hashed = False
        try:
            path.mkdir(parents=parents, exist_ok=True)
            if _any_cuda(self._tensors):
                # One device-to-host transfer, the file already laid out in the host buffer.
                buffer = serialize(self._tensors, {"format": "pt"})
                buffer.write_to(path / ADAPTER_WEIGHTS)
                if h is not None:
                    for _ in self._with_tensors(buffer.tensors)._hashed_chunks(h):
                        pass
                    hashed = True
            else:
                hashed = _save_safetensors(self, path / ADAPTER_WEIGHTS, metadata={"format": "pt"}, h=h)
            # PEFT sorts pattern keys on disk; pin them so the file means what the trainer ran.
            self._config.pinned(self._modules).to_peft().save_pretrained(str(path))
        except OSError as exc:
            raise StorageError(f"cannot write adapter to {path}: {exc}; check the path and free space") from exc
        return path, hashed

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, check_finite: bool = False, model_type: str | None = None) -> Adapter:
        """Read an adapter saved by :meth:`save` or by PEFT ``save_pretrained``.

        Only ``adapter_model.safetensors`` is read (never pickle); PEFT's ``.default`` key
        suffix is tolerated. A directory with other ``*.safetensors`` files is refused: SGLang
        loads every one of them, so an engine would serve something else than this Adapter.
        PEFT ``target_parameters`` LoRA on fused MoE experts is read as one LoRA per expert
        (:mod:`lorasync.adapter._moe`); ``model_type`` (the base's ``config.json`` ``model_type``) names
        the expert layout when the adapter config does not (PEFT records the base class only
        without a ``task_type``; a local ``base_model_name_or_path`` is read too).

        Raises:
            StorageError: files missing or unreadable.
            AdapterError: content that fails validation, a config that is not a PEFT LoRA
                config, or extra ``*.safetensors`` files; ``ExpertLayoutError`` for fused-expert
                factors that have no exact per-expert form.
        """
        path = Path(directory)
        weights, cfg = path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG
        if not weights.is_file() or not cfg.is_file():
            raise StorageError(
                f"{path} holds no PEFT adapter: expected {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}"
            )
        extras = extra_weight_files(path)
        if extras:
            raise AdapterError(
                f"{path} holds weight files besides {ADAPTER_WEIGHTS}: {extras}; engines such as SGLang load "
                "every *.safetensors file they find. Save the adapter to a directory of its own (Adapter.save)",
                path=str(path),
            )
        return cls._from_saved(path, _read_safetensors(weights), check_finite=check_finite, model_type=model_type)

    @classmethod
    def _from_saved(
        cls,
        path: Path,
        raw: Mapping[str, torch.Tensor],
        *,
        check_finite: bool = False,
        model_type: str | None = None,
        shapes_only: bool = False,
    ) -> Adapter:
        """Every check of :meth:`load` after the read: keys, ``path``'s config, fused experts, the
        Adapter itself. ``raw`` is the weights file's tensors; :func:`lorasync.inspection.inspect_adapter`
        passes meta tensors built from the header (``shapes_only``: every check but "has data"),
        so its verdict is exactly what ``load`` refuses.

        Raises:
            AdapterError, ConfigError: as :meth:`load`.
        """
        from peft import LoraConfig

        cfg = path / ADAPTER_CONFIG
        tensors: dict[str, torch.Tensor] = {}
        for key, tensor in raw.items():
            canonical = normalize_trainer_key(key)
            if canonical is None:
                parse_peft_key(key)  # raises InvalidKeyError naming the key
                raise AssertionError("unreachable")
            tensors[canonical] = tensor
        try:
            peft_config = LoraConfig.from_pretrained(str(path))
            config, target_parameters = split_peft_config(peft_config.to_dict())
        except OSError as exc:
            raise StorageError(f"cannot read {cfg}: {exc}") from exc
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError, RuntimeError, ImportError) as exc:
            if isinstance(exc, LoraSyncError):  # ConfigError from from_peft: already says what to fix
                raise
            raise AdapterError(
                f"{cfg} is not a PEFT LoRA config ({type(exc).__name__}: {str(exc)[:200]}); write it with "
                "Adapter.save or PEFT save_pretrained",
                path=str(path),
            ) from exc
        _refuse_unfilled_targets(peft_config, tensors, path)
        if target_parameters:
            family = model_type or model_type_of_saved(peft_config)
            tensors, config = convert(tensors, config, target_parameters=target_parameters, model_type=family)
        token = _SHAPES_ONLY.set(shapes_only)
        try:
            return cls(tensors, config, check_finite=check_finite)
        finally:
            _SHAPES_ONLY.reset(token)


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, read into memory first.

    ``safetensors.torch.load_file`` maps the file: a writer truncating or rewriting it while we
    read (a directory replaced under a reader) then kills the process with SIGBUS. Reading the
    bytes first turns every such race into a short or inconsistent buffer, refused below.

    Raises:
        StorageError: the file is missing, unreadable or not a valid safetensors file.
    """
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = torch.empty(size, dtype=torch.uint8)
            if size and f.readinto(memoryview(data.numpy())) != size:
                raise OSError("the file changed size while it was read")
        return _tensors_of(data)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise StorageError(
            f"cannot read {file}: {type(exc).__name__}: {str(exc)[:200]}; was the directory replaced or "
            "deleted while it was read? Read a version the store has finished writing"
        ) from exc


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


def _tensors_of(data: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file held in ``data`` (1-D ``uint8``), as views of it:
    no copy beyond the one read. Bounds are checked before any view is made.

    Raises:
        ValueError: a truncated or malformed file (header length, JSON, dtypes, offsets).
    """
    size = data.numel()
    if size < 8:
        raise ValueError("truncated: no header")
    hlen = int.from_bytes(data[:8].numpy().tobytes(), "little")
    if hlen > _MAX_HEADER or 8 + hlen > size:
        raise ValueError(f"header length {hlen} does not fit a {size}-byte file")
    header = json.loads(data[8 : 8 + hlen].numpy().tobytes())
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    start, end_of_data = 8 + hlen, 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype") if isinstance(info, dict) else None)
        if dtype is None:
            raise ValueError(f"{key}: unknown dtype or entry {str(info)[:80]}")
        begin, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        count = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"{key}: negative dimension in {shape}")
            count *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if begin < 0 or end != begin + count * itemsize or start + end > size:
            raise ValueError(f"{key}: data offsets {begin}..{end} do not fit shape {shape} in the file")
        end_of_data = max(end_of_data, start + end)
        raw = data[start + begin : start + end]
        if (start + begin) % itemsize:  # a view needs alignment; after an odd-sized tensor, copy
            raw = raw.clone()
        out[key] = raw.view(dtype).reshape(shape)
    if end_of_data != size:
        raise ValueError(f"{size - end_of_data} bytes after the last tensor: not a complete safetensors file")
    return out


def _refuse_unfilled_targets(peft_config: Any, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """``init_lora_weights: false`` plus ``target_modules`` naming modules the weights file does
    not hold: PEFT would give those modules random factors, vLLM none, so the file has no single
    meaning. Refused (AdapterError) instead of served one way or the other."""
    if getattr(peft_config, "init_lora_weights", True) is not False:
        return
    targets = getattr(peft_config, "target_modules", None) or ()
    if isinstance(targets, str):  # a regex: which modules it names depends on the base model
        raise AdapterError(
            f"{path / ADAPTER_CONFIG} has init_lora_weights=false and a regex target_modules: any module the "
            "regex matches without weights in the file would get random factors in PEFT. Save the adapter "
            "with Adapter.save or PEFT save_pretrained",
            path=str(path),
        )
    modules = {parse_peft_key(k)[0] for k in tensors}
    # PEFT's own list matching: a target names a module equal to it or ending in ".<target>".
    missing = sorted(t for t in targets if not any(m == t or m.endswith(f".{t}") for m in modules))
    if missing:
        raise AdapterError(
            f"{path / ADAPTER_CONFIG} has init_lora_weights=false and target_modules {missing} without weights in "
            f"{ADAPTER_WEIGHTS}: PEFT would fill those modules with random factors. Drop them from "
            "target_modules (or save the adapter with Adapter.save)",
            path=str(path),
        )


def extra_weight_files(directory: str | os.PathLike[str]) -> list[str]:
    """``*.safetensors`` files in ``directory`` other than ``adapter_model.safetensors`` (an
    engine that globs weights would load them too); empty when the directory is unreadable."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if n.endswith(".safetensors") and n != ADAPTER_WEIGHTS)


def _one_cuda_device(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor lives on one and the same GPU."""
    devices = {t.device for t in tensors.values()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


def _any_cuda(tensors: Mapping[str, torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors.values())


def _on_host(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``tensors`` in host memory: GPU tensors in one transfer (not one GPU wait per tensor)."""
    if not _any_cuda(tensors):
        return tensors
    return serialize(tensors).tensors


def _canonical_config(config: AdapterConfig) -> str:
    """JSON of ``config`` for hashing: numbers typed as PEFT compares them (``lora_alpha`` 16 and
    16.0 are one config) and patterns as ordered pairs (their order changes their meaning)."""
    data = config.to_dict()
    data["lora_alpha"] = float(config.lora_alpha)
    data["rank_pattern"] = [[k, int(v)] for k, v in config.rank_pattern.items()]
    data["alpha_pattern"] = [[k, float(v)] for k, v in config.alpha_pattern.items()]
    return json.dumps(data, sort_keys=True)


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach().to("cpu").contiguous()``, skipping the three calls when they are no-ops
    (per-call overhead adds up over hundreds of tensors)."""
    if tensor._is_zerotensor():  # torch's lazy zeros have no memory to read: the values are zeros
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    if tensor.is_neg() or tensor.is_conj():  # lazy negation/conjugation: memory holds other values
        tensor = tensor.resolve_conj().resolve_neg()
    if tensor.requires_grad or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return tensor.detach().to("cpu").contiguous()
    return tensor


def _save_safetensors(adapter: Adapter, file: Path, *, metadata: Mapping[str, str], h: Any = None) -> bool:
    """Write the CPU ``adapter``'s tensors as a safetensors file, each tensor's memory handed
    straight to ``write`` (no staging copy, little per-tensor overhead); with ``h``, each
    tensor is hashed (:meth:`Adapter._hashed_chunks`) right before it is written. Returns
    whether ``h`` was fed.

    The layout is :func:`lorasync.wire.layout.plan` in the caller's order (the safetensors
    format, which ``safetensors`` reads). Speed only: for ~500 tensors / 87 MB, ``save_file``
    costs ~1.2-1.5x a raw write of the bytes on tmpfs, this ~1.1x (``lorasync bench publish``).
    Dtypes the layout cannot name (float8) and big-endian hosts use ``save_file``.
    """
    views = host_views(adapter.tensors) if sys.byteorder == "little" else None
    if views is not None:  # plain host tensors (every trainer's on the CPU): lorasync.adapter._memory
        try:
            layout = plan(adapter.tensors, metadata, grouped=False)
        except UnsupportedDtypeError:
            pass
        else:
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            try:
                if h is not None:
                    h.update(_canonical_config(adapter.config).encode())
                write_views(fd, layout.prefix.numpy(), views, h)
            finally:
                os.close(fd)
            return h is not None
    tensors = {k: _cpu_contiguous(t) for k, t in adapter.tensors.items()}
    try:
        if sys.byteorder != "little":
            raise UnsupportedDtypeError("big-endian host")
        layout = plan(tensors, metadata, grouped=False)
    except UnsupportedDtypeError:
        from safetensors.torch import save_file

        save_file(tensors, str(file), metadata=dict(metadata))
        return False
    with open(file, "wb") as f:
        if h is None:
            layout.write_file(f, list(tensors.values()))
            return False
        f.write(layout.prefix.numpy())
        for raw in adapter._hashed_chunks(h):
            if len(raw):
                f.write(raw)
    return True


def _hasher() -> Any:
    """A fresh XXH3-128 hasher (``xxhash``; imported here: engine-side processes never hash)."""
    import xxhash

    return xxhash.xxh3_128()


def _without_data(t: torch.Tensor) -> str | None:
    """Why ``t`` holds no bytes an engine could serve, with the fix; ``None`` for a plain tensor.

    Such tensors pass every shape and dtype check, then fail with an untyped error at the first
    hash, write or copy, deep inside a publish."""
    if t.is_meta:
        return (
            "a meta tensor: a shape without data (a model built on the meta device or with "
            "init_empty_weights whose weights were never loaded); materialise the weights "
            "(load the checkpoint, or model.to_empty(device=...) then load_state_dict) before exporting"
        )
    if t.layout is not torch.strided:
        return f"a {t.layout} tensor; LoRA factors are dense: pass tensor.to_dense()"
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and _is_fake(t):
        return (
            "a FakeTensor (traced under FakeTensorMode: shapes without data); export the trainer's "
            "real tensors, outside the tracing context"
        )
    return None


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # a torch without fake tensors cannot hold one
        return False
    return bool(is_fake(t))


def _validate(
    modules: Mapping[str, Mapping[str, torch.Tensor]], config: AdapterConfig, key_of: Any, *, check_finite: bool
) -> None:
    for module in modules:  # first: fused factors would fail every check below for the wrong reason
        refuse_fused(module, key_of(module, "A"))
    # Keys are named only where a message needs them: this runs on every publish.
    dtype: torch.dtype | None = None
    first: tuple[str, str] = ("", "")
    need_data = not _SHAPES_ONLY.get()
    for module, pair in modules.items():
        for side in ("A", "B"):
            if side not in pair:
                other = "B" if side == "A" else "A"
                raise MissingPairError(
                    f"{key_of(module, other)} has no matching {key_of(module, side)}; "
                    "export both factors of every module",
                    key=key_of(module, side),
                )
        a, b = pair["A"], pair["B"]
        for side, t in (("A", a), ("B", b)):
            unmaterialised = _without_data(t) if need_data else None
            if unmaterialised:
                key = key_of(module, side)
                raise AdapterError(f"{key} is {unmaterialised}", key=key)
            if t.dim() != 2:
                key = key_of(module, side)
                raise ShapeMismatchError(
                    f"{key} must be 2-D, got shape {tuple(t.shape)}; split packed [E, ...] expert "
                    "factors into one module per expert",
                    key=key,
                )
            if not t.is_floating_point():
                key = key_of(module, side)
                raise DtypeMismatchError(
                    f"{key} has non-floating dtype {t.dtype}; LoRA factors must be floating point "
                    "(float32, bfloat16, float16, float64 or float8: engines cast them to their serving "
                    "dtype); cast them before building the Adapter",
                    key=key,
                )
            if dtype is None:
                dtype, first = t.dtype, (module, side)
            elif t.dtype != dtype:
                key = key_of(module, side)
                raise DtypeMismatchError(
                    f"{key} is {t.dtype} but {key_of(*first)} is {dtype}; cast the adapter to one dtype "
                    "(Adapter.to(dtype=...))",
                    key=key,
                )
            if check_finite and not bool(torch.isfinite(t).all()):
                key = key_of(module, side)
                raise NonFiniteError(f"{key} holds NaN or inf; the trainer diverged or the export is corrupt", key=key)
        rank = config.rank_for(module)
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ShapeMismatchError(
                f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match rank {rank}; "
                "set r (or rank_pattern) to the trained rank, or trim padding with trim_rank()",
                key=key_of(module, "A"),
            )
        leaf = module.rsplit(".", 1)[-1]
        if config.target_modules and leaf not in config.target_modules and module not in config.target_modules:
            raise ShapeMismatchError(
                f"{module} is not covered by target_modules {list(config.target_modules)}; "
                "add its leaf name or leave target_modules empty to derive it",
                key=key_of(module, "A"),
            )
