"""Small pure helpers over ``Params`` (a dict of named tensors).

No paper: these are the arithmetic the algorithm modules share (FedAsync Xie et al. 2019
arXiv:1903.03934, FedBuff Nguyen et al. 2022, DC-ASGD Zheng et al. 2017 all reduce to
per-tensor linear combinations).

Conventions:

- Every function returns a *new* dict of new tensors and never mutates its inputs.
- Only floating-point (and complex) tensors take part in arithmetic. Other tensors (integer
  buffers such as BatchNorm's ``num_batches_tracked``, bool masks) are copied unchanged from
  the *first* ``Params`` argument. So ``add(a, b)["num_batches_tracked"]`` equals
  ``a["num_batches_tracked"]``, and ``weighted_sum(ps, w)`` takes them from ``ps[0]``.
- Binary operations require the same set of names; a mismatch raises ``KeyError``.
- Fused path: when every argument is a :class:`fedasync.flat.FlatParams` of one layout, the
  operation runs on their flat buffers (one vector operation per dtype instead of one per
  tensor) and returns a ``FlatParams``; otherwise per tensor, as written here (the reference
  the fused path is tested against).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedasync import flat
from fedasync.flat import FlatParams
from fedasync.types import Params


def is_arithmetic(t: torch.Tensor) -> bool:
    """True for tensors that take part in arithmetic (floating point or complex)."""
    return t.is_floating_point() or t.is_complex()


def _check_keys(a: Params, b: Params) -> None:
    if not flat.same(a, b) and a.keys() != b.keys():
        missing = sorted(set(a) - set(b))
        extra = sorted(set(b) - set(a))
        raise KeyError(f"tensor names differ: only in first {missing}, only in second {extra}")


def clone(p: Params) -> Params:
    """Detached copy of every tensor (same device and dtype)."""
    if isinstance(p, FlatParams):
        return flat.clone(p)
    return {k: v.detach().clone() for k, v in p.items()}


def zeros_like(p: Params) -> Params:
    """Zeros for floating tensors; non-floating tensors are copied unchanged."""
    if isinstance(p, FlatParams):
        return flat.zeros_like(p)
    return {
        k: torch.zeros_like(v) if is_arithmetic(v) else v.detach().clone() for k, v in p.items()
    }


def add(a: Params, b: Params) -> Params:
    """``a + b`` per tensor."""
    if flat.same(a, b):
        return flat.add(a, b)  # type: ignore[arg-type]
    _check_keys(a, b)
    return {k: a[k] + b[k] if is_arithmetic(a[k]) else a[k].detach().clone() for k in a}


def sub(a: Params, b: Params) -> Params:
    """``a − b`` per tensor (e.g. ``sub(local, base)`` is a delta)."""
    if flat.same(a, b):
        return flat.sub(a, b)  # type: ignore[arg-type]
    _check_keys(a, b)
    return {k: a[k] - b[k] if is_arithmetic(a[k]) else a[k].detach().clone() for k in a}


def scale(p: Params, c: float) -> Params:
    """``c · p`` per tensor."""
    if isinstance(p, FlatParams):
        return flat.scale(p, c)
    return {k: v * c if is_arithmetic(v) else v.detach().clone() for k, v in p.items()}


def axpy(a: float, x: Params, y: Params) -> Params:
    """``a · x + y`` per tensor; non-floating tensors come from ``x``."""
    if flat.same(x, y):
        return flat.axpy(a, x, y)  # type: ignore[arg-type]
    _check_keys(x, y)
    names = [k for k in x if is_arithmetic(x[k])]
    # one fused call over all tensors (as torch's own optimisers do) instead of one per tensor
    summed = torch._foreach_add([y[k] for k in names], [x[k] for k in names], alpha=a)
    out = dict(zip(names, summed))
    return {k: out[k] if k in out else x[k].detach().clone() for k in x}


def weighted_sum(ps: Sequence[Params], weights: Sequence[float]) -> Params:
    """``Σ_i w_i · p_i`` per tensor; non-floating tensors come from ``ps[0]``.

    ``ps`` and ``weights`` must have the same, non-zero length. The weights are used as given
    (not normalised): divide them yourself for a mean.
    """
    if len(ps) == 0:
        raise ValueError("weighted_sum needs at least one Params")
    if len(ps) != len(weights):
        raise ValueError(f"{len(ps)} Params but {len(weights)} weights")
    if flat.same(*ps):
        return flat.weighted_sum(ps, weights)  # type: ignore[arg-type]
    for p in ps[1:]:
        _check_keys(ps[0], p)
    out: Params = {}
    for k, v0 in ps[0].items():
        if not is_arithmetic(v0):
            out[k] = v0.detach().clone()
            continue
        acc = v0 * float(weights[0])
        for p, w in zip(ps[1:], weights[1:]):
            acc = torch.add(acc, p[k], alpha=float(w))
        out[k] = acc
    return out


def global_norm(p: Params) -> float:
    """L2 norm over all floating tensors together.

    Each tensor's norm is computed in its own precision (no float64 copy of the model: this
    runs once per update on the server's hot path) and only redone in float64 when it
    overflowed; the squares are summed in float64. NaN or inf anywhere gives a non-finite result.
    """
    if isinstance(p, FlatParams):
        return flat.global_norm(p)
    vs = [v.detach() for v in p.values() if is_arithmetic(v)]
    if not vs:
        return 0.0
    norms = torch._foreach_norm(vs)
    fast = float(torch.linalg.vector_norm(torch.stack(norms).double()))
    if math.isfinite(fast):
        return fast
    total = 0.0  # NaN/inf somewhere, or an overflow: per tensor, widening what overflowed
    for v, n_t in zip(vs, norms):
        n = float(n_t)
        if not math.isfinite(n):
            wide = torch.complex128 if v.is_complex() else torch.float64
            n = float(torch.linalg.vector_norm(v.to(wide)))
        total += n * n
    return total**0.5


def clip_by_norm(p: Params, max_norm: float, norm: float | None = None) -> tuple[Params, float]:
    """``p`` scaled so its global L2 norm is at most ``max_norm``, and the factor used.

    ``norm`` is ``global_norm(p)`` when the caller already has it. Only arithmetic tensors
    are scaled (as ``global_norm`` counts them); a ``p`` within the bound comes back as a copy
    with factor 1.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    n = global_norm(p) if norm is None else float(norm)
    c = 1.0 if n <= max_norm else max_norm / n
    return (scale(p, c) if c != 1.0 else clone(p)), c


def is_finite(p: Params) -> bool:
    """True when no floating tensor holds a NaN or ±inf."""
    if isinstance(p, FlatParams):
        return flat.is_finite(p)
    return all(bool(torch.isfinite(v).all()) for v in p.values() if is_arithmetic(v))


def to_cpu(p: Params) -> Params:
    """Detached copy of every tensor on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in p.items()}


def num_elements(p: Params) -> int:
    """Total number of elements over all tensors (floating or not)."""
    return sum(v.numel() for v in p.values())
