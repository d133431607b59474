"""The erased data's gradient signature: the low-rank basis an erasing silo sends instead of
its data, and the projection of later updates out of it.

Papers: Cai & Zhang 2026, AFU-IC, "Asynchronous Federated Unlearning with Invariance
Calibration for Medical Imaging" (only the abstract is public). Our reading, not the paper's
code: the silo sends a low-rank :class:`GradientSignature` (an orthonormal basis of the span of
per-batch loss gradients on its forget set, never the data) and the server projects every
later update out of that subspace (:meth:`GradientSignature.project_out`), so neither other
silos nor stale work can move the model back along the erased data's directions. Li et al.
2023, SFU, "Subspace-based Federated Unlearning" (arXiv:2302.12448), adapted: the signature
loses the span of the other silos' recent updates (:meth:`GradientSignature.without_span`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedasync import flat as _flat
from fedasync.flat import FlatParams, Layout
from fedasync.tensors import clone
from fedasync.types import Params
from fedasync.unlearning.vectors import (
    BasisSpan,
    Projector,
    _float_names,
    params_to_vector,
    span_basis,
    vector_to_params,
)


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
        """:meth:`share_in` the span of ``vectors`` (each ``(d,)`` in this signature's
        coordinates; see :func:`span_basis`)."""
        return self.share_in(BasisSpan(span_basis(vectors, self.basis.shape[0], tol)))

    def share_in(self, span: Projector) -> float:
        """``‖QᵀU‖²_F / k`` in [0, 1]: the share of the signature's directions (on average,
        by squared norm) that lies in ``span`` (over this signature's ``names``, in their
        order). 0 for an empty signature."""
        return 0.0 if self.rank == 0 else span.share(self.basis)

    def without_span(
        self, vectors: Sequence[torch.Tensor], tol: float = 1e-6
    ) -> GradientSignature | None:
        """:meth:`without` the span of ``vectors`` (each ``(d,)`` in this signature's
        coordinates, e.g. other silos' recent updates; see :func:`span_basis`)."""
        return self.without(BasisSpan(span_basis(vectors, self.basis.shape[0], tol)), tol)

    def without(self, span: Projector, tol: float = 1e-6) -> GradientSignature | None:
        """The part of the signature unique to the erased data: the basis projected out of
        ``span`` (the other silos' recent updates, over this signature's ``names``),
        re-orthonormalised; None when nothing is left.

        Our adaptation of SFU (Li et al. 2023, "Subspace-based Federated Unlearning",
        arXiv:2302.12448), which keeps an update in the orthogonal complement of the other
        clients' input subspace: here the *signature* loses the directions the others' data
        moves the model along too, so that the calibration stops only what is unique to the
        erased data. ``U − Q(QᵀU)`` (twice, in float64), then an SVD keeps the directions with
        singular value above ``tol`` (the columns of ``U`` have norm 1, so ``tol`` is
        relative). An empty span: a copy of this signature.
        """
        if self.rank == 0:
            return None
        if span.rank == 0:
            return GradientSignature(self.basis.clone(), self.names)
        resid = span.residual(self.basis.double())
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
