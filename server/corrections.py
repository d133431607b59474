"""The correction pipeline: what happens to an accepted update between intake and the model.

Paper: none of its own; each step is the core's (fedasync.corrections, fedasync.aggregators).
In order, for one validated delta:

1. **calibrate**: an erasure's invariance calibration, when erasures are on (the erasure
   coordinator's ``calibrate``: projection out of erased data's gradient signature, or a
   rejection of pre-boundary work);
2. **delay compensation** (DC-ASGD, ``lab.corrections.delay_compensation``), for a stale
   update whose base weights the server still holds;
3. **error feedback** (``lab.corrections.error_feedback_topk`` < 1): top-k compression with
   per-silo residuals;
4. **clip** to ``server.clip_norm`` (last: the corrections change the norm);
5. **fold** into the global model by the strategy's aggregator (server/strategies.py: FedAsync
   mixing, or FedBuff's buffer and server optimiser; with central DP, the aggregator's noise);
6. with ``lab.erasure.calibration_target=applied`` the calibration moves here instead of step 1:
   the change the fold made to the model (new − old) is projected, after everything above, and
   ``at_boundary`` calibrates what the pipeline carries past an erasure (FedBuff's buffer, the
   optimiser's first moment, error-feedback residuals).

No Flower import: the loop hands it tensors and gets back the fold's result. It owns the
aggregator and the error-feedback residuals, and checkpoints them in its ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedasync import (
    ErrorFeedback,
    FedAsyncAggregator,
    FoldResult,
    Params,
    Rejection,
    Update,
    delay_compensate_delta,
)
from fedasync.aggregators import Aggregator, FoldSink
from fedasync.tensors import clip_by_norm, is_arithmetic
from server.config import FedAsyncConfig
from server.strategies import strategy_for

Calibrate = Callable[[Params], "Params | Rejection"]
"""An erasure's calibration of one update's tensors (or why the update is refused)."""
Project = Callable[[Params], Params]
"""An erasure's projection of a change to the model (``lab.erasure.calibration_target=applied``)."""


class CorrectionPipeline:
    """calibrate → delay compensation → error feedback → clip → fold, for one update at a time."""

    def __init__(self, cfg: FedAsyncConfig, aggregator: Aggregator | None = None):
        """``aggregator``: the strategy's fold rule (None: that of ``server.mode``'s strategy,
        server/strategies.py)."""
        s = cfg.lab.corrections
        self.delay_compensation = s.delay_compensation
        self.error_feedback = s.error_feedback_topk < 1.0
        self.clip_norm = cfg.server.clip_norm
        self.client_lr = cfg.client.lr
        if aggregator is None:
            aggregator = strategy_for(cfg).aggregator()
        self.aggregator: Aggregator = aggregator
        budget = s.residual_budget_mb
        self.ef = ErrorFeedback(
            s.error_feedback_topk,
            budget_bytes=None if budget is None else int(budget * 2**20),
        )

    def fold(
        self,
        params: Params,
        update: Update,
        *,
        staleness: int,
        factor: float,
        norm: float,
        w_base: Params | None,
        calibrate: Calibrate | None = None,
        project: Project | None = None,
        sink: FoldSink | None = None,
    ) -> FoldResult | Rejection:
        """Correct ``update`` (a validated delta on ``params``' names, of L2 norm ``norm``, sent
        with base weights ``w_base`` when the server still holds them) and fold it into
        ``params``; or the calibration's rejection. What a step did to the update goes into
        ``update.metrics`` (``clip_factor``); ``update.tensors`` ends as what was folded.

        ``project`` (the calibration of what is applied) replaces the change the fold makes to
        the model, new − old, by its projection: after every correction and the optimiser, so
        nothing carried past them escapes it. The result's ``applied`` and contributions are
        projected with it (exactly, for a linear projection).

        ``sink`` (a run that can erase: server/unlearning/sinks.py) takes the update as folded
        and the change it makes: in the fold's own pass where the aggregator can
        (`FedAsyncAggregator.fold_sunk`; not with ``project``, whose change is projected
        after), else after it (``sink.unfused``, and the contributions)."""
        raw = update.tensors
        if calibrate is not None:
            calibrated = calibrate(update.tensors)
            if isinstance(calibrated, Rejection):
                return calibrated
            update.tensors = calibrated
        dc = None
        if self.delay_compensation > 0 and staleness > 0 and w_base is not None:
            dc = (params, w_base, self.delay_compensation / self.client_lr)
        if self.error_feedback:  # (with delay compensation: one fused pass on flat buffers)
            update.tensors = self.ef.apply(update.silo, update.tensors, compensate=dc)
        elif dc is not None:
            update.tensors = delay_compensate_delta(update.tensors, dc[0], dc[1], dc[2], 1.0)
        if self.clip_norm is not None:
            known = norm if update.tensors is raw else None
            update.tensors, c = clip_by_norm(update.tensors, self.clip_norm, known)
            if c < 1.0:
                update.metrics["clip_factor"] = c
        known = norm if update.tensors is raw else None
        res = None
        if sink is not None and project is None and isinstance(self.aggregator, FedAsyncAggregator):
            res = self.aggregator.fold_sunk(params, update, staleness, sink, known, factor=factor)
        if res is None:
            res = self.aggregator.fold(params, update, staleness, factor=factor)
            if sink is not None:
                sink.unfused(update.tensors, known)
        if project is not None and res.params is not None:
            res = _project_applied(params, res, project)
        return res

    def flush(self, params: Params, project: Project | None = None) -> FoldResult | None:
        """Apply what the aggregator holds (a round's end: ``SyncFedAvg``), projected like ``fold``;
        None when it holds nothing."""
        if self.aggregator.pending == 0:
            return None
        res = self.aggregator.flush(params)
        if project is not None and res.params is not None:
            res = _project_applied(params, res, project)
        return res

    def at_boundary(self, silo: str, project: Project) -> int:
        """An erasure of ``silo``'s data took effect: drop its buffered deltas and its
        error-feedback residual (they were made from the erased data), and project every
        direction the server carries into later folds (the other buffered deltas, the server
        optimiser's first moment, the other residuals). How many deltas were dropped."""
        dropped = self.aggregator.drop(silo)
        self.aggregator.map_state(project)
        self.ef.drop(silo)
        self.ef.map_residuals(project)
        return dropped

    def state_dict(self) -> dict[str, Any]:
        """The aggregator (FedBuff's buffer, the server optimiser) and the residuals."""
        return {"aggregator": self.aggregator.state_dict(), "error_feedback": self.ef.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.aggregator.load_state_dict(d["aggregator"])
        self.ef.load_state_dict(d["error_feedback"])


def _project_applied(params: Params, res: FoldResult, project: Project) -> FoldResult:
    """``res`` with its change to ``params`` (new − old) replaced by ``project`` of it."""
    assert res.params is not None
    new = res.params
    res.contributions = {s: project(c) for s, c in res.contributions.items()}
    if res.unattributed is not None:
        res.unattributed = project(res.unattributed)
    change = {k: new[k] - v for k, v in params.items() if is_arithmetic(v)}
    kept = project(change)  # last: the projection's overlap is the change's
    res.params = {k: (v + kept[k]).to(v.dtype) if k in kept else new[k] for k, v in params.items()}
    res.applied = kept
    return res
