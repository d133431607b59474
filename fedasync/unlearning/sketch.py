"""A bounded, streaming sketch of the span of the silos' accepted updates, by silo.

What the server's ``unique`` removal and ``signature_unique`` need is the span of the *other*
silos' recent updates: the directions their training moves the model along. Keeping the latest
updates as full copies costs one model per update kept (64 of DenseNet121's 7M parameters:
1.8 GB). :class:`SpanSketch` keeps ``rows`` model-sized rows instead, whatever the run's length.

The sketch is a sparse random range finder (a CountSketch in the time dimension; Clarkson and
Woodruff 2013, "Low rank approximation and regression in input sparsity time"; the range finder
of Halko, Martinsson and Tropp 2011): each accepted update, scaled to unit norm (so that a small
update counts as much as a large one) and given a random sign, is added into one row. A row is
then a signed sum of several updates, and the span of the rows approximates the dominant span of
the updates. Older updates fade: a row's content decays by half every :data:`HALFLIFE` accepted
updates (all silos), so the sketch follows what training does now, as the latest-updates window
it replaces did.

Rows are owned by silo groups (silo ``s`` writes only into the rows of group ``s mod G``, ``G =
min(silos, rows)``), so that the span of the *others* leaves an erasing silo's own updates
out: exactly when every silo has its own group (``silos <= rows``), and with the silos that
share its group left out too otherwise (a smaller span: a larger removal).

Cost per accepted update: its norm and one ``row += a·u`` over the model's buffers, whatever
``rows`` is: :meth:`SpanSketch.add` (:func:`fedasync.flat.add_into`) reads the update again,
:meth:`SpanSketch.sink` leaves the addition to the fold's own pass while each chunk of the
update is in cache (:func:`fedasync.flat.axpy_sunk`). The span is formed only when an erasure
asks for it (:meth:`SpanSketch.span`), from the rows' Gram
matrix, without a second model-sized copy per row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fedasync.flat import FlatParams, Sink, add_into, floating_names, sketched_norm
from fedasync.types import Params

HALFLIFE = 64.0
"""Accepted updates (all silos) after which a row's content counts half: the reach of the
64-update window this sketch replaces."""

_RENORM = 1e-20
"""A row whose pending multiplier falls below this is rescaled in place (one pass, rare)."""


def _sign(silo: int, n: int) -> float:
    """A fixed pseudo-random sign for the ``n``-th update of ``silo`` (splitmix64): the same
    after a restart, with no random state to checkpoint."""
    z = (silo * 0x9E3779B97F4A7C15 + n * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return 1.0 if (z ^ (z >> 31)) & 1 else -1.0


class Span:
    """The span of some of a sketch's rows over some of its tensors, formed once: an
    orthonormal basis ``Q`` held implicitly as ``Q = C·Y`` (``Y`` the rows, ``C`` small), so
    that no model-sized copy is made beyond the vectors it is applied to. Vectors are flat in
    ``names`` order (`fedasync.unlearning.params_to_vector`)."""

    def __init__(self, sketch: SpanSketch, rows: list[int], names: Sequence[str], tol: float):
        """``rows`` of ``sketch`` over the tensors ``names``; directions whose singular value is
        below ``tol`` of the largest are dropped."""
        self._sketch, self._rows = sketch, rows
        self.names = list(names)
        self._slices = [sketch.slice_of(n) for n in self.names]
        self.dim = sum(s.stop - s.start for s in self._slices)
        self._coef = torch.zeros(0, len(rows), dtype=torch.float64)
        if rows and self.dim:
            gram = torch.zeros(len(rows), len(rows), dtype=torch.float64)
            for s in self._slices:
                block = sketch.buffer[rows, s]
                gram += (block @ block.T).double()
            norms = gram.diagonal().clamp_min(0).sqrt()
            live = norms > 0
            d = torch.where(live, 1.0 / norms.clamp_min(1e-300), torch.zeros_like(norms))
            g = d[:, None] * gram * d[None, :]  # the Gram of the rows at unit norm
            lam, vec = torch.linalg.eigh(g)
            keep = lam > (tol**2) * float(lam.max().clamp_min(0)) if lam.numel() else lam > 0
            keep &= lam > 0
            lam, vec = lam[keep], vec[:, keep]
            # Q = diag(1/√λ) Vᵀ D Y: orthonormal rows
            self._coef = (vec / lam.sqrt()[None, :]).T * d[None, :]

    @property
    def rank(self) -> int:
        """Directions in the span."""
        return int(self._coef.shape[0])

    def _q_dot(self, x: torch.Tensor) -> torch.Tensor:
        """``Q x`` for ``x (dim,)`` or ``(dim, m)``, float64."""
        y = torch.zeros((len(self._rows), *x.shape[1:]), dtype=torch.float64)
        buf, off = self._sketch.buffer, 0
        for s in self._slices:
            n = s.stop - s.start
            y += (buf[self._rows, s] @ x[off : off + n].to(buf.dtype)).double()
            off += n
        return self._coef @ y

    def _q_t(self, c: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``Qᵀ c`` as a ``like``-shaped float64 tensor."""
        w = (self._coef.T @ c).to(self._sketch.buffer.dtype)
        out = torch.empty_like(like, dtype=torch.float64)
        buf, off = self._sketch.buffer, 0
        for s in self._slices:
            n = s.stop - s.start
            out[off : off + n] = (buf[self._rows, s].T @ w).double()
            off += n
        return out

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """``x − Q(Qᵀx)`` twice (the second pass cleans the first's rounding), float64."""
        x = x.double()
        if self.rank == 0:
            return x.clone()
        r = x - self._q_t(self._q_dot(x), x)
        return r - self._q_t(self._q_dot(r), r)

    def share(self, basis: torch.Tensor) -> float:
        """``‖Q U‖²_F / m`` in [0, 1] for an orthonormal ``basis U (dim, m)``: the share of its
        directions that lies in this span."""
        if self.rank == 0 or basis.shape[1] == 0:
            return 0.0
        inside = float(self._q_dot(basis.double()).pow(2).sum())
        return min(1.0, max(0.0, inside / basis.shape[1]))


class SpanSketch:
    """``rows`` model-sized rows that sketch the span of the accepted updates, by silo group
    (see the module docstring). Memory and checkpoint: ``rows`` float32 copies of the
    model's floating tensors, and a few numbers per row."""

    def __init__(self, rows: int, silos: int):
        """``rows`` >= 1; ``silos``: how many silos the federation has (sets the groups)."""
        if rows < 1:
            raise ValueError(f"a span sketch needs at least one row, got {rows}")
        self.rows = int(rows)
        self.groups = max(1, min(int(silos), self.rows))
        self.buffer = torch.zeros(0, 0)
        """(rows, d) float32: empty until the first update fixes the tensors it covers."""
        self.names: list[str] = []
        self._offsets: dict[str, tuple[int, int]] = {}
        self._mult = [1.0] * self.rows  # a row's true content is _mult[j] · buffer[j]
        self._last = [0] * self.rows  # the update count at the row's last change
        self._silos: list[set[int]] = [set() for _ in range(self.rows)]
        self._counts: dict[int, int] = {}  # updates added per silo
        self._group_counts = [0] * self.groups
        self.added = 0
        """Updates added so far."""

    # ------------------------------------------------------------------ layout
    def _fix(self, update: Params) -> None:
        """The first update fixes the tensors (its floating ones) and their order."""
        if isinstance(update, FlatParams):
            names = [n for g in update.layout.groups if g.dtype.is_floating_point for n in g.names]
        else:
            names = [k for k, v in update.items() if v.is_floating_point()]
        off = 0
        for n in names:
            k = update[n].numel()
            self._offsets[n] = (off, k)
            off += k
        self.names = names
        self.buffer = torch.zeros(self.rows, off, dtype=torch.float32)

    def slice_of(self, name: str) -> slice:
        """Where tensor ``name`` lies in a row (KeyError: not sketched)."""
        off, k = self._offsets[name]
        return slice(off, off + k)

    def covers(self, names: Sequence[str]) -> bool:
        """Whether every one of ``names`` is sketched."""
        return all(n in self._offsets for n in names)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows (what the sketch costs in memory and in a checkpoint)."""
        return self.buffer.numel() * self.buffer.element_size()

    # ------------------------------------------------------------------ the hot path
    def add(self, silo: int, update: Params, norm: float | None = None) -> bool:
        """Add one accepted update of ``silo`` (its floating tensors; ``norm``: its L2 norm
        when the caller has it). False, and nothing added, for a zero or non-finite update
        or one that does not have the sketched tensors."""
        if not self.names:
            self._fix(update)
        if not (isinstance(update, FlatParams) and self.fusable(update)) and not all(
            n in update and update[n].numel() == k for n, (_, k) in self._offsets.items()
        ):
            return False
        slot = self._take(silo, update, norm)
        if slot is None:
            return False
        j, alpha = slot
        add_into(self.buffer[j], update, alpha, self._offsets, self.names)
        return True

    def fusable(self, update: FlatParams) -> bool:
        """Whether ``update``'s buffers hold exactly the sketched tensors, in order (the first
        update fixes them): a fold can then add it into a row in its own pass (`sink`)."""
        names = floating_names(update)
        if names is None:
            return False
        if not self.names:
            return True
        n = sum(b.numel() for b in update.buffers)
        return names == self.names and n == self.buffer.shape[1]

    def sink(self, silo: int, update: FlatParams, norm: float | None = None) -> list[Sink]:
        """Take one accepted update of ``silo`` as `add` does, but leave the addition to the
        fold's pass (`fedasync.flat.axpy_sunk`): the row it goes into, as a sink with its
        coefficient; [] when nothing is added (a zero or non-finite update). ``update`` must
        be `fusable`: the fold adds that update, and only it."""
        if not self.names:
            self._fix(update)
        slot = self._take(silo, update, norm)
        if slot is None:
            return []
        j, alpha = slot
        row, parts, off = self.buffer[j], [], 0
        for b in update.buffers:
            parts.append(row[off : off + b.numel()])
            off += b.numel()
        return [Sink(tuple(parts), alpha, "update")]

    def _take(self, silo: int, update: Params, norm: float | None) -> tuple[int, float] | None:
        """The row the next update of ``silo`` goes into and its coefficient (unit norm, its
        sign, the row's pending decay), that update counted; None for a zero or non-finite
        ``update`` (``norm``: its L2 norm when the caller has it)."""
        if norm is None:
            norm = sketched_norm(update, self.names)
        if not (norm > 0.0 and math.isfinite(norm)):
            return None
        group = silo % self.groups
        in_group = range(group, self.rows, self.groups)
        j = in_group[self._group_counts[group] % len(in_group)]
        n = self._counts.get(silo, 0)
        self.added += 1
        mult = self._mult[j] * 0.5 ** ((self.added - self._last[j]) / HALFLIFE)
        if mult < _RENORM:  # the row's content is negligible: rescale it once
            self.buffer[j].mul_(mult)
            mult = 1.0
        self._mult[j], self._last[j] = mult, self.added  # (the row's decay so far, applied)
        self._silos[j].add(int(silo))
        self._counts[silo] = n + 1
        self._group_counts[group] += 1
        return j, _sign(silo, n) / (norm * mult)

    # ------------------------------------------------------------------ reading it
    def others(self, silo: int) -> list[int]:
        """The rows no update of ``silo`` went into (and that have content)."""
        return [j for j in range(self.rows) if self._silos[j] and silo not in self._silos[j]]

    def span(self, names: Sequence[str], without: int | None = None, tol: float = 1e-6) -> Span:
        """The span of the rows without silo ``without``'s updates (None: every row with
        content) over ``names`` (each sketched)."""
        if not self.names:  # nothing added yet
            return Span(self, [], [], tol)
        rows = [j for j in range(self.rows) if self._silos[j] and without not in self._silos[j]]
        return Span(self, rows, names, tol)

    def row(self, j: int) -> dict[str, torch.Tensor]:
        """Row ``j``'s tensors by name, flat (views; a direction: its scale is arbitrary)."""
        return {n: self.buffer[j, self.slice_of(n)] for n in self.names}

    def silos_in(self, rows: Sequence[int]) -> set[int]:
        """The silos whose updates went into ``rows``."""
        return set().union(*(self._silos[j] for j in rows)) if rows else set()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rows and what says whose they are. The rows are brought to their true scale in
        place and returned without a copy (the checkpoint is written before the next update):
        saving costs no second sketch in memory."""
        for j, m in enumerate(self._mult):
            if m != 1.0:
                self.buffer[j].mul_(m)
                self._mult[j] = 1.0
        return {
            "rows": self.rows,
            "groups": self.groups,
            "buffer": self.buffer,
            "names": list(self.names),
            "sizes": [self._offsets[n][1] for n in self.names],
            "last": list(self._last),
            "silos": [sorted(s) for s in self._silos],
            "counts": {str(k): v for k, v in self._counts.items()},
            "group_counts": list(self._group_counts),
            "added": self.added,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the same ``rows``)."""
        if int(d["rows"]) != self.rows or int(d["groups"]) != self.groups:
            raise ValueError(
                f"the checkpoint's sketch has {d['rows']} rows in {d['groups']} groups; "
                f"this run's has {self.rows} in {self.groups}"
            )
        self.buffer = d["buffer"].float().clone()
        self.names = list(d["names"])
        off, self._offsets = 0, {}
        for n, k in zip(self.names, d["sizes"]):
            self._offsets[n] = (off, int(k))
            off += int(k)
        self._mult = [1.0] * self.rows
        self._last = [int(x) for x in d["last"]]
        self._silos = [set(int(s) for s in x) for x in d["silos"]]
        self._counts = {int(k): int(v) for k, v in d["counts"].items()}
        self._group_counts = [int(x) for x in d["group_counts"]]
        self.added = int(d["added"])
