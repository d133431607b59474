"""Parameters as one flat buffer per dtype and device, with named views.

No paper: this is how torch's own optimisers (``foreach``/``fused``), DDP's gradient buckets
and ZeRO make per-parameter arithmetic cheap, applied to the stale-update core. A model is a
few hundred tensors (DenseNet121: 364); a Python loop over them costs microseconds per tensor
per operation, and every intermediate (``a + b``, then ``· c``) is a fresh model-sized
allocation. On one contiguous buffer the same arithmetic is one vector operation, and a
correction made of several operations runs chunk by chunk so that its intermediates stay in
cache (:func:`delay_compensate_flat`, :func:`ErrorFeedbackState.apply`).

A :class:`FlatParams` *is* a ``Params`` (a ``dict`` of named tensors): every caller that reads
tensors by name keeps working. Its floating (and complex) tensors are views of one 1-D buffer
per (dtype, device) group, in the order of a :class:`Layout`; integer and bool tensors (a
BatchNorm's ``num_batches_tracked``) are kept as they are ("loose": they never take part in
arithmetic, see :mod:`fedasync.tensors`). The functions in :mod:`fedasync.tensors` and
:mod:`fedasync.corrections` take the fused path here when all their arguments are
:class:`FlatParams` of one layout, and the per-tensor reference path otherwise; the two agree
to within float rounding (tests/test_flat.py).

Rules:

- A :class:`FlatParams` is read-only: assigning or deleting a name raises ``TypeError`` (its
  tensors share memory with its buffers, and with whoever else holds them). ``dict(p)`` is a
  plain, mutable dict of the same tensors.
- Layouts are interned: two :class:`FlatParams` have the same layout iff ``a.layout is
  b.layout``, an O(1) check (names, shapes, dtypes and devices of every tensor agree).
- Pickled (``torch.save``, ``copy.deepcopy``), a :class:`FlatParams` becomes a plain dict, so
  checkpoints load with ``weights_only=True``; :func:`flatten` makes it flat again.

One file (over 700 lines) because it is one thing: the layout, the buffers' views and every
fused kernel over them share the layout's private offsets, and the fused paths are held to
the per-tensor reference here and in tests/test_flat.py as one set.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedasync.types import Params

CHUNK = 1 << 18
"""Elements per chunk of a fused multi-operation pass (1 MiB of float32: fits in L2)."""

EXACT_TOPK_MAX = 1 << 18
"""Up to this many elements the top-k threshold is exact (``torch.kthvalue``); above it, it is
estimated from a fixed sample (:func:`compress_topk`)."""

TOPK_SAMPLE = 1 << 16
"""Sample size of the estimated top-k threshold."""


def _arithmetic(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


@dataclass(frozen=True, eq=False)
class Group:
    """The tensors of one dtype and device, in buffer order."""

    dtype: torch.dtype
    device: torch.device
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    numel: int
    strides: tuple[tuple[int, ...], ...]
    """Contiguous strides of each shape."""
    offsets: tuple[int, ...]
    """Where each tensor starts in the buffer."""


@dataclass(frozen=True, eq=False)
class Layout:
    """Where every named tensor of a :class:`FlatParams` lives. Interned: compare with ``is``."""

    groups: tuple[Group, ...]
    loose: tuple[tuple[str, torch.Size, torch.dtype, torch.device], ...]
    """The non-arithmetic tensors: (name, shape, dtype, device)."""

    @property
    def numel(self) -> int:
        """Elements in the buffers (the arithmetic tensors)."""
        return sum(g.numel for g in self.groups)

    @property
    def names(self) -> list[str]:
        """Every name, in the order a :class:`FlatParams` of this layout iterates them."""
        return [n for g in self.groups for n in g.names] + [n for n, *_ in self.loose]

    def arithmetic(self) -> Layout:
        """This layout without its loose tensors (what ``applied_change`` returns)."""
        return _intern(tuple(_group_key(g) for g in self.groups), ())


_LAYOUTS: dict[tuple, Layout] = {}
_LAYOUTS_MAX = 1024
_LOCK = threading.Lock()


def _group_key(g: Group) -> tuple:
    return (g.dtype, g.device, g.names, g.shapes)


def _intern(group_keys: tuple, loose: tuple) -> Layout:
    key = (group_keys, loose)
    with _LOCK:
        hit = _LAYOUTS.get(key)
        if hit is not None:
            return hit
        groups = []
        for dtype, device, names, shapes in group_keys:
            numels = tuple(math.prod(s) for s in shapes)
            strides = tuple(_contiguous_strides(s) for s in shapes)
            offsets = tuple(sum(numels[:i]) for i in range(len(numels)))
            groups.append(
                Group(dtype, device, names, shapes, numels, sum(numels), strides, offsets)
            )
        layout = Layout(tuple(groups), loose)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:  # a long-lived process meeting many models
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = layout
        return layout


def layout_of(p: Params) -> Layout:
    """The layout of ``p``: its arithmetic tensors grouped by (dtype, device) in the order of
    first appearance, each group in ``p``'s order; the other tensors loose, by name."""
    if isinstance(p, FlatParams):
        return p.layout
    order: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Size]]] = {}
    loose = []
    for k, v in p.items():
        if _arithmetic(v):
            order.setdefault((v.dtype, v.device), []).append((k, v.shape))
        else:
            loose.append((k, v.shape, v.dtype, v.device))
    group_keys = tuple(
        (dtype, device, tuple(n for n, _ in items), tuple(s for _, s in items))
        for (dtype, device), items in order.items()
    )
    return _intern(group_keys, tuple(sorted(loose, key=lambda x: x[0])))


def packed_layout(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    loose: Params,
) -> Layout:
    """The layout of one packed buffer of ``dtype`` on the CPU holding ``names`` (of
    ``shapes``, in order) beside the ``loose`` non-arithmetic tensors (what the wire decoder
    gets; equal to :func:`layout_of` of the same dict)."""
    cpu = torch.device("cpu")
    group = (dtype, cpu, tuple(names), tuple(torch.Size(s) for s in shapes))
    loose_key = sorted((k, v.shape, v.dtype, v.device) for k, v in loose.items())
    return _intern((group,), tuple(loose_key))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _views(buf: torch.Tensor, g: Group) -> Iterable[torch.Tensor]:
    # as_strided is the cheapest view to make from Python (~1 us; split + view costs ~5x that,
    # and views are made for every tensor of every model a fold produces)
    strided = buf.as_strided
    base = buf.storage_offset()
    offsets = g.offsets if base == 0 else [o + base for o in g.offsets]
    return map(strided, g.shapes, g.strides, offsets)


_READ_ONLY = (
    "a FlatParams is read-only (its tensors are views of shared buffers): build a new one, "
    "or use dict(p) for a plain dict of the same tensors"
)


class FlatParams(dict):
    """A ``Params`` whose arithmetic tensors are views of one flat buffer per group.

    The views are made when the dict is first read (a view costs ~3 us to make from Python:
    1 ms for DenseNet121's 364 tensors, as much as the arithmetic of a small model). The fused
    paths read only ``buffers``, so an update decoded, corrected and folded, and a model
    version that is only sent on and kept as a snapshot, never pay for them. Every dict
    method reads through them; CPython's own merges (``dict(p)``, ``{**p}``, ``f(**p)``) go
    through ``keys``/``__getitem__`` because ``__iter__`` is overridden."""

    __slots__ = ("layout", "buffers", "finite", "bound", "loose", "_made")

    layout: Layout
    buffers: tuple[torch.Tensor, ...]
    finite: bool | None
    """Whether every buffer is finite, when the operation that made it learnt it (None).
    Another reason never to write into a FlatParams' tensors: it would not know."""
    bound: float | None
    """An upper bound on every element's magnitude, when the operation that made it learnt
    one (None): a fold of a finite update of known norm into it then proves its result
    finite without reading it (:func:`axpy_sunk`)."""
    loose: Params
    """The non-arithmetic tensors (shared, read-only by convention)."""
    _made: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Build one with :func:`flatten` or :func:`from_buffers`, not directly."""
        raise TypeError("use fedasync.flat.flatten(params) or from_buffers(layout, buffers)")

    def _views(self) -> None:
        if self._made:
            return
        for g, buf in zip(self.layout.groups, self.buffers):
            dict.update(self, zip(g.names, _views(buf, g)))
        dict.update(self, ((n, self.loose[n]) for n, *_ in self.layout.loose))
        object.__setattr__(self, "_made", True)

    def __getitem__(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (a view of its buffer)."""
        if not self._made:
            self._views()
        return dict.__getitem__(self, key)

    def __iter__(self) -> Iterator[str]:
        """The names, buffers' order then the loose tensors by name."""
        self._views()
        return dict.__iter__(self)

    def __len__(self) -> int:
        """Number of tensors."""
        return len(self.layout.loose) + sum(len(g.names) for g in self.layout.groups)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` names a tensor."""
        self._views()
        return dict.__contains__(self, key)

    def __eq__(self, other: object) -> bool:
        """As dicts (tensors compare by identity, as in any dict)."""
        self._views()
        return dict.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def keys(self) -> Any:
        """The names."""
        self._views()
        return dict.keys(self)

    def values(self) -> Any:
        """The tensors."""
        self._views()
        return dict.values(self)

    def items(self) -> Any:
        """(name, tensor) pairs."""
        self._views()
        return dict.items(self)

    def get(self, key: str, default: Any = None) -> Any:
        """The tensor ``key``, or ``default``."""
        self._views()
        return dict.get(self, key, default)

    def copy(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """A plain dict of the same tensors."""
        self._views()
        return dict(dict.items(self))

    def __or__(self, other: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """A plain dict: these tensors, then ``other``'s."""
        return {**self.copy(), **other}

    def __ror__(self, other: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """A plain dict: ``other``'s tensors, then these."""
        return {**other, **self.copy()}

    def __reversed__(self) -> Iterator[str]:
        """The names, last first."""
        self._views()
        return dict.__reversed__(self)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        """Refused: read-only."""
        raise TypeError(_READ_ONLY)

    def __delitem__(self, key: str) -> None:
        """Refused: read-only."""
        raise TypeError(_READ_ONLY)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Refused: read-only."""
        raise TypeError(_READ_ONLY)

    def pop(self, *args: Any) -> Any:
        """Refused: read-only."""
        raise TypeError(_READ_ONLY)

    def popitem(self) -> Any:
        """Refused: read-only."""
        raise TypeError(_READ_ONLY)

    def setdefault(self, *args: Any) -> Any:
        """Refused: read-only."""
        raise TypeError(_READ_ONLY)

    def clear(self) -> None:
        """Refused: read-only."""
        raise TypeError(_READ_ONLY)

    def __ior__(self, other: Any) -> Any:  # type: ignore[misc]
        """Refused: read-only."""
        raise TypeError(_READ_ONLY)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as a plain dict (checkpoints load with ``weights_only=True``)."""
        return (dict, (list(self.items()),))

    def __repr__(self) -> str:
        """Names and sizes, not values."""
        return f"FlatParams({len(self)} tensors, {self.layout.numel} elements)"

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers and the loose tensors."""
        return sum(b.nbytes for b in self.buffers) + sum(v.nbytes for v in self.loose.values())


def from_buffers(
    layout: Layout, buffers: Sequence[torch.Tensor], loose: Params | None = None
) -> FlatParams:
    """A :class:`FlatParams` over ``buffers`` (one 1-D tensor per group, not copied); the loose
    tensors come from ``loose`` (not copied either: shared, read-only by convention)."""
    if len(buffers) != len(layout.groups):
        raise ValueError(f"{len(buffers)} buffers for {len(layout.groups)} groups")
    for g, buf in zip(layout.groups, buffers):
        if buf.dim() != 1 or buf.numel() != g.numel or buf.dtype != g.dtype:
            raise ValueError(
                f"buffer of {tuple(buf.shape)} {buf.dtype} for a group of {g.numel} {g.dtype}"
            )
    if layout.loose and loose is None:
        raise ValueError("this layout has loose tensors: pass them")
    p = dict.__new__(FlatParams)
    object.__setattr__(p, "layout", layout)
    object.__setattr__(p, "buffers", tuple(buffers))
    object.__setattr__(p, "finite", None)
    object.__setattr__(p, "bound", None)
    object.__setattr__(p, "loose", {n: loose[n] for n, *_ in layout.loose} if loose else {})
    object.__setattr__(p, "_made", False)
    return p


def flatten(p: Params, *, device: torch.device | str | None = None) -> FlatParams:
    """A :class:`FlatParams` copy of ``p`` (on ``device`` when given). Always a copy: the result
    shares no memory with ``p``."""
    if device is not None:
        p = {k: v.detach().to(device) for k, v in p.items()}
    layout = layout_of(p)
    buffers = []
    for g in layout.groups:
        parts = [p[n].detach().reshape(-1) for n in g.names]
        buffers.append(torch.cat(parts) if len(parts) > 1 else parts[0].clone())
    loose = {n: p[n].detach().clone() for n, *_ in layout.loose}
    return from_buffers(layout, buffers, loose)


def as_flat(p: Params, like: FlatParams) -> FlatParams:
    """``p`` itself when it has ``like``'s layout, else a flat copy of it in that layout
    (same names, shapes and dtypes required: ``KeyError``/``ValueError`` otherwise)."""
    if isinstance(p, FlatParams) and p.layout is like.layout:
        return p
    if p.keys() != like.keys():
        raise KeyError("tensor names differ from the layout's")
    buffers = []
    for g in like.layout.groups:
        out = torch.empty(g.numel, dtype=g.dtype, device=g.device)
        for view, n in zip(_views(out, g), g.names):
            view.copy_(p[n].detach())
        buffers.append(out)
    loose = {n: p[n].detach() for n, *_ in like.layout.loose}
    return from_buffers(like.layout, buffers, loose)


def same(*ps: Params) -> bool:
    """True when every argument is a :class:`FlatParams` and all share one layout."""
    first = ps[0]
    if not isinstance(first, FlatParams):
        return False
    return all(isinstance(p, FlatParams) and p.layout is first.layout for p in ps[1:])


# ------------------------------------------------------------------ buffer pool

POOL_MIN_BYTES = 1 << 22
"""Buffers from this size on are recycled (below it the allocator's own free lists do)."""

POOL_PER_SIZE = 8
"""Buffers the pool keeps per (numel, dtype, device)."""

_POOL: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}


def _in_use(b: torch.Tensor) -> bool:
    # the storage's owners: ``b`` itself, the temporary storage object asked here, and every
    # tensor (alias, view) anyone else holds
    return torch._C._storage_Use_Count(b.untyped_storage()._cdata) > 2


def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D buffer, recycled when one of that size is no longer used.

    A fresh model-sized buffer is mapped from the OS and costs a page fault per 4 KiB on its
    first write: for a 7M-parameter model that made allocating the next version cost more
    than computing it (a fold was 4x the arithmetic). The pool keeps up to
    :data:`POOL_PER_SIZE` buffers of each size of at least :data:`POOL_MIN_BYTES` and hands
    one out again once nothing references its memory (its storage's use count, which counts
    every tensor and view of it: a buffer still referenced anywhere is never handed out).
    What it returns is an alias, never the pool's own tensor."""
    if numel * dtype.itemsize < POOL_MIN_BYTES:
        return torch.empty(numel, dtype=dtype, device=device)
    key = (numel, dtype, torch.device(device))
    with _LOCK:
        bufs = _POOL.setdefault(key, [])
        for b in bufs:
            if not _in_use(b):
                return b.view(-1)
        b = torch.empty(numel, dtype=dtype, device=device)
        if len(bufs) < POOL_PER_SIZE:
            bufs.append(b)
            return b.view(-1)
        return b


def empty_like(b: torch.Tensor) -> torch.Tensor:
    """:func:`empty` of ``b``'s size, dtype and device."""
    return empty(b.numel(), b.dtype, b.device)


# ------------------------------------------------------------------ fused operations
# Every function takes FlatParams of one layout (the caller checks ``same``) and returns a new
# FlatParams; loose tensors come from the first argument unless said otherwise.


def new(layout: Layout, buffers: Iterable[torch.Tensor], loose_from: FlatParams) -> FlatParams:
    """:func:`from_buffers` with ``loose_from``'s loose tensors."""
    return from_buffers(layout, list(buffers), loose_from.loose)


def clone(p: FlatParams) -> FlatParams:
    """A copy of the buffers (loose tensors cloned too)."""
    loose = {k: v.clone() for k, v in p.loose.items()}
    return from_buffers(p.layout, [empty_like(b).copy_(b) for b in p.buffers], loose)


def zeros_like(p: FlatParams) -> FlatParams:
    """Zero buffers; loose tensors cloned."""
    loose = {k: v.clone() for k, v in p.loose.items()}
    return from_buffers(p.layout, [torch.zeros_like(b) for b in p.buffers], loose)


def add(a: FlatParams, b: FlatParams) -> FlatParams:
    """``a + b``."""
    return new(a.layout, (x + y for x, y in zip(a.buffers, b.buffers)), a)


def sub(a: FlatParams, b: FlatParams) -> FlatParams:
    """``a − b``."""
    return new(a.layout, (x - y for x, y in zip(a.buffers, b.buffers)), a)


def scale(p: FlatParams, c: float) -> FlatParams:
    """``c · p``."""
    return new(p.layout, (b * c for b in p.buffers), p)


def axpy(
    a: float, x: FlatParams, y: FlatParams, loose_from: FlatParams | None = None
) -> FlatParams:
    """``a · x + y`` (loose tensors from ``x``, or ``loose_from``). On the CPU, chunk by chunk,
    summing each chunk while it is in cache: the result knows whether it is finite
    (:func:`is_finite` then costs nothing), which the server checks of every new model."""
    out, finite = [], True
    for xb, yb in zip(x.buffers, y.buffers):
        o = empty_like(yb)
        for c in _chunks(o.numel(), o.device):
            torch.add(yb[c], xb[c], alpha=a, out=o[c])
            if finite and o.device.type == "cpu" and not _sum_finite(o[c]):
                finite = bool(torch.isfinite(o[c]).all())
        out.append(o)
    res = new(x.layout, out, x if loose_from is None else loose_from)
    if x.buffers and x.buffers[0].device.type == "cpu":
        object.__setattr__(res, "finite", finite)
    return res


def axpy_applied(
    a: float, x: FlatParams, y: FlatParams, loose_from: FlatParams | None = None
) -> tuple[FlatParams, FlatParams]:
    """:func:`axpy`, and the change it made, ``(a·x + y) − y``, over the arithmetic tensors
    (:func:`arithmetic_diff`), in the same chunked pass: the difference is taken while the
    chunk is in cache (what a fold that attributes its change to a silo needs)."""
    out, diffs, finite = [], [], True
    for xb, yb in zip(x.buffers, y.buffers):
        o, d = empty_like(yb), empty_like(yb)
        for c in _chunks(o.numel(), o.device):
            torch.add(yb[c], xb[c], alpha=a, out=o[c])
            torch.sub(o[c], yb[c], out=d[c])
            if finite and o.device.type == "cpu" and not _sum_finite(o[c]):
                finite = bool(torch.isfinite(o[c]).all())
        out.append(o)
        diffs.append(d)
    res = new(x.layout, out, x if loose_from is None else loose_from)
    if x.buffers and x.buffers[0].device.type == "cpu":
        object.__setattr__(res, "finite", finite)
    return res, from_buffers(y.layout.arithmetic(), diffs)


@dataclass(frozen=True)
class Sink:
    """A running sum a fused fold adds into in its own pass (:func:`axpy_sunk`): ``dsts``,
    one 1-D tensor per buffer of the update (the sum's part over that buffer's elements),
    gets ``coef`` times the update (``of="update"``) or the change the fold makes to the
    model (``of="change"``: ``a·x`` for a fold of ``a`` times the update ``x``; what the new
    model holds differs from it by that model's float rounding). A span-sketch row and a
    silo's ledger sum are two."""

    dsts: tuple[torch.Tensor, ...]
    coef: float = 1.0
    of: str = "update"

    def alpha(self, a: float) -> float:
        """What this sink adds times the update ``x`` in a fold of ``a·x``."""
        return self.coef if self.of == "update" else self.coef * a


def axpy_sunk(
    a: float,
    x: FlatParams,
    y: FlatParams,
    sinks: Sequence[Sink],
    loose_from: FlatParams,
    norm: float | None = None,
) -> FlatParams | None:
    """:func:`axpy`, adding into each of ``sinks`` in the same chunked pass, while the chunk
    is in cache: the update's chunk, or the change's (``a·x``: the new model's rounding
    aside, what the fold changed; no model-sized copy of it is written). CPU buffers only
    (None elsewhere: the caller's unfused path runs).

    The result knows whether it is finite, and a bound on its elements' magnitude. With
    ``norm`` (``x``'s L2 norm, finite: every element of ``x`` is at most that) and ``y``'s
    bound, ``|y_i + a·x_i| <= bound + |a|·norm``: below half a dtype's largest number, the
    result is finite without reading it. Otherwise each chunk's least and greatest elements
    are read while it is in cache (a NaN or inf shows), giving the bound anew. When the
    result is not finite, what was added to the sinks is taken back (to rounding), and the
    caller refuses the update."""
    if not all(b.device.type == "cpu" for b in (*x.buffers, *y.buffers)):
        return None
    if any(len(k.dsts) != len(x.buffers) for k in sinks):
        raise ValueError("a sink has one part per buffer of the update")
    step = abs(a) * norm if norm is not None and math.isfinite(norm) else math.inf
    bound = y.bound + step if y.finite and y.bound is not None else math.inf
    out: list[torch.Tensor] = []
    finite, seen = True, 0.0
    for i, (xb, yb) in enumerate(zip(x.buffers, y.buffers)):
        o = empty_like(yb)
        proven = bound < torch.finfo(o.dtype).max / 2
        for c in _chunks(o.numel(), o.device):
            torch.add(yb[c], xb[c], alpha=a, out=o[c])
            if not proven and finite:
                lo, hi = torch.aminmax(o[c])
                m = max(-float(lo), float(hi))
                finite, seen = math.isfinite(m), max(seen, m)
                if not finite:
                    _unsink(a, x, sinks, i, c.start)
            if finite:
                _sink(a, xb[c], sinks, i, c)
        if proven:
            seen = max(seen, bound)
        out.append(o)
    res = new(x.layout, out, loose_from)
    object.__setattr__(res, "finite", finite)
    object.__setattr__(res, "bound", seen if finite else None)
    return res


def _sink(a: float, xc: torch.Tensor, sinks: Sequence[Sink], i: int, c: slice) -> None:
    """One chunk of the update ``xc`` into the sinks (part ``i``, elements ``c``): the change
    is ``a·x``."""
    for k in sinks:
        k.dsts[i][c].add_(xc, alpha=k.alpha(a))


def _unsink(a: float, x: FlatParams, sinks: Sequence[Sink], i: int, stop: int) -> None:
    """Take back from ``sinks`` what the chunks before buffer ``i``'s element ``stop`` added
    (to rounding): a fold whose result is not finite adds nothing."""
    for j, xb in enumerate(x.buffers[: i + 1]):
        n = stop if j == i else xb.numel()
        if n == 0:
            continue
        for k in sinks:
            k.dsts[j][:n].sub_(xb[:n], alpha=k.alpha(a))


def _sum_finite(b: torch.Tensor) -> bool:
    """A finite sum proves every element finite (a NaN or inf makes it NaN or inf)."""
    return b.numel() == 0 or math.isfinite(abs(complex(b.sum())))


def add_in_place(acc: FlatParams, x: FlatParams) -> None:
    """``acc += x``, buffer by buffer, for an ``acc`` its caller owns (a running sum nobody
    else holds: FlatParams are otherwise never written); ``acc`` no longer claims to know
    whether it is finite."""
    for ab, xb in zip(acc.buffers, x.buffers):
        ab.add_(xb)
    object.__setattr__(acc, "finite", None)
    object.__setattr__(acc, "bound", None)


def weighted_sum(ps: Sequence[FlatParams], weights: Sequence[float]) -> FlatParams:
    """``Σ_i w_i · p_i`` (loose tensors from ``ps[0]``)."""
    out = []
    for i in range(len(ps[0].buffers)):
        acc = ps[0].buffers[i] * float(weights[0])
        for p, w in zip(ps[1:], weights[1:]):
            acc.add_(p.buffers[i], alpha=float(w))
        out.append(acc)
    return new(ps[0].layout, out, ps[0])


def arithmetic_diff(new_p: FlatParams, old: FlatParams) -> FlatParams:
    """``new − old`` over the arithmetic tensors only (``applied_change``)."""
    layout = old.layout.arithmetic()
    return from_buffers(layout, [n - o for n, o in zip(new_p.buffers, old.buffers)])


def global_norm(p: FlatParams) -> float:
    """L2 norm over the buffers: one pass each, widened to float64 only when it overflowed."""
    total = 0.0
    for b in p.buffers:
        n = float(torch.linalg.vector_norm(b))
        if not math.isfinite(n):
            if not bool(torch.isfinite(b).all()):
                return float("nan") if bool(torch.isnan(b).any()) else float("inf")
            wide = torch.complex128 if b.is_complex() else torch.float64
            n = float(torch.linalg.vector_norm(b.to(wide)))
        total += n * n
    return math.sqrt(total)


def is_finite(p: FlatParams) -> bool:
    """No NaN or ±inf in any buffer. A finite sum proves it (any NaN/inf makes the sum
    non-finite) at the cost of one read; only a non-finite sum (or an overflow) is checked
    element by element. Free when the operation that made ``p`` learnt it."""
    if p.finite is not None:
        return p.finite
    for b in p.buffers:
        if not _sum_finite(b) and not bool(torch.isfinite(b).all()):
            return False
    return True


# ------------------------------------------------------------------ chunked fused passes

_SCRATCH = threading.local()


def _scratch(dtype: torch.dtype, device: torch.device, n: int, slot: int = 0) -> torch.Tensor:
    """A reusable chunk-sized buffer (per thread, dtype, device and slot)."""
    cache = getattr(_SCRATCH, "bufs", None)
    if cache is None:
        cache = _SCRATCH.bufs = {}
    key = (dtype, device, slot)
    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        buf = cache[key] = torch.empty(max(n, CHUNK), dtype=dtype, device=device)
    return buf[:n]


def _chunks(n: int, device: torch.device) -> Iterable[slice]:
    if device.type != "cpu":  # a GPU streams whole buffers; chunking only adds launches
        yield slice(0, n)
        return
    for i in range(0, n, CHUNK):
        yield slice(i, min(i + CHUNK, n))


def delay_compensate_flat(
    delta: FlatParams, w_now: FlatParams, w_base: FlatParams, coef: float
) -> FlatParams:
    """``Δ − coef·Δ⊙Δ⊙(w_now − w_base)`` into a new buffer, chunk by chunk (one read of each
    input and one write; the intermediates stay in cache). ``coef`` is λ/lr."""
    out = []
    for d, wn, wb in zip(delta.buffers, w_now.buffers, w_base.buffers):
        o = empty_like(d)
        for c in _chunks(d.numel(), d.device):
            tmp = _scratch(d.dtype, d.device, c.stop - c.start)
            torch.sub(wn[c], wb[c], out=tmp)
            tmp.mul_(d[c])
            torch.addcmul(d[c], d[c], tmp, value=-coef, out=o[c])
        out.append(o)
    return new(delta.layout, out, delta)


_SAMPLES: dict[tuple[int, int, str], torch.Tensor] = {}


def _sample_index(n: int, m: int, device: torch.device) -> torch.Tensor:
    key = (n, m, str(device))
    idx = _SAMPLES.get(key)
    if idx is None:
        g = torch.Generator().manual_seed(n)  # fixed: the same input gives the same threshold
        # sorted: a gather in address order is ~15x faster than in random order
        idx = torch.randint(0, n, (m,), generator=g).sort().values.to(device)
        if len(_SAMPLES) > 64:
            _SAMPLES.clear()
        _SAMPLES[key] = idx
    return idx


Compensate = tuple[FlatParams, FlatParams, float]
"""(w_now, w_base, λ/lr): delay compensation to apply to an update in the same pass."""


def _compensated(
    d: torch.Tensor, wn: torch.Tensor, wb: torch.Tensor, coef: float, out: torch.Tensor
) -> torch.Tensor:
    """``d − coef·d⊙d⊙(wn − wb)`` into ``out`` (which may not alias ``d``)."""
    torch.sub(wn, wb, out=out)
    out.mul_(d)
    return torch.addcmul(d, d, out, value=-coef, out=out)


def _sample_magnitudes(
    x: FlatParams, residual: FlatParams | None, compensate: Compensate | None
) -> torch.Tensor:
    """|c| at a fixed uniform sample of :data:`TOPK_SAMPLE` positions, c = the compensated
    update plus the residual, computed at those positions only (c itself is never built)."""
    n = x.layout.numel
    parts = []
    for i, b in enumerate(x.buffers):
        m = max(1, round(TOPK_SAMPLE * b.numel() / n))
        idx = _sample_index(b.numel(), m, b.device)
        v = torch.index_select(b, 0, idx)
        if compensate is not None:
            wn, wb, coef = compensate
            at_now = torch.index_select(wn.buffers[i], 0, idx)
            at_base = torch.index_select(wb.buffers[i], 0, idx)
            v = _compensated(v, at_now, at_base, coef, torch.empty_like(v))
        if residual is not None:
            v = v + torch.index_select(residual.buffers[i], 0, idx)
        parts.append(v.abs().to(torch.float64))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _kth_largest(mags: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """The k-th largest value over the 1-D tensors ``mags`` taken together, exact
    (``torch.kthvalue``: an O(n) selection, no sort)."""
    n = sum(t.numel() for t in mags)
    flat = torch.cat(list(mags)) if len(mags) > 1 else mags[0]
    return torch.kthvalue(flat, n - k + 1).values


def compress_topk(
    x: FlatParams,
    residual: FlatParams | None,
    k: int,
    *,
    owned: bool = False,
    compensate: Compensate | None = None,
) -> tuple[FlatParams, FlatParams]:
    """Error feedback's step on flat buffers: c = x + residual (x delay-compensated first when
    ``compensate`` is given), keep the k largest |c| over every buffer together (globally,
    not per tensor), and return (sent, new residual), sent + new residual = c exactly (each
    element goes wholly to one or the other).

    Which k: up to :data:`EXACT_TOPK_MAX` elements exactly (``kthvalue``; ties at the
    threshold go to the lower flat index, as :func:`fedasync.corrections.topk`). Above, the
    threshold is estimated from a fixed uniform sample of :data:`TOPK_SAMPLE` positions (drawn
    once per size: a given input always gives the same threshold) and every |c| above it is
    sent: k·(1 ± ~1%) entries. Under error feedback the count need not be exact (what is not
    sent stays in the residual), and a full selection (``torch.topk`` or ``kthvalue``) of a
    7M-entry vector costs 30-40x a copy of it. Above the limit it is also one fused pass: c
    is made, split and written chunk by chunk (reading x, the residual and the two models,
    writing sent and the residual), never whole.

    ``owned``: ``x`` is the caller's to overwrite. ``residual`` is overwritten with the new
    residual (error feedback owns it)."""
    if x.layout.numel <= EXACT_TOPK_MAX or any(b.is_complex() for b in x.buffers):
        return _compress_exact(x, residual, k, owned=owned, compensate=compensate)
    sample = _sample_magnitudes(x, residual, compensate)
    kk = min(sample.numel(), max(1, round(k * sample.numel() / x.layout.numel)))
    thr = float(torch.kthvalue(sample, sample.numel() - kk + 1).values)
    sent_bufs, res_bufs = [], []
    for i, xb in enumerate(x.buffers):
        in_place = owned and compensate is None and residual is None
        sent = xb if in_place else empty_like(xb)
        r = empty_like(xb) if residual is None else residual.buffers[i]
        for s in _chunks(xb.numel(), xb.device):
            c = xb[s]
            if compensate is not None or residual is not None:
                tmp = _scratch(xb.dtype, xb.device, s.stop - s.start)
                if compensate is not None:
                    wn, wb, coef = compensate
                    c = _compensated(c, wn.buffers[i][s], wb.buffers[i][s], coef, tmp)
                if residual is not None:
                    c = torch.add(c, r[s], out=tmp)
            elif in_place:
                c = _scratch(xb.dtype, xb.device, s.stop - s.start).copy_(c)
            # hardshrink keeps |c| > thr in one kernel (a bool mask and masked_fill_ are ~20x
            # slower per element); c − sent is exactly the part left behind
            torch.ops.aten.hardshrink.out(c, thr, out=sent[s])
            torch.sub(c, sent[s], out=r[s])
        sent_bufs.append(sent)
        res_bufs.append(r)
    return new(x.layout, sent_bufs, x), new(x.layout, res_bufs, x)


def _compress_exact(
    x: FlatParams,
    residual: FlatParams | None,
    k: int,
    *,
    owned: bool,
    compensate: Compensate | None,
) -> tuple[FlatParams, FlatParams]:
    """:func:`compress_topk` with the exact threshold (c is built whole)."""
    if compensate is not None:
        x, owned = delay_compensate_flat(x, *compensate), True
    corrected = []
    for i, b in enumerate(x.buffers):
        if residual is None:
            corrected.append(b if owned else b.clone())
        elif owned:
            corrected.append(b.add_(residual.buffers[i]))
        else:
            corrected.append(b + residual.buffers[i])
    res_bufs = (
        [torch.empty_like(c) for c in corrected] if residual is None else list(residual.buffers)
    )
    mags = [c.abs() for c in corrected]
    thr = _kth_largest(mags, k)
    keeps = [m > thr for m in mags]
    need = k - sum(int(kp.sum()) for kp in keeps)
    for kp, m in zip(keeps, mags):
        if need <= 0:
            break
        ties = torch.nonzero(m == thr).reshape(-1)[:need]
        kp[ties] = True
        need -= ties.numel()
    for c, r, keep in zip(corrected, res_bufs, keeps):
        torch.where(keep, torch.zeros((), dtype=c.dtype, device=c.device), c, out=r)
        c.masked_fill_(~keep, 0)
    return new(x.layout, corrected, x), new(x.layout, res_bufs, x)


def floating_names(p: FlatParams) -> list[str] | None:
    """The names of ``p``'s buffers in order when every buffer is floating (None: not)."""
    if not all(g.dtype.is_floating_point for g in p.layout.groups):
        return None
    return [n for g in p.layout.groups for n in g.names]


def sketched_norm(p: Params, names: Sequence[str]) -> float:
    """L2 norm of ``p``'s tensors ``names``: one pass per buffer when ``p`` is a
    :class:`FlatParams` whose buffers hold exactly ``names`` in that order; 0 when one of
    ``names`` is missing."""
    if isinstance(p, FlatParams) and floating_names(p) == list(names):
        return global_norm(p)
    if not all(n in p for n in names):
        return 0.0
    total = sum(float(torch.linalg.vector_norm(p[n].detach().double())) ** 2 for n in names)
    return math.sqrt(total)


def add_into(
    dst: torch.Tensor,
    p: Params,
    alpha: float,
    offsets: dict[str, tuple[int, int]],
    names: Sequence[str],
) -> bool:
    """``dst += alpha · p`` in place, where ``dst`` (1-D) holds ``names`` at ``offsets``
    (name -> (start, numel)): one fused pass per buffer when ``p`` is a :class:`FlatParams`
    whose buffers hold exactly ``names`` in that order (a span sketch's row,
    `fedasync.unlearning.sketch`), per tensor otherwise. False, and ``dst`` untouched, when
    ``p`` lacks one of ``names`` or a size differs."""
    if isinstance(p, FlatParams) and floating_names(p) == list(names):
        if sum(b.numel() for b in p.buffers) != dst.numel():
            return False
        off = 0
        for b in p.buffers:
            dst[off : off + b.numel()].add_(b.to(dst.device), alpha=alpha)
            off += b.numel()
        return True
    if not all(n in p and p[n].numel() == offsets[n][1] for n in names):
        return False
    for n in names:
        off, k = offsets[n]
        dst[off : off + k].add_(p[n].detach().reshape(-1).to(dst.device), alpha=alpha)
    return True
