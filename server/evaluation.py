"""How the global model is evaluated by the silos: each on its own data, and their mean.

A coordinator without a test set of its own (deployment without ``data.server_test``) asks its
silos to evaluate the model (``evaluate_on_nodes``, ``Silos``) and takes their mean
weighted by sample count (``weighted_mean``); ``FederatedEvaluation`` is that ``evaluate_fn``.
The end of a run may ask every silo the same (``server.evaluate_silos``).

``BestModel`` keeps a copy of the global model at its best evaluation so far, for the run's
``best`` MONAI bundle (server/bundle.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.serverapp import Grid

from protocol import wire
from protocol.messages import EvaluateReply, EvaluateRequest
from protocol.reading import ErrorReply, Malformed
from server.roster import exchange

log = logging.getLogger("fedasync.server")

NOT_MEASURED = {"loss": math.nan, "score": math.nan}
"""What a federated evaluation gives while silos hold jobs: not measured (never delays them)."""


def evaluate_on_nodes(
    grid: Grid,
    setup_json: str,
    nodes: list[int],
    params: dict[str, torch.Tensor],
    timeout_s: float = 300.0,
) -> dict[int, dict[str, float]]:
    """Ask each of ``nodes`` to evaluate ``params`` on its silo's own data; each answer's
    ``loss``, ``score`` and ``num_samples`` by the silo it names (a node that did not answer is
    left out, with a warning)."""
    arrays = wire.encode(params)  # one encoding for every silo's message
    request = EvaluateRequest(setup_json, params)
    msgs = [request.to_message(n, arrays=arrays) for n in nodes]
    out: dict[int, dict[str, float]] = {}
    for node, reply in zip(nodes, exchange(grid, msgs, timeout_s)):
        try:
            if reply is None:
                raise Malformed("no reply")
            got = EvaluateReply.from_message(reply)
        except (ErrorReply, Malformed) as e:
            log.warning("node %d did not evaluate the model: %s", node, e)
            continue
        out[got.silo] = {"loss": got.loss, "score": got.score, "num_samples": got.num_samples}
    return out


@dataclass
class Silos:
    """The silos as an evaluation asks them: the Grid, their set-up, which node is which silo
    (``roster``, filled once they are known), whether any holds a job (``busy``), and where
    each answer goes (``record(silo, result)``: the ``silo_eval`` event)."""

    grid: Grid
    setup_json: str
    roster: Mapping[int, int]
    busy: Callable[[], bool]
    record: Callable[[int, dict[str, float]], None]

    def evaluate(
        self, params: dict[str, torch.Tensor], timeout_s: float = 300.0
    ) -> dict[int, dict[str, float]]:
        """Every silo's evaluation of ``params`` on its own data (``evaluate_on_nodes``),
        each recorded."""
        nodes = [self.roster[s] for s in sorted(self.roster)]
        out = evaluate_on_nodes(self.grid, self.setup_json, nodes, params, timeout_s)
        for silo, res in sorted(out.items()):
            self.record(silo, res)
        return out


def weighted_mean(per_silo: dict[int, dict[str, float]]) -> dict[str, float]:
    """The silos' loss and score averaged with their evaluated sample counts as weights, and
    how many silos and samples that is (``eval_silos``, ``eval_samples``); NOT_MEASURED when
    no silo evaluated anything."""
    n = sum(r["num_samples"] for r in per_silo.values())
    if n <= 0:
        return dict(NOT_MEASURED)
    return {
        "loss": sum(r["loss"] * r["num_samples"] for r in per_silo.values()) / n,
        "score": sum(r["score"] * r["num_samples"] for r in per_silo.values()) / n,
        "eval_silos": len(per_silo),
        "eval_samples": n,
    }


class FederatedEvaluation:
    """``evaluate_fn`` of a coordinator without a test set: every silo evaluates the model on
    its own data (``Silos.evaluate``) and the result is their mean weighted by sample count.

    It asks the silos only when none holds a job (after a sync round) or once the run is over
    (``final``): a message to a silo that is training would wait for it, and the loop with it.
    Otherwise (an erasure boundary mid-run) it answers NOT_MEASURED. ``silos`` is set once the
    server exists; ``per_silo`` keeps the last answers (the summary's per-silo evaluations)."""

    def __init__(self) -> None:
        self.silos: Silos | None = None
        self.final = False
        self.per_silo: dict[int, dict[str, float]] = {}

    def __call__(self, params: dict[str, torch.Tensor]) -> dict[str, float]:
        """The federated evaluation of ``params`` (see the class)."""
        silos = self.silos
        if silos is None or (not self.final and silos.busy()):
            return dict(NOT_MEASURED)
        self.per_silo = silos.evaluate(params)
        return weighted_mean(self.per_silo)


class BestModel:
    """The global model at its best evaluation so far: its version, score and a copy of its
    weights (the loop's own are folded into in place), kept in the checkpoint (part ``best``)
    so that a resumed run goes on from it.

    A score that is not a finite number (a federated evaluation not measured) is never best;
    of equal scores the earlier version stays. An erasure forgets it (``forget``): a model
    from before the erasure boundary still carries the erased data, so the best is then
    chosen among the versions after it."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.score = math.nan
        self.params: dict[str, torch.Tensor] | None = None

    def offer(self, version: int, score: Any, params: dict[str, torch.Tensor]) -> bool:
        """Keep ``params`` (copied) if ``score`` beats the best so far; True when it did."""
        if not isinstance(score, int | float) or not math.isfinite(score):
            return False
        if self.params is not None and score <= self.score:
            return False
        self.version, self.score = version, float(score)
        self.params = {k: v.detach().clone() for k, v in params.items()}
        return True

    def forget(self) -> None:
        """No best model (an erasure was applied)."""
        self.version, self.score, self.params = None, math.nan, None

    def state_dict(self) -> dict[str, Any] | None:
        """The version, score and weights; None when there is none."""
        if self.params is None:
            return None
        return {"version": self.version, "score": self.score, "params": self.params}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore what ``state_dict`` returned."""
        if state is None:
            self.forget()
            return
        self.version, self.score = int(state["version"]), float(state["score"])
        self.params = dict(state["params"])
