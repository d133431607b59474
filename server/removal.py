"""The server's own move at an erasure request: which part of the silo's recorded
contributions it subtracts from the model (``lab.erasure.server_removal*``, bounded by
``lab.erasure.server_removal_max_drop``).

The ledger (`fedasync.unlearning.ContributionLedger`) holds what each silo's updates did to
the global model. All of it (``server_removal_part=total``, FedEraser's first-order removal)
over-erases: later training already washed out part of it. ``unique`` subtracts only its
part outside the span of the other silos' recent accepted updates (the sketch's,
`fedasync.unlearning.SpanSketch`): the directions their training does not move the model
along, so that it cannot have washed out since (what persists). The arithmetic is the core's
(`fedasync.unlearning.outside`).

A sample-level erasure gets no removal. The ledger is per silo and cannot tell which samples
moved the model, and the silo's other samples keep its distribution's influence, as
retraining without those samples keeps it too: what is specific to the samples is
memorisation, which the silo's own membership test sees. Measured: a removal of the samples'
share (10%) of the silo's unique part over-erased breast-fna on 4 of 5 seeds, where the
membership test alone was verified on 5 of 5 (docs/measured.md).

The removal is bounded by the held-out score (``bounded``): when the whole of it would cost
more than ``lab.erasure.server_removal_max_drop``, the largest share that does not is applied
at the request. The rest (``Remainder``) is not dropped: once the other silos' training has
brought the score back to where it was before the request, a step of it is applied, bounded
the same way, at an evaluation. Steps follow until all of it is in force, or until the request
is checked after its relearning window (what is left then is never applied, and the audit
says how much).

A whole silo whose influence generalises (a learnt rule, such as a backdoor, rather than
memorised samples) is erased by the removal alone, since its membership test cannot see the
rule: withholding most of the removal for good left one in the model (docs/measured.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedasync import Params
from fedasync.unlearning import ContributionLedger, SpanSketch, outside, params_to_vector

log = logging.getLogger("fedasync.server")


def removal(
    cfg: Any,
    lab: Any,
    ledger: ContributionLedger,
    sketch: SpanSketch | None,
    silo: int,
    request_id: str,
    report: dict[str, Any],
    sample_level: bool,
) -> Params | None:
    """What the server adds to the model for an erasure of ``silo`` (minus its removal; None:
    nothing), by ``cfg`` (``UnlearningConfig``) and ``lab`` (``lab.erasure``: which part, what
    share). ``sketch``: the span of the accepted updates,
    by silo (None: not kept); ``report``: the erasure's start report, which gets what was measured;
    ``sample_level``: a sample-level erasure (no removal)."""
    if sample_level:  # (see the module docstring)
        report["removal"] = "none: a sample-level erasure"
        return None
    total = ledger.total(str(silo)) if lab.server_removal else None
    if total is None:
        return None
    report.update(alignment(ledger, silo, total))
    if lab.server_removal_part == "unique":
        names = sorted(k for k, v in total.items() if v.is_floating_point())
        if sketch is not None and sketch.covers(names):
            span = sketch.span(names, without=silo)
            total, kept = outside(total, span, names)
            rank = span.rank
        else:  # nothing sketched yet: no other silo's update to keep any of it
            kept, rank = 1.0, 0
        report.update(removal_kept=kept, removal_span_rank=float(rank))
        log.info(
            "erasure %s: %.1f%% of silo %d's recorded contributions (by squared norm) lie "
            "outside the rank-%d span of other silos' recent updates: that part is removed",
            request_id,
            100 * kept,
            silo,
            rank,
        )
    scale = lab.server_removal_scale
    return {k: -scale * v for k, v in total.items()}


def alignment(ledger: ContributionLedger, silo: int, total: Mapping[str, Any]) -> dict[str, float]:
    """How silo ``silo``'s recorded contributions ``total`` sit against the others':
    ``removal_cos_others``, the cosine between its sum and the sum of all other silos' sums;
    ``removal_norm_share``, its sum's norm over the norm of all sums."""
    names = sorted(k for k, v in total.items() if v.is_floating_point())
    mine = params_to_vector(dict(total), names).double()
    others = torch.zeros_like(mine)
    for s in ledger.silos():
        t = ledger.total(s) if s != str(silo) else None
        if t is not None and all(n in t for n in names):
            others += params_to_vector(t, names).double()
    n_mine, n_others = float(mine.norm()), float(others.norm())
    cos = float(mine @ others) / (n_mine * n_others) if n_mine and n_others else 0.0
    n_all = float((mine + others).norm())
    return {"removal_cos_others": cos, "removal_norm_share": n_mine / n_all if n_all else 0.0}


HALVINGS = 4
"""How many times a removal that costs the held-out score too much is halved (to 1/16)
before it is withheld."""


def bounded(
    params: Params,
    removal: Params,
    score: Callable[[Params], float],
    max_drop: float,
    before: float | None = None,
) -> tuple[Params, dict[str, float]]:
    """``params`` plus the largest share of ``removal`` (1, 1/2, ..., 1/2**HALVINGS, else none)
    whose held-out score (``score``, the server's evaluation) falls by at most ``max_drop``
    (``lab.erasure.server_removal_max_drop``; 1: no bound). Returns the new parameters and
    what was measured: ``removal_score_before`` and ``_after``, ``removal_applied`` (the
    share). A score that is not a finite number (no test set at the coordinator: nothing is
    measured mid-run) bounds nothing: the removal is applied whole. ``before``: the score of
    ``params`` when the caller has it already (an evaluation of this version), else measured."""
    before = score(params) if before is None else before
    new = _plus(params, removal, 1.0)
    after = score(new)
    share = 1.0
    if max_drop < 1.0 and math.isfinite(before) and math.isfinite(after):
        while before - after > max_drop and share > 0.0:
            share = share / 2 if share > 2.0**-HALVINGS else 0.0
            new = _plus(params, removal, share)
            after = score(new) if share else before
    report = {"removal_score_before": before, "removal_score_after": after}
    return new, {**report, "removal_applied": share}


def _plus(params: Params, removal: Params, share: float) -> Params:
    """``params + share * removal`` on the floating tensors ``removal`` holds."""
    return {
        k: v + share * removal[k] if k in removal and v.is_floating_point() else v
        for k, v in params.items()
    }


@dataclass
class Remainder:
    """What the held-out bound withheld of a removal (``bounded``): ``removal``, the part not
    in force yet; ``left``, its share of the whole; ``reference``, the held-out score before
    the request. ``step`` applies some of it only once the others' training has brought the
    score back to ``reference`` at least, and then the largest share whose cost is within
    the bound: the model is never more than the bound below its score before the request,
    and it is back there before each step."""

    removal: Params
    left: float
    reference: float

    @classmethod
    def of(cls, removal: Params, applied: float, reference: float) -> Remainder | None:
        """The rest of ``removal`` once its share ``applied`` is in force (None: nothing);
        ``reference``: the score before it."""
        if applied >= 1.0:
            return None
        rest = {k: (1.0 - applied) * v for k, v in removal.items()}
        return cls(rest, 1.0 - applied, reference)

    def step(
        self,
        params: Params,
        score: Callable[[Params], float],
        max_drop: float,
        before: float | None = None,
    ) -> tuple[Params, dict[str, float]]:
        """``params`` plus the largest share of the rest whose held-out score falls by at most
        ``max_drop`` (``bounded``), and what was measured; what was applied leaves the rest.
        Nothing while the score (``before``, else measured) is below ``reference``.
        ``removal_step`` and ``removal_left`` are shares of the whole removal: what this step
        applied and what is still withheld."""
        before = score(params) if before is None else before
        if math.isfinite(before) and math.isfinite(self.reference) and before < self.reference:
            report = {"removal_score_before": before, "removal_score_after": before}
            return params, {
                **report,
                "removal_applied": 0.0,
                "removal_step": 0.0,
                "removal_left": self.left,
            }
        new, measured = bounded(params, self.removal, score, max_drop, before)
        share = measured["removal_applied"]
        step = share * self.left
        if share:
            self.removal = {k: (1.0 - share) * v for k, v in self.removal.items()}
            self.left = 0.0 if share >= 1.0 else self.left * (1.0 - share)
        return new, {**measured, "removal_step": step, "removal_left": self.left}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it."""
        return {"removal": dict(self.removal), "left": self.left, "reference": self.reference}

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> Remainder:
        """The remainder ``state_dict`` returned."""
        return cls(dict(d["removal"]), float(d["left"]), float(d["reference"]))
