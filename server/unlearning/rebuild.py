"""FedEraser (Liu et al. 2021): the halting baseline's rebuild of the model without a silo.

Owns: the update history FedEraser rebuilds from (the initial model and each retained round's
update norms, ``lab.erasure.federaser_interval``; in its ``state_dict``) and the rebuild in
progress (``Rebuild``; not checkpointed: after a restart the request is still erasing and the
rebuild starts again). A rebuild starts from the model training started from and runs one
calibration round per retained round: the remaining silos train briefly from the model being
rebuilt, the server keeps each retained update's norm and takes the new direction
(`fedasync.unlearning.federaser_step`). When the last round is in, the rebuilt model is handed
back to the erasure coordinator (lifecycle.py), which applies it as any erasure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fedasync import Params
from fedasync.tensors import clone
from fedasync.unlearning import UpdateHistory, federaser_step

if TYPE_CHECKING:
    from server.config import FedAsyncConfig
    from server.intake import Job
    from server.unlearning.requests import Erasure

log = logging.getLogger("fedasync.server")


class Calibrators(Protocol):
    """What a rebuild sees of the silos' jobs: which silo is down, and calibration training."""

    def is_down(self, silo: int) -> bool:
        """Whether ``silo`` waits out a failure."""
        ...

    def dispatch_calibration(self, silo: int, start: Params, steps: int, erasure: Any) -> bool:
        """Send ``silo`` FedEraser calibration training; False when refused."""
        ...


@dataclass
class Rebuild:
    """A FedEraser rebuild in progress (the halting baseline; not checkpointed: after a
    restart the request is still erasing and the rebuild starts again)."""

    erasure: Erasure
    model: Params
    rounds: list[int]
    idx: int = 0
    pending: set[int] = field(default_factory=set)
    updates: dict[str, Any] = field(default_factory=dict)


class FedEraserRebuild:
    """The update history and the one rebuild in progress (``server.mode=federaser``)."""

    def __init__(
        self,
        cfg: FedAsyncConfig,
        silos: Calibrators,
        roster: Mapping[int, int],
        initial: Params,
        *,
        is_retired: Callable[[int], bool],
        done: Callable[[Erasure, Params, dict[str, float]], None],
    ):
        """``silos``: the silos' jobs; ``roster``: the silos (silo -> node id, filled in place
        by the loop); ``initial``: the model training starts from; ``is_retired``: whether a
        silo was erased whole (it takes no part); ``done``: the coordinator's, applying a rebuilt
        model (with what the rebuild reports)."""
        self.silos = silos
        self.roster = roster
        self.cfg = cfg.lab.erasure  # (the baseline's two settings)
        self.local_steps = cfg.client.local_steps
        self.lr = cfg.server.optimizer.lr
        self.history = UpdateHistory(self.cfg.federaser_interval)
        self.history.start(initial)
        self.current: Rebuild | None = None
        self.is_retired = is_retired
        self.done = done

    def record(self, version: int, silo: int, norm: float) -> None:
        """The raw norm of the update of ``silo`` folded at ``version``."""
        self.history.record(version, str(silo), norm)

    def start(self, e: Erasure) -> None:
        """Rebuild the model without ``e``'s silo (a whole-silo erasure)."""
        if self.history.initial is None:
            raise RuntimeError("FedEraser needs the initial model in the update history")
        self.current = Rebuild(e, clone(self.history.initial), self.history.rounds())
        log.info(
            "FedEraser: rebuilding without silo %d over %d retained rounds",
            e.silo,
            len(self.current.rounds),
        )
        self._round()

    def _round(self) -> None:
        rb, jobs = self.current, self.silos
        assert rb is not None
        steps = max(1, round(self.local_steps * self.cfg.federaser_steps_ratio))
        while rb.idx < len(rb.rounds):
            norms = self.history.norms(rb.rounds[rb.idx])
            silos = [
                s
                for s in sorted(self.roster)
                if str(s) in norms
                and s != rb.erasure.silo
                and not self.is_retired(s)
                and not jobs.is_down(s)
            ]
            sent = [s for s in silos if jobs.dispatch_calibration(s, rb.model, steps, rb.erasure)]
            if sent:
                rb.pending = set(sent)
                rb.updates = {}
                return
            rb.idx += 1  # nobody left from that round
        self.current = None
        self.done(rb.erasure, rb.model, {"federaser_rounds": float(len(rb.rounds))})

    def take(self, job: Job, update: Any) -> None:
        """One silo's calibration update (None: it failed, the round goes on without it)."""
        rb = self.current
        if rb is None or job.silo not in rb.pending:
            return
        rb.pending.discard(job.silo)
        if update is not None:
            rb.updates[str(job.silo)] = update
        if rb.pending:
            return
        norms = self.history.norms(rb.rounds[rb.idx])
        rb.model = federaser_step(
            rb.model,
            {s: u.tensors for s, u in rb.updates.items()},
            norms,
            weights={s: float(u.num_samples) for s, u in rb.updates.items()},
            lr=self.lr,
        )
        rb.idx += 1
        self._round()

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The update history (the rebuild in progress is not kept)."""
        return {"history": self.history.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        if d.get("history"):
            self.history.load_state_dict(d["history"])
