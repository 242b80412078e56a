"""A content hash computed where the tensors live: a GPU adapter is hashed on its GPU.

Why lorasync has its own: the publisher hashes every adapter it publishes (dedup, the ledger,
the torn-read watch's "unchanged"), and the well-kept hashes (XXH3, SHA-256 in ``hashlib``) run
on the host. For a trainer's adapter in GPU memory that meant a device-to-host copy of every byte
on the critical path of every publish (43 ms for the 175 MB Qwen3-8B r16 adapter on an H200,
158 ms at r64), to learn whether the bytes the GPU already holds changed. No maintained package
hashes CUDA memory from PyTorch, so this module does it with a few elementwise torch kernels, or
on a CUDA device with one fused Triton pass (:mod:`lorasync.wire._device_hash_gpu`) that gives the
same value.

The hash (``dev128:``):

* every tensor's bytes, in key order, each padded to 8 bytes, are gathered into one buffer on
  their device (one ``cat``) and read as 64-bit words ``w_i``;
* each of two lanes (independent seeds) is ``sum_i mix(w_i + (i+1)*G + seed)`` modulo 2**64, where
  ``mix`` is SplitMix64's finaliser, a bijection of 64-bit words, and ``G`` the golden-ratio
  increment; positions enter before the mix, so moving a word changes the sum;
* the config, keys, dtypes, shapes and both lanes go through XXH3-128 on the host (16 bytes cross).

Any single changed word changes each lane (``mix`` is a bijection). Several changes collide only
if their mixed differences cancel in both lanes at once, which for bytes a trainer produces is a
chance of about 2**-128 (the mix is a strong avalanche). It is not a cryptographic hash: it
decides dedup of the caller's own tensors, not trust in foreign bytes (those use SHA-256 / XXH3
on the files that arrive). The sum is order-free, so the reduction's order on the GPU does not
change the value: the same bytes give the same hash on any device, CPU included.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from lorasync.wire._device_hash_gpu import lanes_fused

__all__ = ["PREFIX", "lanes", "tensors_digest", "torch_lanes"]

PREFIX = "dev128:"

_G = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)  # digits of pi: two independent lanes
#: Bytes gathered per pass: bounds the transient device memory to a few times this.
CHUNK_BYTES = 64 << 20


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical shift right of int64 words (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _chunks(tensors: Iterable[torch.Tensor], limit: int) -> Iterator[torch.Tensor]:
    """The tensors' bytes, each padded to 8, gathered into int64 buffers of about ``limit`` bytes."""
    tensors = list(tensors)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1 and not next(iter(dtypes)).is_complex and all(t.numel() * t.element_size() % 8 == 0 for t in tensors):
        # One dtype and no padding (every adapter lorasync exports): the gather runs in one C++
        # call per chunk instead of four tensor ops per tensor in Python, which were most of the
        # GPU hash's time for an adapter of 504 small tensors (the bytes cross in well under 0.1 ms).
        yield from _same_dtype_chunks(tensors, limit)
        return
    pieces: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pieces.append(raw)
        size += raw.numel()
        pad = (-raw.numel()) % 8
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
            size += pad
        if size >= limit:
            yield torch.cat(pieces).view(torch.int64)
            pieces, size = [], 0
    if pieces:
        yield torch.cat(pieces).view(torch.int64)


def _same_dtype_chunks(tensors: list[torch.Tensor], limit: int) -> Iterator[torch.Tensor]:
    start, size = 0, 0
    for i, t in enumerate(tensors):
        size += t.numel() * t.element_size()
        if size >= limit or i == len(tensors) - 1:
            with torch.no_grad():  # a trainer's parameters: the gather is not part of any graph
                flat = torch._C._nn.flatten_dense_tensors(tensors[start : i + 1])
            if i == start:
                # One tensor alone is handed back as a view of itself, which may start at an offset
                # no 8-byte word view can take (a slice of a bigger buffer), or carry a lazy
                # negation: a copy of its plain bytes, as the general gather makes.
                flat = flat.resolve_neg().clone()
            yield flat.view(torch.int64)
            start, size = i + 1, 0


def torch_lanes(words: torch.Tensor, offset: int) -> torch.Tensor:
    """Both lanes' sums (int64, wrapped modulo 2**64) of the int64 ``words`` whose first word is
    word ``offset`` of the message, with torch's elementwise kernels on the words' device: the
    reference form, and the one for host tensors and GPUs without the fused kernel."""
    pos = torch.arange(offset + 1, offset + words.numel() + 1, dtype=torch.int64, device=words.device).mul_(_G)
    out = []
    for seed in _SEEDS:
        z = words + pos
        z.add_(seed)
        z.bitwise_xor_(_lsr(z, 30)).mul_(_M1)
        z.bitwise_xor_(_lsr(z, 27)).mul_(_M2)
        z.bitwise_xor_(_lsr(z, 31))
        out.append(z.sum())
    return torch.stack(out)


def lanes(tensors: Iterable[torch.Tensor], *, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, int]:
    """The two 64-bit lanes of the bytes of ``tensors`` (in the order given), as unsigned ints.

    Raises:
        RuntimeError: the tensors are on different devices.
    """
    sums: list[torch.Tensor] = []
    offset = 0
    for words in _chunks(tensors, chunk_bytes):
        # One fused pass on a GPU, else the torch form: the same sums (order-free, modulo 2**64).
        chunk = lanes_fused(words, offset, _SEEDS)
        if chunk is None:
            chunk = torch_lanes(words, offset)
        offset += words.numel()
        sums = [chunk[0], chunk[1]] if not sums else [sums[0] + chunk[0], sums[1] + chunk[1]]
    if not sums:
        return (0, 0)
    both = torch.stack(sums).cpu().tolist()  # 16 bytes cross to the host
    return (both[0] & (2**64 - 1), both[1] & (2**64 - 1))


def tensors_digest(tensors: Mapping[str, torch.Tensor], header: bytes = b"") -> str:
    """``"dev128:<hex>"`` over ``header`` (config and layout, already encoded by the caller) and
    the bytes of ``tensors`` in key order, hashed on their device."""
    import xxhash

    keys = sorted(tensors)
    a, b = lanes(tensors[k] for k in keys)
    h = xxhash.xxh3_128()
    h.update(header)
    h.update(a.to_bytes(8, "little"))
    h.update(b.to_bytes(8, "little"))
    return PREFIX + h.hexdigest()
