"""Unlearning arithmetic: flat views of ``Params``, L2 balls, gradient signatures, a ledger.

Papers:

- Halimi et al. 2022, "Federated Unlearning: How to Efficiently Erase a Client in FL?"
  (arXiv:2207.05521): the erasing silo runs projected gradient *ascent* on its data, kept in
  an L2 ball around a reference model. Here: :func:`project_to_ball` (the silo-side loop is
  ``clients.unlearn.erase_pga``).
- Liu et al. 2021, FedEraser (IWQoS 2021): the server keeps each silo's past contributions and
  removes/calibrates them. Here: :class:`ContributionLedger` keeps one running *sum* per silo
  (not FedEraser's per-round history), enough for a first-order removal.
- Cai & Zhang 2026, AFU-IC, "Asynchronous Federated Unlearning with Invariance Calibration for
  Medical Imaging" (only the abstract is public): the target silo unlearns without stopping
  global training, and a server-side invariance calibration stops the model from relearning
  the erased data. Our reading, not the paper's code: the silo sends a low-rank
  :class:`GradientSignature` (an orthonormal basis of the span of per-batch loss gradients on
  its forget set, never the data) and the server projects every later update out of that
  subspace (:meth:`GradientSignature.project_out`), so neither other silos nor stale work can
  move the model back along the erased data's directions.
- Li et al. 2023, SFU, "Subspace-based Federated Unlearning" (arXiv:2302.12448): updates kept
  orthogonal to the other clients' subspace. Adapted here: the *signature* loses the span of
  the other silos' recent updates (:meth:`GradientSignature.without_span`).
- PCGrad (Yu et al. 2020, arXiv:2001.06782) and FedOSD (arXiv:2412.20200): one-sided
  projections (:class:`OneSided`: the erasure's jump, :class:`ErasureJump`, and the forget
  set's mean loss gradient, :class:`ForgetGradient`; several at once, :func:`block_one_sided`).

Conventions follow ``fedasync.tensors``: functions return new tensors and never mutate their
inputs; only floating-point tensors take part (integer buffers are copied unchanged). A flat
vector is the concatenation of the floating tensors in ``names`` order (sorted key order by
default), in the widest floating dtype present but at least float32.

One file (over 400 lines) because it is the core's whole unlearning arithmetic, each piece
small and all on the one flat-vector convention above; ``server.unlearning`` and
``clients.unlearn`` read it as one, and splitting it by paper would only add modules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from fedasync import flat as _flat
from fedasync.flat import FlatParams, Layout
from fedasync.tensors import add, clone, global_norm, sub
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


def l2_distance(a: Params, b: Params) -> float:
    """``||a − b||`` over all floating tensors together (a and b must share names)."""
    diff = sub(a, b)
    return math.sqrt(
        sum(float(v.double().pow(2).sum()) for v in diff.values() if v.is_floating_point())
    )


def project_to_ball(params: Params, center: Params, radius: float) -> Params:
    """Nearest point of the L2 ball ``{w : ||w − center|| <= radius}`` to ``params``.

    Inside the ball the result equals ``params``; outside it is pulled back along the line to
    ``center`` onto the sphere: ``center + radius · (params − center) / ||params − center||``.
    Only floating tensors move; others are copied from ``params``.
    """
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    dist = l2_distance(params, center)
    if dist <= radius:
        return clone(params)
    c = radius / dist
    return {
        k: center[k] + (v - center[k]) * c if v.is_floating_point() else v.detach().clone()
        for k, v in params.items()
    }


SHARE_RULES = ("linear", "sqrt", "none")
"""How an erasure's size follows its forget set's share of the silo (:func:`forget_share_scale`)."""


def forget_share_scale(
    n_forget: int, n_held: int, rule: str = "linear", floor: float = 0.01
) -> float:
    """Factor in ``(0, 1]`` by which an erasure's size (PGA's ball radius, relabelling's steps)
    shrinks when it erases ``n_forget`` of the ``n_held`` samples its silo holds.

    ``linear`` (the default): ``max(n_forget / n_held, floor)``. To first order, retraining
    without ``n`` of a silo's ``N`` samples moves the model by ``n/N`` of what retraining
    without the whole silo does, and the configured radius is sized for a whole silo; so the
    ball gets ``n/N`` of it. The floor keeps a single sample erasable at all.
    ``sqrt``: ``max(sqrt(n/N), floor)``, the norm of a sum of ``n`` *uncorrelated* per-sample
    contributions against ``N``. Gradient ascent's direction is the forget set's mean gradient,
    which is correlated with everyone's data, so this over-sizes small erasures: at 1% it
    allows 10% of the radius, 0.2 of brain-tissue's 2.0, about the 0.17-0.24 that five
    unbounded PGA steps on 5 samples travel (seeds 0-2), so hardly a bound.
    ``none``: 1, every erasure the full size (the behaviour before the rule existed: on
    brain-tissue, 5 of 456 samples then cost the global test score 5-23 points at the
    boundary over 3 seeds; ``linear`` 0.3-1.5, docs/erasure.md).
    A whole silo (``n_forget >= n_held``) or an unknown size (``n_held < 1``) is always 1.
    """
    if rule not in SHARE_RULES:
        raise ValueError(f"rule must be one of {SHARE_RULES}, got {rule!r}")
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"floor must be in (0, 1], got {floor}")
    if n_held < 1 or n_forget >= n_held or rule == "none":
        return 1.0
    share = max(n_forget, 0) / n_held
    return max(share if rule == "linear" else math.sqrt(share), floor)


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


def outside_span(
    params: Params, vectors: Sequence[torch.Tensor], names: Sequence[str], tol: float = 1e-6
) -> tuple[Params, float]:
    """``params`` without its component in the span of ``vectors`` (each ``(d,)``, the
    floating tensors ``names`` flattened), and the share of its squared norm that is left.

    ``x − Q(Qᵀx)`` twice in float64 (:func:`span_basis` gives ``Q``); the tensors not in
    ``names`` are copied. What the server's ``unique`` removal subtracts: the part of a silo's
    recorded contributions that the other silos' latest updates do not move along, so that
    their training cannot have washed it out since. No vectors: a copy, share 1.
    """
    x = params_to_vector(params, names).detach().cpu().double()
    norm2 = float(x.pow(2).sum())
    q = span_basis(vectors, x.numel(), tol)
    if q.shape[1] == 0 or norm2 == 0.0:
        return clone(params), 1.0
    r = _residual(q, x)
    return vector_to_params(r, params, names), float(r.pow(2).sum()) / norm2


def _residual(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x − Q(Qᵀx)`` twice (the second pass makes it orthogonal to rounding error), for an
    orthonormal ``q (d, r)`` and ``x (d,)`` or ``(d, k)``, in float64."""
    r = x - q @ (q.T @ x)
    return r - q @ (q.T @ r)


@dataclass
class GradientSignature:
    """Orthonormal basis of the subspace spanned by a forget set's loss gradients.

    What an erasing silo sends the server instead of its data: ``basis`` is ``(d, k)`` with
    orthonormal columns over the flattened floating tensors ``names`` (in that order), with
    ``d`` their total size and ``k`` (the rank) small, so it costs ``4·d·k`` bytes in float32.
    """

    basis: torch.Tensor
    """``(d, k)``, orthonormal columns (float32, CPU)."""
    names: list[str]
    """Tensor names the rows of ``basis`` run over, in flattening order."""
    _in_layout: dict[Layout, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """The basis with its rows in a flat layout's buffer order, per layout (made once)."""

    @classmethod
    def from_gradients(
        cls,
        grads: Sequence[Params],
        rank: int,
        energy: float = 0.99,
        names: Sequence[str] | None = None,
    ) -> GradientSignature:
        """Top right-singular vectors of the stacked gradients ``G (m, d)`` (one row each).

        The gradients are *not* centred: their mean is the forget set's dominant loss
        direction (the one relearning would follow), which centring would remove. Keeps the
        fewest top singular vectors whose squared singular values reach ``energy`` of the
        total, and at most ``rank``; directions with a singular value below ``1e-5`` of the
        largest (float32 rounding) are never kept. All-zero gradients give an empty (rank 0) signature.
        """
        if not grads:
            raise ValueError("from_gradients needs at least one gradient")
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if not 0.0 < energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1], got {energy}")
        keys = _float_names(grads[0], names)
        g = torch.stack([params_to_vector(p, keys).cpu().float() for p in grads])
        _, s, vh = torch.linalg.svd(g, full_matrices=False)
        if s.numel() == 0 or float(s[0]) == 0.0:
            return cls(torch.zeros(g.shape[1], 0), keys)
        sq = s.pow(2)
        cum = torch.cumsum(sq, 0) / sq.sum()
        k = int(torch.searchsorted(cum, torch.tensor([energy - 1e-6]))) + 1
        k = min(k, rank, int((s > 1e-5 * s[0]).sum()))
        return cls(vh[:k].T.contiguous(), keys)

    @classmethod
    def from_basis(cls, basis: torch.Tensor, names: Sequence[str]) -> GradientSignature:
        """A signature from a received ``(d, k)`` basis, re-orthonormalised in float32.

        A basis sent in float16 (half the bytes) is orthonormal only to about 1e-3; a
        projection with it would leave that much of the erased directions in every update.
        QR restores orthonormal columns spanning the same subspace; columns that rounding
        made dependent (a diagonal entry of R below 1e-3 of the largest) are dropped.
        """
        if basis.dim() != 2:
            raise ValueError(f"basis must be (d, k), got shape {tuple(basis.shape)}")
        b = basis.detach().cpu().float()
        if b.shape[1] == 0:
            return cls(b, list(names))
        q, r = torch.linalg.qr(b)
        diag = r.diagonal().abs()
        keep = diag > 1e-3 * float(diag.max()) if float(diag.max()) > 0 else diag > 0
        return cls(q[:, keep].contiguous(), list(names))

    @property
    def rank(self) -> int:
        """Number of basis directions ``k``."""
        return int(self.basis.shape[1])

    @property
    def nbytes(self) -> int:
        """Size of the basis in bytes (what crosses the wire)."""
        return self.basis.numel() * self.basis.element_size()

    def _layout_basis(self, update: Params) -> torch.Tensor | None:
        """The basis in ``update``'s buffer order, when ``update`` is flat parameters of one
        float32 buffer over exactly ``names`` (the projection then reads the buffer itself:
        no gather of the tensors into a vector, no split back)."""
        if not isinstance(update, FlatParams) or len(update.layout.groups) != 1:
            return None
        g = update.layout.groups[0]
        if g.dtype != torch.float32 or len(g.names) != len(self.names):
            return None
        u = self._in_layout.get(update.layout)
        if u is None:
            if set(g.names) != set(self.names) or g.numel != self.basis.shape[0]:
                return None
            start, at = {}, 0
            for name in self.names:
                start[name] = at
                at += g.numels[g.names.index(name)]
            rows = torch.cat(
                [torch.arange(start[n], start[n] + k) for n, k in zip(g.names, g.numels)]
            )
            u = self.basis.index_select(0, rows).to(g.device)
            if len(self._in_layout) >= 4:
                self._in_layout.clear()
            self._in_layout[update.layout] = u
        return u

    def _coords(self, update: Params) -> tuple[torch.Tensor, torch.Tensor]:
        u = self._layout_basis(update)
        if u is not None:
            return update.buffers[0], u  # type: ignore[attr-defined]
        delta = params_to_vector(update, self.names)
        if delta.numel() != self.basis.shape[0]:
            raise ValueError(f"update has {delta.numel()} elements, basis {self.basis.shape[0]}")
        u = self.basis.to(device=delta.device, dtype=delta.dtype)
        return delta, u

    def project_out(self, update: Params, strength: float = 1.0) -> Params:
        """``Δ − strength · U (Uᵀ Δ)`` on the tensors ``names``; other tensors untouched.

        ``strength`` 1 removes every component along the erased subspace (the invariance
        calibration); between 0 and 1 it damps it.
        """
        if self.rank == 0 or strength == 0.0:
            return clone(update)
        delta, u = self._coords(update)
        out = torch.addmv(delta, u, u.T @ delta, alpha=-strength)
        if isinstance(update, FlatParams) and delta is update.buffers[0]:
            return _flat.from_buffers(update.layout, [out], update.loose)
        return vector_to_params(out, update, self.names)

    def overlap(self, update: Params) -> float:
        """``||Uᵀ Δ|| / ||Δ||`` in [0, 1]: how much of the update lies in the erased subspace."""
        delta, u = self._coords(update)
        norm = float(torch.linalg.vector_norm(delta))
        if norm == 0.0 or self.rank == 0:
            return 0.0
        return float(torch.linalg.vector_norm(u.T @ delta)) / norm

    def merge(self, other: GradientSignature) -> GradientSignature:
        """Signature of the union subspace (for several erasures).

        Keeps this basis as is and appends an orthonormal basis of the part of ``other``
        outside it. Departure from a plain QR of ``[U₁ U₂]``: QR without pivoting cannot tell
        which columns are dependent, so the residual ``U₂ − U₁U₁ᵀU₂`` is orthonormalised by
        SVD and only directions with singular value above ``1e-4`` are kept.
        """
        if list(other.names) != list(self.names) or other.basis.shape[0] != self.basis.shape[0]:
            raise ValueError("signatures run over different tensors")
        u1 = self.basis.double()
        u2 = other.basis.double()
        resid = u2 - u1 @ (u1.T @ u2)
        resid = resid - u1 @ (u1.T @ resid)  # second pass: orthogonal to rounding error
        q, s, _ = torch.linalg.svd(resid, full_matrices=False)
        new = q[:, s > 1e-4]
        return GradientSignature(torch.cat([u1, new], dim=1).float(), list(self.names))

    def span_share(self, vectors: Sequence[torch.Tensor], tol: float = 1e-6) -> float:
        """``‖QᵀU‖²_F / k`` in [0, 1]: the share of the signature's directions (on average,
        by squared norm) that lies in the span ``Q`` of ``vectors`` (each ``(d,)`` in this
        signature's coordinates; see :func:`span_basis`). 0 for an empty signature."""
        if self.rank == 0:
            return 0.0
        q = span_basis(vectors, self.basis.shape[0], tol)
        if q.shape[1] == 0:
            return 0.0
        inside = float((q.T @ self.basis.double()).pow(2).sum())
        return min(1.0, max(0.0, inside / self.rank))

    def without_span(
        self, vectors: Sequence[torch.Tensor], tol: float = 1e-6
    ) -> GradientSignature | None:
        """The part of the signature unique to the erased data: the basis projected out of the
        span of ``vectors`` (e.g. other silos' recent updates, each ``(d,)`` in this
        signature's coordinates), re-orthonormalised; None when nothing is left.

        Our adaptation of SFU (Li et al. 2023, "Subspace-based Federated Unlearning",
        arXiv:2302.12448), which keeps an update in the orthogonal complement of the other
        clients' input subspace: here the *signature* loses the directions the others' data
        moves the model along too, so that the calibration stops only what is unique to the
        erased data. ``U − Q(QᵀU)`` (twice, in float64), then an SVD keeps the directions with
        singular value above ``tol`` (the columns of ``U`` have norm 1, so ``tol`` is
        relative). No ``vectors`` (or only zero ones): a copy of this signature.
        """
        d = self.basis.shape[0]
        q = span_basis(vectors, d, tol)
        if q.shape[1] == 0 or self.rank == 0:
            return None if self.rank == 0 else GradientSignature(self.basis.clone(), self.names)
        resid = _residual(q, self.basis.double())
        left, s, _ = torch.linalg.svd(resid, full_matrices=False)
        keep = left[:, s > tol]
        if keep.shape[1] == 0:
            return None
        return GradientSignature(keep.float().contiguous(), list(self.names))

    def state_dict(self) -> dict[str, Any]:
        """The basis and the tensor names (copies)."""
        return {"basis": self.basis.clone(), "names": list(self.names)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the basis as float32)."""
        self.basis = d["basis"].detach().clone().float()
        self.names = [str(n) for n in d["names"]]

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> GradientSignature:
        """A signature rebuilt from :meth:`state_dict`'s output."""
        sig = cls(torch.zeros(0, 0), [])
        sig.load_state_dict(d)
        return sig


@dataclass
class OneSided:
    """A unit direction ``a`` over the floating tensors ``names`` that a later change Δ may not
    move against: of Δ only the component with ⟨Δ, a⟩ < 0 is removed, Δ − min(0, ⟨Δ, a⟩)·a;
    moving along ``a`` or across it is kept (the one-sided projection of PCGrad, Yu et al.
    2020, arXiv 2001.06782, as FedOSD, arXiv 2412.20200, uses it in federated unlearning).
    Several at once: :func:`block_one_sided`."""

    direction: torch.Tensor
    """``a``, shape ``(d,)``, unit L2 norm, float32."""
    names: list[str]
    """Tensor names the entries of ``direction`` run over, in flattening order."""

    def along(self, change: Params) -> float:
        """⟨Δ, a⟩: how far ``change`` moves along the direction (negative: against it)."""
        delta = params_to_vector(change, self.names)
        return float(delta.float() @ self.direction.to(delta.device))

    def block(self, change: Params) -> Params:
        """``change`` without its component against the direction (``change`` itself when it
        has none)."""
        c = self.along(change)
        if c >= 0.0:
            return change
        delta = params_to_vector(change, self.names)
        fixed = delta - (c * self.direction.to(device=delta.device)).to(delta.dtype)
        return vector_to_params(fixed, change, self.names)

    def state_dict(self) -> dict[str, Any]:
        """The direction and its tensor names."""
        return {"direction": self.direction.clone(), "names": list(self.names)}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> Self:
        """The direction ``state_dict`` described."""
        return cls(d["direction"].clone(), [str(n) for n in d["names"]])

    @classmethod
    def unit(cls, vector: torch.Tensor, names: Sequence[str]) -> Self | None:
        """``vector / ‖vector‖`` (float32, CPU) over ``names``; None when it is zero or not
        finite."""
        v = vector.detach().reshape(-1).cpu().float()
        norm = float(torch.linalg.vector_norm(v))
        if norm == 0.0 or not math.isfinite(norm):
            return None
        return cls(v / norm, list(names))


@dataclass
class ErasureJump(OneSided):
    """The direction an erasure moved the model, ĵ = (w_B − w_pre) / ‖w_B − w_pre‖ over the
    floating tensors ``names``: what the model must not move back along.

    Paper: the one-sided projection of PCGrad (Yu et al. 2020, arXiv 2001.06782), as FedOSD
    (arXiv 2412.20200) uses it against unlearned models reverting: of a later change Δ only the
    component moving back along the jump is removed, Δ − min(0, ⟨Δ, ĵ⟩)·ĵ; moving further
    along it or across it is kept. Summed over every later change, the model's displacement
    from the boundary then never has a positive component toward w_pre, so the reversion ratio
    ρ(t) = ⟨w_t − w_B, w_pre − w_B⟩ / ‖w_pre − w_B‖² stays ≤ 0 (issue 14 §4).
    """

    @classmethod
    def between(cls, before: Params, after: Params) -> ErasureJump | None:
        """The jump from ``before`` to ``after`` (None when they are equal)."""
        names = _float_names(after, None)
        return cls.unit(params_to_vector(after, names) - params_to_vector(before, names), names)

    def block_reversal(self, change: Params) -> Params:
        """``change`` without its component moving back along the jump (one-sided)."""
        return self.block(change)


@dataclass
class ForgetGradient(OneSided):
    """The erased data's mean loss gradient ĝ_f = g_f / ‖g_f‖ at the erased model, over the
    tensors ``names`` (the signature's): what the model must not descend along.

    A later change Δ with ⟨Δ, g_f⟩ < 0 lowers the forget loss to first order, i.e. relearns
    the erased data; it loses that component, Δ − min(0, ⟨Δ, ĝ_f⟩)·ĝ_f, and nothing else is
    touched (PCGrad's one-sided projection, arXiv 2001.06782, against the forget objective
    as in FedOSD, arXiv 2412.20200). Unlike the signature's two-sided projection it leaves
    every change that does not lower the forget loss as it is.
    """

    def block_descent(self, change: Params) -> Params:
        """``change`` without its component lowering the forget loss (one-sided)."""
        return self.block(change)


def block_one_sided(change: Params, directions: Sequence[OneSided], sweeps: int = 200) -> Params:
    """The nearest change to ``change`` that moves against none of ``directions`` (⟨Δ', a⟩ ≥ 0
    for each), on its floating tensors; ``change`` itself when it already does.

    One direction: :meth:`OneSided.block`. Several (jumps and forget gradients of one or more
    erasures, each over its own tensor names): removing them one after another can bring back
    an earlier one's violation when they are not orthogonal, so the projection onto the cone
    is solved instead: Δ' = Δ + Aᵀλ with λ ≥ 0 minimising ½λᵀ(AAᵀ)λ + λᵀ(AΔ) (its dual, a
    tiny nonnegative quadratic programme in one variable per direction), by exact coordinate
    descent for at most ``sweeps`` sweeps (to 1e-12).
    """
    if not directions:
        return change
    if len(directions) == 1:
        return directions[0].block(change)
    names = _float_names(change, None)
    delta = params_to_vector(change, names).double()
    zeros = {k: torch.zeros_like(v) for k, v in change.items()}
    rows = [
        params_to_vector(vector_to_params(d.direction, zeros, d.names), names)
        .double()
        .to(delta.device)
        for d in directions
    ]
    a = torch.stack(rows)  # (n, d)
    c = a @ delta
    if bool((c >= 0).all()):
        return change
    g = a @ a.T
    lam = torch.zeros_like(c)
    for _ in range(sweeps):
        moved = 0.0
        for i in range(len(rows)):
            if float(g[i, i]) <= 0.0:
                continue
            new = max(0.0, float(lam[i]) - float(c[i] + g[i] @ lam) / float(g[i, i]))
            moved = max(moved, abs(new - float(lam[i])))
            lam[i] = new
        if moved < 1e-12:
            break
    fixed = delta + a.T @ lam
    return vector_to_params(fixed.to(params_to_vector(change, names).dtype), change, names)


class ContributionLedger:
    """Per silo, the running sum of the contributions the server *applied* to the global model.

    ``record`` is called with the exact change an update made to the global model (after
    staleness weighting, bounding, corrections and calibration), so ``total(silo)`` is that
    silo's whole first-order footprint. Memory: one model-sized sum per silo plus a count and
    the last version.

    Subtracting ``total(silo)`` from the global model is FedEraser-style first-order removal
    (Liu et al. 2021). It is not exact: every later update was computed on a model that
    already contained the silo's work, which is why the erasing silo's own erasure and the
    server's calibration (:class:`GradientSignature`) follow it.
    """

    def __init__(self) -> None:
        self._sums: dict[str, Params] = {}
        self._counts: dict[str, int] = {}
        self._last: dict[str, int] = {}

    def record(self, silo: str, contribution: Params, version: int) -> None:
        """Add ``contribution`` (applied change, same names every time) to ``silo``'s sum."""
        c = {k: v.detach() for k, v in contribution.items()}
        self._sums[silo] = add(self._sums[silo], c) if silo in self._sums else clone(c)
        self._counts[silo] = self._counts.get(silo, 0) + 1
        self._last[silo] = int(version)

    def total(self, silo: str) -> Params | None:
        """A copy of ``silo``'s summed contribution, or None when it has none."""
        s = self._sums.get(silo)
        return None if s is None else clone(s)

    def count(self, silo: str) -> int:
        """Number of contributions recorded for ``silo``."""
        return self._counts.get(silo, 0)

    def last_version(self, silo: str) -> int | None:
        """Version of ``silo``'s last recorded contribution, or None."""
        return self._last.get(silo)

    def silos(self) -> list[str]:
        """Silos with a recorded contribution, sorted."""
        return sorted(self._sums)

    def without(self, params: Params, silo: str) -> Params:
        """``params − total(silo)`` (first-order removal), or a copy of ``params`` if none."""
        s = self._sums.get(silo)
        return clone(params) if s is None else sub(params, s)

    def forget(self, silo: str) -> None:
        """Drop everything recorded for ``silo`` (after its erasure)."""
        self._sums.pop(silo, None)
        self._counts.pop(silo, None)
        self._last.pop(silo, None)

    def state_dict(self) -> dict[str, Any]:
        """Every silo's sum (a copy), count and last version."""
        return {
            "sums": {s: clone(p) for s, p in self._sums.items()},
            "counts": dict(self._counts),
            "last_version": dict(self._last),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self._sums = {str(s): clone(p) for s, p in d["sums"].items()}
        self._counts = {str(s): int(n) for s, n in d["counts"].items()}
        self._last = {str(s): int(v) for s, v in d["last_version"].items()}


class UpdateHistory:
    """What FedEraser (Liu et al. 2021) retains to rebuild a model without one silo.

    The model the first round started from, and for every ``interval``-th round the *norm* of
    each silo's update: FedEraser's calibration keeps the magnitude of each retained update
    and takes only its direction from the calibration training (:func:`federaser_step`), so
    the norms are all it reads. Memory: one model plus one float per silo per retained round.
    """

    def __init__(self, interval: int = 2) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval = interval
        self.initial: Params | None = None
        self._norms: dict[int, dict[str, float]] = {}

    def start(self, params: Params) -> None:
        """Keep the model training starts from (once; later calls are ignored)."""
        if self.initial is None:
            self.initial = clone({k: v.detach() for k, v in params.items()})

    def record(self, round_: int, silo: str, norm: float) -> None:
        """``silo``'s update in round ``round_`` had L2 norm ``norm`` (kept every interval)."""
        if round_ % self.interval != 0:
            return
        if not math.isfinite(norm) or norm < 0:
            raise ValueError(f"update norm must be finite and >= 0, got {norm}")
        self._norms.setdefault(int(round_), {})[str(silo)] = float(norm)

    def rounds(self) -> list[int]:
        """The retained rounds, in order."""
        return sorted(self._norms)

    def norms(self, round_: int) -> dict[str, float]:
        """Silo -> update norm of a retained round (a copy)."""
        return dict(self._norms.get(int(round_), {}))

    def state_dict(self) -> dict[str, Any]:
        """The interval, the initial model (a copy) and the retained norms."""
        return {
            "interval": self.interval,
            "initial": None if self.initial is None else clone(self.initial),
            "norms": {r: dict(n) for r, n in self._norms.items()},
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.interval = int(d["interval"])
        self.initial = None if d["initial"] is None else clone(d["initial"])
        self._norms = {
            int(r): {str(s): float(x) for s, x in n.items()} for r, n in d["norms"].items()
        }


def federaser_step(
    params: Params,
    calibration: dict[str, Params],
    old_norms: dict[str, float],
    weights: dict[str, float] | None = None,
    lr: float = 1.0,
) -> Params:
    """One FedEraser calibration round: ``params + lr · Σ_i w_i · ‖U_i‖ · Û_i / ‖Û_i‖``.

    ``calibration[i]`` is silo ``i``'s calibration update Û_i (trained from ``params`` with
    fewer local steps), ``old_norms[i]`` the norm ‖U_i‖ of its retained update of the same
    round: the old magnitude with the new direction. ``weights`` default to equal; they are
    normalised over the silos that have both an update and a norm. An update of norm 0 is
    left out. Only floating tensors move.
    """
    ids = [s for s in sorted(calibration) if s in old_norms]
    w = {s: (1.0 if weights is None else float(weights[s])) for s in ids}
    norms = {s: global_norm(calibration[s]) for s in ids}
    ids = [s for s in ids if norms[s] > 0 and w[s] > 0]
    total = sum(w[s] for s in ids)
    out = clone(params)
    for s in ids:
        scale = lr * (w[s] / total) * old_norms[s] / norms[s]
        for k, v in out.items():
            if v.is_floating_point():
                v.add_(calibration[s][k].to(v.dtype), alpha=scale)
    return out
