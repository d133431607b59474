"""What the server keeps of the silos' past contributions to take one silo's out again: the
running sums of first-order removal and FedEraser's retained update norms and rebuild step.

Paper: Liu et al. 2021, FedEraser (IWQoS 2021): the server keeps each silo's past
contributions and removes/calibrates them. Here :class:`ContributionLedger` keeps one running
*sum* per silo (not FedEraser's per-round history), enough for a first-order removal;
:class:`UpdateHistory` and :func:`federaser_step` are FedEraser's calibration rounds.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedasync import flat as _flat
from fedasync.tensors import add, clone, global_norm, sub
from fedasync.types import Params


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
        """Add ``contribution`` (applied change, same names every time) to ``silo``'s sum: in
        place, one pass per buffer, when both are :class:`fedasync.flat.FlatParams` of one
        layout (the sum is the ledger's own copy), else per tensor."""
        mine = self._sums.get(silo)
        if mine is not None and _flat.same(mine, contribution):
            _flat.add_in_place(mine, contribution)  # type: ignore[arg-type]
        elif isinstance(contribution, _flat.FlatParams) and mine is None:
            self._sums[silo] = _flat.clone(contribution)
        else:
            c = {k: v.detach() for k, v in contribution.items()}
            self._sums[silo] = add(mine, c) if mine is not None else clone(c)
        self._counts[silo] = self._counts.get(silo, 0) + 1
        self._last[silo] = int(version)

    def fusable(self, silo: str, like: _flat.FlatParams) -> bool:
        """Whether a fold of an update shaped as ``like`` can add its change into ``silo``'s
        sum in its own pass (`sink`): the sum is absent or has ``like``'s arithmetic layout."""
        mine = self._sums.get(silo)
        arithmetic = like.layout.arithmetic()
        return mine is None or (isinstance(mine, _flat.FlatParams) and mine.layout is arithmetic)

    def sink(self, silo: str, like: _flat.FlatParams, version: int) -> tuple[torch.Tensor, ...]:
        """``silo``'s sum's buffers, for a fold to add the change it applies into in its own
        pass (`fedasync.flat.axpy_sunk`, a sink of the change), counted as a contribution at
        ``version`` (as `record` counts one). A zero sum first when it has none. ``like`` must
        be `fusable`."""
        mine = self._sums.get(silo)
        if mine is None:
            zeros = [torch.zeros_like(b) for b in like.buffers]
            mine = self._sums[silo] = _flat.from_buffers(like.layout.arithmetic(), zeros)
        assert isinstance(mine, _flat.FlatParams)
        object.__setattr__(mine, "finite", None)  # (written in place from now on)
        self._counts[silo] = self._counts.get(silo, 0) + 1
        self._last[silo] = int(version)
        return mine.buffers

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
