"""Params as one flat vector and back, and the span arithmetic on such vectors.

No paper: the convention the rest of :mod:`fedasync.unlearning` works on. A flat vector is
the concatenation of the floating tensors in ``names`` order (sorted key order by default), in
the widest floating dtype present but at least float32. It is a plain ``(d,)`` tensor over
chosen names, not a :class:`fedasync.flat.FlatParams` (a ``Params`` whose tensors are views
of per-dtype buffers). Functions return new tensors and never mutate their inputs; tensors
left out (integer buffers, names not chosen) are copied unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from fedasync.tensors import clone
from fedasync.types import Params


def _float_names(p: Params, names: Sequence[str] | None) -> list[str]:
    if names is None:
        return sorted(k for k, v in p.items() if v.is_floating_point())
    for k in names:
        if k not in p:
            raise KeyError(f"tensor {k!r} is not in the Params")
        if not p[k].is_floating_point():
            raise TypeError(f"tensor {k!r} is {p[k].dtype}, not floating point")
    return list(names)


def _flat_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def params_to_vector(p: Params, names: Sequence[str] | None = None) -> torch.Tensor:
    """The floating tensors of ``p`` in ``names`` order as one vector, shape ``(d,)``.

    ``names`` defaults to the sorted names of all floating tensors. The vector has the widest
    floating dtype present (at least float32) and lives on the first tensor's device.
    """
    keys = _float_names(p, names)
    if not keys:
        return torch.zeros(0)
    ts = [p[k].detach() for k in keys]
    dtype, device = _flat_dtype(ts), ts[0].device
    return torch.cat([t.reshape(-1).to(device=device, dtype=dtype) for t in ts])


def vector_to_params(vec: torch.Tensor, like: Params, names: Sequence[str] | None = None) -> Params:
    """Inverse of :func:`params_to_vector`: cut ``vec (d,)`` back into ``like``'s shapes and dtypes.

    Tensors of ``like`` not covered by ``names`` (non-floating ones, or floating ones left out
    of an explicit ``names``) are copied from ``like``. The result keeps ``like``'s key order.
    """
    keys = _float_names(like, names)
    total = sum(like[k].numel() for k in keys)
    if vec.dim() != 1 or vec.numel() != total:
        raise ValueError(f"vector has shape {tuple(vec.shape)}, expected ({total},)")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for k in keys:
        t = like[k]
        n = t.numel()
        out[k] = vec[offset : offset + n].reshape(t.shape).to(device=t.device, dtype=t.dtype)
        offset += n
    return {k: out[k] if k in out else v.detach().clone() for k, v in like.items()}


def span_basis(vectors: Sequence[torch.Tensor], dim: int, tol: float = 1e-6) -> torch.Tensor:
    """Orthonormal basis ``(dim, r)`` (float64, CPU) of the span of ``vectors`` (each ``(dim,)``).

    SVD of the stacked vectors (each scaled to unit norm first, so a small update counts as
    much as a large one); directions with a singular value below ``tol`` of the largest are
    dropped, and zero or non-finite vectors are left out. No vectors: ``(dim, 0)``.
    """
    rows = []
    for v in vectors:
        if v.dim() != 1 or v.numel() != dim:
            raise ValueError(f"vector has shape {tuple(v.shape)}, expected ({dim},)")
        x = v.detach().cpu().double()
        n = float(torch.linalg.vector_norm(x))
        if n > 0.0 and math.isfinite(n):
            rows.append(x / n)
    if not rows:
        return torch.zeros(dim, 0, dtype=torch.float64)
    _, s, vh = torch.linalg.svd(torch.stack(rows), full_matrices=False)
    return vh[s > tol * float(s[0])].T.contiguous()


class Projector(Protocol):
    """A span to project vectors out of: an explicit basis (:class:`BasisSpan`) or a sketch's
    (`fedasync.unlearning.sketch.Span`). Vectors are ``(d,)`` or ``(d, m)``, in float64."""

    @property
    def rank(self) -> int:
        """Directions in the span (0: nothing to project out)."""
        ...

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` without its component in the span."""
        ...

    def share(self, basis: torch.Tensor) -> float:
        """The share of an orthonormal ``basis``'s directions that lies in the span."""
        ...


class BasisSpan:
    """The span of an orthonormal ``q (d, r)`` (float64; :func:`span_basis` makes one)."""

    def __init__(self, q: torch.Tensor):
        """``q``: orthonormal columns."""
        self.q = q

    @property
    def rank(self) -> int:
        """Columns of ``q``."""
        return int(self.q.shape[1])

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """``x − Q(Qᵀx)`` twice (:func:`_residual`)."""
        return _residual(self.q, x.double()) if self.rank else x.double().clone()

    def share(self, basis: torch.Tensor) -> float:
        """``‖QᵀU‖²_F / m`` in [0, 1]."""
        if self.rank == 0 or basis.shape[1] == 0:
            return 0.0
        inside = float((self.q.T @ basis.double()).pow(2).sum())
        return min(1.0, max(0.0, inside / basis.shape[1]))


def outside(params: Params, span: Projector, names: Sequence[str]) -> tuple[Params, float]:
    """``params`` without its component in ``span`` (its floating tensors ``names``
    flattened), and the share of its squared norm that is left; the tensors not in ``names``
    are copied. What the server's ``unique`` removal subtracts: the part of a silo's recorded
    contributions that the other silos' recent updates do not move along, so that their
    training cannot have washed it out since. An empty span: a copy, share 1."""
    x = params_to_vector(params, names).detach().cpu().double()
    norm2 = float(x.pow(2).sum())
    if span.rank == 0 or norm2 == 0.0:
        return clone(params), 1.0
    r = span.residual(x)
    return vector_to_params(r, params, names), float(r.pow(2).sum()) / norm2


def outside_span(
    params: Params, vectors: Sequence[torch.Tensor], names: Sequence[str], tol: float = 1e-6
) -> tuple[Params, float]:
    """:func:`outside` the span of ``vectors`` (each ``(d,)``, the floating tensors ``names``
    flattened; :func:`span_basis`). No vectors: a copy, share 1."""
    x_dim = sum(params[k].numel() for k in names)
    return outside(params, BasisSpan(span_basis(vectors, x_dim, tol)), names)


def _residual(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x − Q(Qᵀx)`` twice (the second pass makes it orthogonal to rounding error), for an
    orthonormal ``q (d, r)`` and ``x (d,)`` or ``(d, k)``, in float64."""
    r = x - q @ (q.T @ x)
    return r - q @ (q.T @ r)
