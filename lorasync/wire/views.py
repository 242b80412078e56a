"""Reading the safetensors layout: tensors as views into a data section, or copied out of any
buffer, every offset validated first (the *view* and *read* verbs of :mod:`lorasync.wire`).

* :func:`plan_views` validates a header once and plans its views (groups of adjacent tensors of
  one dtype and trailing shape, cut with one ``split`` each; misaligned entries are copied);
  :func:`apply_views` cuts them from a data section, :func:`views` does both; what it returns
  (:class:`BufferViews`) remembers the section and the plan, so that a copy of all the tensors is
  one copy of the section cut the same way (:meth:`BufferViews.copy_to`).
* reading a whole buffer (its length, header and bounds checked, the tensors copied out into
  memory the caller owns) is :mod:`lorasync.wire.reading`'s.

Ground floor: imports only the standard library, torch, numpy and :mod:`lorasync.errors`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from lorasync.errors import WireFormatError
from lorasync.wire.dtypes import FROM_NAME, ITEMSIZE

__all__ = [
    "BufferViews",
    "Group",
    "ViewPlan",
    "apply_views",
    "cut_groups",
    "group_entries",
    "plan_views",
    "raw_bytes",
    "views",
]


class Group(NamedTuple):
    """Tensors of one dtype sharing every dimension after the first, adjacent in a data section.

    Viewed as one ``(sum(rows), *trailing)`` block, the group is one ``cat`` of its tensors along
    dim 0 and ``split(rows)`` gives them back. 0-D tensors form groups of their own (``scalar``):
    one row each, viewed back with shape ``()``.
    """

    begin: int  # byte offset in the data section
    nbytes: int
    dtype: torch.dtype
    trailing: tuple[int, ...]
    rows: tuple[int, ...]
    keys: tuple[str, ...]
    scalar: bool = False

    def block(self, section: torch.Tensor) -> torch.Tensor:
        """This group's bytes in the ``uint8`` data section ``section``, as one
        ``(sum(rows), *trailing)`` tensor of its dtype (a view)."""
        raw = section[self.begin : self.begin + self.nbytes]
        return raw.view(self.dtype).view(sum(self.rows), *self.trailing)


class ViewPlan(NamedTuple):
    """Validated views of a safetensors header, reusable for every buffer with that header."""

    end: int  # the data section must hold at least this many bytes
    groups: tuple[Group, ...]
    copies: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]  # misaligned: (key, dtype, shape, begin, nbytes), copied


def group_entries(items: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]) -> ViewPlan:
    """Adjacent aligned entries (sorted by offset) of one dtype and trailing shape as groups;
    misaligned ones as copies."""
    runs: list[list[tuple[str, torch.dtype, tuple[int, ...], int, int]]] = []
    copies = []
    for item in items:
        _, dtype, shape, begin, _ = item
        if begin % ITEMSIZE[dtype]:
            copies.append(item)
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and last[3] + last[4] == begin and last[1] == dtype and _kind(last[2]) == _kind(shape):
            runs[-1].append(item)
        else:
            runs.append([item])
    groups = tuple(
        Group(
            begin=run[0][3],
            nbytes=sum(it[4] for it in run),
            dtype=run[0][1],
            trailing=run[0][2][1:],
            rows=tuple(it[2][0] if it[2] else 1 for it in run),
            keys=tuple(it[0] for it in run),
            scalar=not run[0][2],
        )
        for run in runs
    )
    return ViewPlan(end=max((it[3] + it[4] for it in items), default=0), groups=groups, copies=tuple(copies))


def plan_views(header: Mapping[str, Any]) -> ViewPlan:
    """Validate a safetensors ``header`` and plan its views (see :func:`views`).

    Adjacent entries of one dtype whose dimensions after the first agree form one
    :class:`Group` (cut with one ``split``); entries not aligned to their element size are
    copied instead.

    Raises:
        WireFormatError: an unknown dtype, a bad shape or offsets that do not fit it.
    """
    items: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    key = ""
    try:
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = FROM_NAME[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
                raise ValueError(f"bad offsets {begin}..{end}")
            if not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"bad shape {list(shape)}")
            if math.prod(d for d in shape if d) >= 2**62:
                raise ValueError(f"shape {list(shape)} is larger than any tensor can be")  # torch's numel overflows, even with a 0 in it
            if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
                raise ValueError(f"offsets {begin}..{end} do not fit shape {list(shape)}")
            items.append((key, dtype, shape, begin, end - begin))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise WireFormatError(f"bad safetensors header entry {key!r}: {exc}; the buffer was not written by lorasync or safetensors, or is corrupt") from exc
    items.sort(key=lambda item: item[3])
    return group_entries(items)


class BufferViews(dict):  # type: ignore[type-arg]
    """The name → tensor dict :func:`apply_views` returns, which also remembers the data section
    and the plan it was cut from, so that :meth:`copy_to` copies every tensor with one copy of the
    section instead of one per tensor (an engine worker copies each staged adapter this way on
    every build: 504 tensors for Qwen3-8B).

    :meth:`copy_to` answers None (copy the tensors one by one) unless the copy of the section is
    exactly a copy of each tensor as the dict holds it now, sharing no memory between entries:

    * the plan cuts every entry from the section (no entry it had to copy, being misaligned) and
      no two entries overlap (:func:`_disjoint`, once per plan);
    * the dict was not changed through its methods (each forgets the section), and every value is
      still the view it was cut as: the same data pointer, shape, strides and dtype as when cut
      (a value replaced through ``dict``'s own methods, or re-pointed with ``.data =`` or
      ``set_``, no longer is);
    * pickled, it is a plain dict (the unpickled tensors are not views of anything).
    """

    __slots__ = ("flat", "plan", "_cut")

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self.flat = self.plan = self._cut = None

    def _cut_from(self, flat: torch.Tensor, plan: ViewPlan) -> BufferViews:
        """Remember that these values are ``plan``'s views of ``flat`` (only :func:`apply_views`,
        which just cut them, says so)."""
        self.flat, self.plan = flat, plan
        self._cut = _fingerprint(flat, self) if not plan.copies and _disjoint(plan) else None
        return self

    def copy_to(self, *, pin_memory: bool | None = None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """A copy of every tensor, in this dict's order, sharing no memory with them or with each
        other: one copy of the section cut the same way; None where that would not be such a
        copy (the class docstring).

        Args:
            pin_memory: for a section on the host, copy into page-locked memory; None: as the
                section is.
            dtype: cast every tensor to it (None: keep each one's own). Where every tensor has one
                other dtype, the section is cast whole, one kernel, and cut at the offsets the
                cast moved them to: each value is cast as ``tensor.to(dtype)`` casts it (a cast is
                elementwise; the padding between tensors is cast too, and never read; a NaN stays
                a NaN, though torch's own cast keeps or drops a NaN's sign and payload bits
                depending on the tensor's length, so those bits may differ). Tensors of several
                dtypes: None.
        """
        flat, plan = self.flat, self.plan
        if flat is None or plan is None or self._cut is None or _fingerprint(flat, self) != self._cut:
            return None
        pinned = flat.device.type == "cpu" and (flat.is_pinned() if pin_memory is None else pin_memory)
        source = {g.dtype for g in plan.groups}
        if dtype is None or source <= {dtype}:
            section, cut, dtype = flat, plan, None  # no cast: the bytes as they are
        elif len(source) == 1:
            (kind,) = source
            recast = _recast(plan, kind, dtype)
            if recast is None or recast[0] * kind.itemsize > flat.numel():
                return None
            count, cut = recast
            try:
                section = flat[: count * kind.itemsize].view(kind)
            except RuntimeError:
                return None  # a section that does not start at a whole element: cast tensor by tensor
        else:
            return None
        target = dtype or section.dtype
        if pinned:
            copy = torch.empty(section.shape, dtype=target, pin_memory=True).copy_(section)
        else:
            copy = section.to(dtype=target, copy=True)
        return dict(apply_views(copy.view(torch.uint8), cut))

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))

    def _changed(self) -> None:
        self.flat = self.plan = self._cut = None

    def __setitem__(self, key: Any, value: Any) -> None:
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._changed()
        super().__delitem__(key)

    def __ior__(self, other: Any) -> BufferViews:
        self._changed()
        return super().__ior__(other)  # type: ignore[no-any-return]

    def pop(self, *args: Any) -> Any:
        self._changed()
        return super().pop(*args)

    def popitem(self) -> Any:
        self._changed()
        return super().popitem()

    def clear(self) -> None:
        self._changed()
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._changed()
        return super().setdefault(key, default)


def _fingerprint(flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    """What the section is, and what each entry is: its key, and where and how its tensor looks
    into memory (a lazily negated or conjugated view, or another tensor class, reads otherwise)."""
    section = (id(flat), flat.data_ptr(), flat.numel(), flat.dtype, flat.is_neg(), flat.is_conj(), type(flat))
    return (section, *((k, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_neg(), t.is_conj(), type(t)) for k, t in dict.items(tensors)))  # type: ignore[arg-type]


@functools.lru_cache(maxsize=64)
def _recast(view_plan: ViewPlan, source: torch.dtype, target: torch.dtype) -> tuple[int, ViewPlan] | None:
    """``view_plan`` for its section cast whole from ``source`` to ``target``: how many ``source``
    elements the cast covers, and the plan with every offset moved to the cast's bytes; None
    where an entry does not start at a whole element (cast those tensor by tensor)."""
    inner, outer = source.itemsize, target.itemsize  # any torch dtype: float8 and complex too
    if view_plan.copies or any(g.begin % inner or g.nbytes % inner or g.dtype != source for g in view_plan.groups):
        return None
    count = -(-view_plan.end // inner)
    groups = tuple(g._replace(begin=g.begin // inner * outer, nbytes=g.nbytes // inner * outer, dtype=target) for g in view_plan.groups)
    return count, ViewPlan(end=count * outer, groups=groups, copies=())


@functools.lru_cache(maxsize=64)
def _disjoint(view_plan: ViewPlan) -> bool:
    """No two entries of ``view_plan`` share a byte (a writer that stores one tensor's bytes once
    for two names would otherwise give two copies that alias each other). The entries of a group
    lie back to back by construction (:func:`group_entries`): only groups and copies can overlap."""
    spans = sorted([(g.begin, g.nbytes) for g in view_plan.groups] + [(begin, nbytes) for _, _, _, begin, nbytes in view_plan.copies])
    spans = [s for s in spans if s[1] > 0]
    return all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def apply_views(flat: torch.Tensor, view_plan: ViewPlan) -> BufferViews:
    """The tensors of ``view_plan`` inside the ``uint8`` data section ``flat`` (views, in data
    order; misaligned entries copied), as a :class:`BufferViews` that remembers ``flat``.

    Raises:
        WireFormatError: ``flat`` is shorter than the plan needs.
    """
    if view_plan.end > flat.numel():
        raise WireFormatError(f"the header needs {view_plan.end} data bytes, the buffer holds {flat.numel()}")
    out = dict(zip(itertools.chain.from_iterable(g.keys for g in view_plan.groups), cut_groups(flat, view_plan.groups)))
    for key, dtype, shape, begin, nbytes in view_plan.copies:
        out[key] = flat[begin : begin + nbytes].clone().view(dtype).view(shape)
    return BufferViews(out)._cut_from(flat, view_plan)


def views(flat: torch.Tensor, header: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors described by a safetensors ``header`` inside the ``uint8`` data section ``flat``.

    Every entry's offsets are checked against its dtype, shape and ``flat``'s size before any
    view is made; entries not aligned to their element size are copied instead of viewed.

    Raises:
        WireFormatError: an unknown dtype, a bad shape or offsets outside ``flat``.
    """
    return apply_views(flat, plan_views(header))


def raw_bytes(tensor: torch.Tensor) -> Any:
    """The bytes of a CPU-contiguous tensor as a flat ``uint8`` numpy view (nothing is copied)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def cut_groups(flat: torch.Tensor, groups: Sequence[Group]) -> list[torch.Tensor]:
    """Views of every tensor of ``groups`` in ``flat``, in data order: one ``split`` per group."""
    out: list[torch.Tensor] = []
    for group in groups:
        parts = group.block(flat).split(group.rows)  # every view cut in one C++ call
        if group.scalar:
            parts = tuple(p.view(()) for p in parts)
        out.extend(parts)
    return out


def _kind(shape: tuple[int, ...]) -> tuple[bool, tuple[int, ...]]:
    """What tensors must share to form one group: being 0-D, and every dimension after the first."""
    return not shape, shape[1:]
