"""Asynchronous erasure with invariance calibration, carried alongside training.

The design follows AFU-IC (Cai & Zhang 2026; only its abstract is public, so the details
here are ours) and uses Halimi et al. 2022 and FedEraser (Liu et al. 2021) as parts:

1. A request (whole silo, or some of its sample ids) is durable in the erasure store before
   it is acknowledged. While its silo is offline it waits, queued.
2. queued -> erasing: the target silo is sent a ``train.unlearn`` message and stops training;
   everyone else keeps training. The model it starts from is the global model minus the
   silo's recorded contributions (the ledger: a FedEraser-style first-order removal), and it
   runs projected gradient ascent on its forget set within an L2 ball around that model
   (Halimi et al.) or relabelling. It replies with the erasure delta and a low-rank
   *gradient signature* of the forget data: an orthonormal basis of the directions in which
   training on that data would move the model (never the data itself).
3. erasing -> calibrating: the server applies removal + erasure delta to the *current* model
   (other silos moved it meanwhile); that version is the **erasure boundary** B. From then
   on every update is calibrated: projected out of the (merged) signature subspace, so that
   neither other silos' data nor stale work can pull the model back along the erased data's
   directions. Work based before B carries the erased influence: the target silo's own is
   always dropped; the others' is projected (rule ``project``) or dropped (rule ``drop``).
4. calibrating -> verified after ``relearn_versions`` more versions: the verification
   metrics (forget accuracy, test accuracy, membership-inference AUC, backdoor ASR) are
   measured again on the model that kept training (the relearning check).

A silo that goes down while erasing (its reply is an error: its ClientApp crashed or raised,
its SuperNode restarted, the SuperLink reports it offline; or no reply within
``server.reply_timeout_s``) sends its request back: erasing -> queued, the audit row saying
why, and it is started again (from the then-current model) when the silo is back. Nothing of
an erasure is in the model before erasing -> calibrating, so it is applied once however often
it was started. An offline silo (the SuperLink's word) is tried again after
``server.offline_retry_s`` and not counted; any other loss counts, and the
``unlearning.max_attempts``-th one (default 3) fails the request with the reason. A reply
that arrives but is malformed fails it at once, as do requests a method cannot carry out.

A whole-silo erasure retires the silo; a sample-level erasure lets it keep training without
the erased samples (every later train message lists them to exclude). A request whose ids,
with those erased before, cover every sample the silo holds is carried out as a whole-silo
erasure (a silo left without data could only fail every training job); the ``erasing`` event
and the audit row say so.

Bounds, so that an erasure cannot wreck everyone's model (a silo could otherwise do it on
purpose, and even an honest tiny erasure did: see docs/erasure.md):

- its size follows the forget set's share of the silo's data
  (`fedasync.unlearning.forget_share_scale`, ``unlearning.radius_scaling``): PGA's ball
  radius, relabelling's steps;
- its delta is bounded like any update, and more: clipped (not rejected: the erasure still
  happens) to the smallest of ``server.norm_outlier_factor`` x the median accepted update
  norm, ``server.clip_norm``, and for PGA the radius it was sent (an honest delta lies in
  that ball); the clip is reported (``delta_norm``, ``delta_bound``, ``clip_factor``);
- the test score just before and just after the boundary, and their difference
  (``score_before``, ``score_after``, ``boundary_dip``), are in every report.

One silo, one job: an erasure starts only when its silo has no job in flight (the loop
refuses a second one); while a request waits for its silo, the silo is sent no new training.

One module (about 800 lines) because the coordinator is one state machine over a request's
lifecycle (queued, erasing, calibrating, verified or failed), and the halting baseline's
FedEraser rebuild and the checkpointed state are transitions of that same machine; the
arithmetic is the core's (fedasync.unlearning) and the messages are protocol's.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fedasync import Params, Rejection, RejectReason
from fedasync.erasure_metrics import reversion_ratio
from fedasync.tensors import clip_by_norm, clone, global_norm
from fedasync.unlearning import (
    ContributionLedger,
    ErasureJump,
    ForgetGradient,
    GradientSignature,
    OneSided,
    UpdateHistory,
    block_one_sided,
    federaser_step,
    flatten,
    forget_share_scale,
)
from protocol.config import SiloErasure
from protocol.ids import fraction_ids
from server.erasure.states import State, is_terminal
from server.intake import JobKind
from server.removal import removal
from server.unlearn_messages import SiloLost

if TYPE_CHECKING:
    from fedasync.clock import Clock
    from fedasync.events import EventLog
    from server.config import FedAsyncConfig
    from server.erasure.store import ErasureStore
    from server.intake import Intake, Job
    from server.pipeline import CorrectionPipeline

log = logging.getLogger("fedasync.server")

PROTECTS: dict[str, frozenset[str]] = {
    "subspace": frozenset({"subspace"}),
    "jump": frozenset({"jump"}),
    "both": frozenset({"subspace", "jump"}),
    "gradient": frozenset({"gradient"}),
    "onesided": frozenset({"jump", "gradient"}),
}
"""What each ``unlearning.protect`` holds a change to (server.config.Protect's choices)."""

WENT_DOWN = "silo went down mid-erasure"
"""Audit detail of an erasing -> queued that counts against ``unlearning.max_attempts``."""
WENT_OFFLINE = "silo went offline mid-erasure"
"""Audit detail of an erasing -> queued that does not (the SuperLink reported it offline)."""


class Federation(Protocol):
    """What the erasure coordinator sees of the server: the model and its version, the clock,
    the silos and their jobs, the event log, and the few actions it may ask for. The server
    (``server.loop.AsyncServer``) is one; a test may pass another."""

    cfg: FedAsyncConfig
    version: int
    params: Params
    clock: Clock
    roster: dict[int, int]
    num_samples: dict[int, int]
    barrier: bool
    events: EventLog
    intake: Intake
    pipeline: CorrectionPipeline
    evaluate_fn: Any

    @property
    def inflight(self) -> Mapping[str, Job]:
        """The jobs in flight, by message id."""
        ...

    def holding(self, silo: int) -> str | None:
        """Why ``silo`` may not be sent work now (None: it is idle)."""
        ...

    def is_down(self, silo: int) -> bool:
        """Whether ``silo`` waits out a failure."""
        ...

    def dispatch(self, silo: int) -> None:
        """Send ``silo`` regular training work."""
        ...

    def dispatch_unlearn(self, silo: int, start: Params, erasure: Any) -> bool:
        """Send ``silo`` an erasure; False when refused."""
        ...

    def cancel_for_erasure(self, silo: int, request_id: str) -> bool:
        """Cancel ``silo``'s training job in flight; True when it is idle now."""
        ...

    def dispatch_calibration(self, silo: int, start: Params, steps: int, erasure: Any) -> bool:
        """Send ``silo`` FedEraser calibration training; False when refused."""
        ...

    def apply_erasure(self, params: Params) -> None:
        """Make ``params`` the newest version (the erasure boundary)."""
        ...

    def checkpoint(self) -> None:
        """Write a checkpoint now."""
        ...

    def silo_sample_ids(self, silo: int) -> list[str]:
        """The sample ids ``silo`` holds."""
        ...

    def updates_accepted_between(self, t0: float, t1: float) -> int:
        """Updates accepted in the clock interval ``(t0, t1]``."""
        ...


@dataclass
class Erasure:
    """What the server tracks of one request in progress."""

    request_id: str
    silo: int
    sample_ids: list[str]  # empty = whole silo
    submitted_t: float
    started_t: float | None = None
    submitted_wall_ms: int | None = None
    """Set when ``submitted_t`` is unknown (submitted before a restart, on the virtual
    clock): the request's wall-clock submit time; ``row`` then reports wall-clock latency."""
    removal: Params | None = None  # what the server subtracted at dispatch (minus ledger)
    boundary: int | None = None
    applied_t: float | None = None
    metrics_at_boundary: dict[str, float] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    """unlearning.* values this erasure is sent instead of the config's (its scaled size)."""
    start_report: dict[str, Any] = field(default_factory=dict)
    """What the ``erasing`` event says of the erasure's scope and size."""
    around_boundary: tuple[Params, Params] | None = None
    """(w_pre, w_B): the model just before and just after the boundary, for the reversion
    ratio at verification (not checkpointed: after a restart it is not reported)."""


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


class ErasureCoordinator:
    """Drives erasure requests through their states from inside the server loop."""

    def __init__(self, srv: Federation, store: ErasureStore, verify_fn: Any):
        self.srv = srv
        self.store = store
        self.cfg = srv.cfg.unlearning
        self.verify_fn = verify_fn  # (params, silo, sample_ids) -> metrics
        self.ledger = ContributionLedger()
        self.history: UpdateHistory | None = None  # the FedEraser baseline's record
        if self.cfg.federaser:
            self.history = UpdateHistory(self.cfg.federaser_interval)
            self.history.start(srv.params)
        self.rebuild: Rebuild | None = None
        self.signature: GradientSignature | None = None
        self.jumps: list[ErasureJump] = []
        """Each applied erasure's jump (``unlearning.protect`` jump, both or onesided)."""
        self.gradients: list[ForgetGradient] = []
        """Each applied erasure's mean forget gradient, as its silo sent it
        (``unlearning.protect`` gradient or onesided)."""
        self.recent: deque[tuple[int, Params]] = deque(maxlen=int(self.cfg.unique_window))
        """``unlearning.signature_unique`` or ``server_removal_part=unique``: the latest
        accepted updates as received (silo, float32 copies of the floating tensors), at most
        ``unique_window``: what the other silos' data moves the model along. Checkpointed
        (``state_dict``), so a resumed server has the same window as before the restart."""
        self._keeps_recent = self.cfg.signature_unique or (
            self.cfg.server_removal and self.cfg.server_removal_part == "unique"
        )
        self.boundary = -1
        self.retired: set[int] = set()
        self.excluded: dict[int, list[str]] = {}
        self.active: dict[str, Erasure] = {}
        self.applied: set[str] = set()
        self.schedule = sorted(
            ((e.at_s, e.silo, e.fraction) for e in srv.cfg.erasures), key=lambda x: x[0]
        )
        self.report: list[dict[str, Any]] = []
        self.last_overlap: float | None = None
        self.seen: dict[str, float] = {}  # request id -> clock time it was first seen queued
        self.halting = False
        self.max_attempts = int(self.cfg.max_attempts)
        self.not_before: dict[str, float] = {}  # requeued id -> clock time it may start again
        self.waiting: set[int] = set()  # silos with a queued request: sent no new training

    # -------------------------------------------------------------- scheduling
    def next_time(self) -> float:
        """The next clock time at which ``poll`` has something to do by itself: a scheduled
        erasure to submit, or a requeued one whose pause is over."""
        now = self.srv.clock.now
        times = [t for t in self.not_before.values() if t > now]
        if self.schedule:
            times.append(self.schedule[0][0])
        return min(times, default=float("inf"))

    def erasing(self, silo: int) -> bool:
        """Whether ``silo`` is carrying out an erasure not yet applied."""
        return any(e.silo == silo and e.boundary is None for e in self.active.values())

    def may_train(self, silo: int) -> bool:
        """Whether ``silo`` may be sent training (not retired, erasing, or halted)."""
        if self.cfg.halt and (
            self.halting or any(e.boundary is None for e in self.active.values())
        ):
            return False  # the synchronous baseline: everyone waits for the erasure
        return silo not in self.retired and silo not in self.waiting and not self.erasing(silo)

    def halted_silos(self) -> list[int]:
        """Silos with no work in flight, not down, that may train again (after a halt)."""
        srv = self.srv
        return [s for s in sorted(srv.roster) if srv.holding(s) is None and self.may_train(s)]

    def poll(self) -> None:
        """Submit due scheduled erasures; start queued requests whose silo is online."""
        now = self.srv.clock.now
        while self.schedule and self.schedule[0][0] <= now:
            _, silo, fraction = self.schedule.pop(0)
            ids = self._fraction_ids(silo, fraction)
            req, _ = self.store.submit(silo, ids or None, "schedule", self.srv.version)
            log.info("scheduled erasure %s of silo %d submitted at t=%.1f", req.id, silo, now)
        queued = [r for r in self.store.unfinished() if r.state is State.QUEUED]
        for req in queued:
            self.seen.setdefault(req.id, now)
        before, self.waiting = self.waiting, {r.silo for r in queued}
        self._start_queued(queued, now)
        if not self.srv.barrier:  # silos whose request left the queue otherwise (failed) train
            for silo in sorted(before - self.waiting):
                if self.srv.holding(silo) is None and self.may_train(silo):
                    self.srv.dispatch(silo)

    def _startable(self, req: Any, now: float) -> bool:
        """Whether ``req`` may start now but for its silo's job in flight."""
        if req.id in self.active or req.silo in self.retired or req.silo not in self.srv.roster:
            return False
        if self.srv.is_down(req.silo) or self.erasing(req.silo):
            return False  # offline: it waits, queued, until the silo returns
        return self.not_before.get(req.id, now) <= now

    def _start_queued(self, queued: list[Any], now: float) -> None:
        # a request cancels its silo's training job in flight (server/cancel.py): it starts
        # now instead of after a job that may be a straggler's (unlearning.cancel_inflight).
        # On the wall clock only with the erasure service: Flower's SuperNode takes one message
        # at a time, so a deployed node pulls the erasure only after the job it runs; its node
        # stops that job when it sees the request enter erasing there (clients/preempt.py).
        # Without the service a cancel would gain nothing and start the erasure message's
        # reply timeout behind the job
        if self.cfg.cancel_inflight and (not self.srv.clock.realtime or self.cfg.service):
            for req in queued:
                if self._startable(req, now) and self.srv.holding(req.silo) is not None:
                    self.srv.cancel_for_erasure(req.silo, req.id)
        # the synchronous baseline halts: no new work while a request waits, and the erasure
        # starts only once the (other silos') work in flight has drained
        self.halting = self.cfg.halt and bool(queued)
        if self.halting and any(j.kind is JobKind.TRAIN for j in self.srv.inflight.values()):
            return
        for req in queued:
            if not self._startable(req, now):
                continue  # (a requeued one waits out its pause after its silo went down)
            if self.srv.holding(req.silo) is not None:
                continue  # one job per silo: it starts when the silo's job in flight is back
            self.not_before.pop(req.id, None)
            if not any(r.silo == req.silo and r.id != req.id for r in queued):
                self.waiting.discard(req.silo)  # (a silo erasing is sent no training anyway)
            self._start(req)

    def _fraction_ids(self, silo: int, fraction: float) -> list[str]:
        if fraction >= 1.0:
            return []
        return fraction_ids(self.srv.silo_sample_ids(silo), self.srv.cfg.run.seed, silo, fraction)

    def _start(self, req: Any, resumed: bool = False) -> None:
        srv = self.srv
        submitted_t, wall_ms = self._submitted(req)
        e = Erasure(req.id, req.silo, list(req.sample_ids), submitted_t, submitted_wall_ms=wall_ms)
        e.started_t = srv.clock.now
        self.active[req.id] = e
        note = self._size(e)
        e.removal = removal(
            self.cfg,
            self.ledger,
            self.recent,
            e.silo,
            e.request_id,
            e.start_report,
            sample_level=bool(e.sample_ids),
        )
        if resumed:
            self.store.note(
                req.id,
                actor="server",
                model_version=srv.version,
                detail=f"resumed after restart: sent train.unlearn to silo {req.silo} again{note}",
            )
        else:
            self.store.transition(
                req.id,
                State.ERASING,
                actor="server",
                model_version=srv.version,
                detail=f"sent train.unlearn to silo {req.silo}{note}",
            )
        if self.cfg.federaser:
            self._start_rebuild(e)
            return
        start = srv.params if e.removal is None else _add(srv.params, e.removal)
        srv.dispatch_unlearn(req.silo, start, e)

    def _submitted(self, req: Any) -> tuple[float, int | None]:
        """``(submitted_t, submitted_wall_ms)`` of ``req``. Submitted in this process: the
        clock time ``poll`` first saw it (as for scheduled erasures). Before a restart: on the
        wall clock, its ``created_at_ms`` converted to the clock; on the virtual clock that
        time is unknown, so ``created_at_ms`` is kept for a wall-clock latency."""
        from server.erasure.store import now_ms

        now = self.srv.clock.now
        if req.created_at_ms >= self.store.opened_ms:
            return self.seen.get(req.id, now), None
        if self.srv.clock.realtime:
            return now - max(0.0, (now_ms() - req.created_at_ms) / 1000), None
        return self.seen.get(req.id, now), int(req.created_at_ms)

    def _size(self, e: Erasure) -> str:
        """Scope and size of ``e`` before it is sent: a request whose ids (with those erased
        before) cover every sample of the silo becomes a whole-silo erasure; a sample-level one
        is scaled to its share of the silo's data. Returns a note for the audit row."""
        srv, u = self.srv, self.cfg
        held = set(srv.silo_sample_ids(e.silo))
        n_held = len(held) if held else int(srv.num_samples.get(e.silo, 0))
        gone = set(self.excluded.get(e.silo, []))
        n_left = n_held - (len(gone & held) if held else len(gone))
        note = ""
        if e.sample_ids:
            covered = set(e.sample_ids) | gone
            if (held and held <= covered) or (not held and n_held and len(covered) >= n_held):
                why = (
                    f"its ids cover all {n_held} samples silo {e.silo} holds"
                    + (f" ({len(gone)} erased before)" if gone else "")
                    + ": erased as a whole silo (the silo is retired)"
                )
                log.warning("erasure %s of silo %d: %s", e.request_id, e.silo, why)
                e.sample_ids = []
                e.start_report["whole_silo"] = why
                note = f"; {why}"
        if e.sample_ids:
            n = len(set(e.sample_ids) - gone)
            scale = forget_share_scale(n, max(n_left, 1), u.radius_scaling, u.radius_floor)
            e.overrides = {
                "radius": u.radius * scale,
                "steps": max(1, math.ceil(u.steps * scale)) if u.method == "relabel" else u.steps,
            }
            e.start_report.update(share=n / max(n_left, 1), size_scale=scale, **e.overrides)
            note += f"; {n} of {n_left} samples: size x{scale:.3g}"
        return note

    # -------------------------------------------------------------- FedEraser (baseline)
    def _start_rebuild(self, e: Erasure) -> None:
        """FedEraser (Liu et al. 2021): rebuild the model without the silo, from the model
        training started from, one calibration round per retained round: the remaining silos
        train briefly from the model being rebuilt, the server keeps each retained update's
        norm and takes the new direction (`fedasync.unlearning.federaser_step`)."""
        if e.sample_ids:
            self.failed(e, "FedEraser (the halting baseline) erases whole silos only")
            return
        if self.history is None or self.history.initial is None:
            raise RuntimeError("FedEraser needs the initial model in the update history")
        self.rebuild = Rebuild(e, clone(self.history.initial), self.history.rounds())
        self.event(e, "erasing", method="federaser")
        log.info(
            "FedEraser: rebuilding without silo %d over %d retained rounds",
            e.silo,
            len(self.rebuild.rounds),
        )
        self._calibration_round()

    def _history(self) -> UpdateHistory:
        """The update history a rebuild reads (``_start_rebuild`` checked that it is kept)."""
        if self.history is None:
            raise AttributeError("FedEraser's update history is not kept (federaser is off)")
        return self.history

    def _calibration_round(self) -> None:
        rb, srv = self.rebuild, self.srv
        assert rb is not None
        steps = max(1, round(srv.cfg.client.local_steps * self.cfg.federaser_steps_ratio))
        while rb.idx < len(rb.rounds):
            norms = self._history().norms(rb.rounds[rb.idx])
            silos = [
                s
                for s in sorted(srv.roster)
                if str(s) in norms
                and s != rb.erasure.silo
                and s not in self.retired
                and not srv.is_down(s)
            ]
            sent = [s for s in silos if srv.dispatch_calibration(s, rb.model, steps, rb.erasure)]
            if sent:
                rb.pending = set(sent)
                rb.updates = {}
                return
            rb.idx += 1  # nobody left from that round
        self.rebuild = None
        self._apply(rb.erasure, rb.model, None, {"federaser_rounds": float(len(rb.rounds))})

    def take_calibration(self, job: Job, update: Any) -> None:
        """One silo's calibration update (None: it failed, the round goes on without it)."""
        rb = self.rebuild
        if rb is None or job.silo not in rb.pending:
            return
        rb.pending.discard(job.silo)
        if update is not None:
            rb.updates[str(job.silo)] = update
        if rb.pending:
            return
        norms = self._history().norms(rb.rounds[rb.idx])
        rb.model = federaser_step(
            rb.model,
            {s: u.tensors for s, u in rb.updates.items()},
            norms,
            weights={s: float(u.num_samples) for s, u in rb.updates.items()},
            lr=self.srv.cfg.server.optimizer.lr,
        )
        rb.idx += 1
        self._calibration_round()

    # -------------------------------------------------------------- replies
    def calibrate(self, job: Job, tensors: Params) -> Params | Rejection:
        """Calibrate one accepted train update (or reject it) before it is folded.

        ``last_overlap`` is the share of the update's norm that lay in the erased data's
        signature subspace before the projection (logged with the update; None: uncalibrated).
        """
        self.last_overlap = None
        if job.silo in self.retired or self.erasing(job.silo):
            return Rejection(RejectReason.ERASED, f"silo {job.silo}'s data is under erasure")
        if job.silo in self.excluded and job.base_version < self.boundary:
            return Rejection(RejectReason.ERASED, "trained on samples erased since")
        if job.base_version < self.boundary and self.cfg.pre_boundary == "drop":
            return Rejection(  # with or without calibration: drop-all-stale is its own policy
                RejectReason.CROSSED_BOUNDARY,
                f"base version {job.base_version} precedes the erasure boundary {self.boundary}",
            )
        if self._keeps_recent:  # accepted: the pipeline folds it after this
            floats = {
                k: v.detach().cpu().float().clone()
                for k, v in tensors.items()
                if v.is_floating_point()
            }
            self.recent.append((job.silo, floats))
        if self.signature is None or not self.cfg.calibration:
            return tensors
        if self.cfg.calibration_target == "applied":
            return tensors  # what the fold applies is projected instead (``project``)
        self.last_overlap = self.signature.overlap(tensors)
        return self.signature.project_out(tensors, strength=self.cfg.calibration_strength)

    @property
    def projects_applied(self) -> bool:
        """Whether folds' changes to the model are projected (``calibration_target=applied``,
        with a signature or an erasure jump to protect)."""
        if not self.cfg.calibration or self.cfg.calibration_target != "applied":
            return False
        return self._subspace is not None or bool(self._one_sided)

    @property
    def _protects(self) -> frozenset[str]:
        """What the calibration holds changes to: ``subspace``, ``jump``, ``gradient`` (by
        ``unlearning.protect``; a reply, ``calibration_target=reply``, is only ever projected
        out of the signature)."""
        if self.cfg.calibration_target != "applied":
            return frozenset({"subspace"})
        return PROTECTS[self.cfg.protect]

    @property
    def _subspace(self) -> GradientSignature | None:
        return self.signature if "subspace" in self._protects else None

    @property
    def _one_sided(self) -> list[OneSided]:
        """The one-sided directions the calibration holds changes to: the erasures' jumps and
        forget gradients, as ``_protects`` says."""
        protects = self._protects
        jumps = self.jumps if "jump" in protects else []
        grads = self.gradients if "gradient" in protects else []
        return [*jumps, *grads]

    def project(self, change: Params) -> Params:
        """``change`` (to the model, or a direction the server carries) calibrated by
        ``unlearning.protect``: projected out of the erased data's signature (``last_overlap``
        is the share of it that lay there), and/or without its component moving back along
        each erasure's jump or lowering its forget loss (one-sided; with several directions
        the nearest change that goes against none, `fedasync.unlearning.block_one_sided`)."""
        sig = self._subspace
        if sig is not None:
            self.last_overlap = sig.overlap(change)
            change = sig.project_out(change, strength=self.cfg.calibration_strength)
        return block_one_sided(change, self._one_sided)

    def compensates(self, job: Job) -> bool:
        """Whether delay compensation may use ``job``'s base weights: not across an erasure
        boundary when the applied change is calibrated (w_now − w_base would hold the erasure
        itself, and compensating would pull the model back toward the pre-erasure one)."""
        applied = self.cfg.calibration and self.cfg.calibration_target == "applied"
        return not (applied and job.base_version < self.boundary)

    def record(
        self,
        silo: int | None,
        contributions: dict[str, Params],
        version: int,
        norm: float | None = None,
    ) -> None:
        """What a fold applied: each silo's exact share (the ledger; empty unless
        ``unlearning.server_removal`` asks for it), and the raw norm of the update of ``silo``
        that was folded (FedEraser's history; None at a round's flush)."""
        for s, part in contributions.items():
            self.ledger.record(s, part, version)
        if silo is not None and norm is not None and self.history is not None:
            self.history.record(version, str(silo), norm)

    def take_unlearn(self, erasure: Erasure, decoded: tuple) -> None:
        """Apply a silo's erasure: removal + its delta onto the current model; boundary."""
        srv = self.srv
        if self.active.get(erasure.request_id) is not erasure:
            log.warning("ignored a reply to erasure %s: not in progress", erasure.request_id)
            return  # requeued or finished meanwhile: only the attempt in progress is applied
        delta, basis, names, metrics, gradient = decoded
        delta, bounds = self.bound_delta(erasure, delta)
        new = _add(srv.params, delta)
        if erasure.removal is not None:
            new = _add(new, erasure.removal)
        sig = GradientSignature.from_basis(basis, names)
        grad = None if gradient is None else ForgetGradient.unit(gradient, names)
        self._apply(erasure, new, sig, metrics, bounds, grad)

    def bound_delta(self, erasure: Erasure, delta: Params) -> tuple[Params, dict[str, float]]:
        """``delta`` clipped to the erasure bound, and what was done (``delta_norm``: its L2
        norm as sent; ``delta_bound``; ``clip_factor`` < 1 when it was clipped).

        The bound is the smallest of: ``server.norm_outlier_factor`` x the median norm of
        recently accepted updates (once there are enough), ``server.clip_norm``, and, for PGA,
        the ball radius the erasure was sent (1e-3 relative slack for float rounding). An
        erasure delta is applied at full weight, not at a staleness-weighted mixing rate, so
        it gets at least the bounds any update gets. Clipped rather than rejected: the request
        is still carried out (bounded) and the clip is reported, where a rejection would have
        to fail or retry an erasure the requester is owed.
        """
        srv = self.srv
        bounds: list[float] = []
        threshold = srv.intake.norms.threshold()
        if threshold is not None:
            bounds.append(threshold)
        if srv.cfg.server.clip_norm is not None:
            bounds.append(float(srv.cfg.server.clip_norm))
        if self.cfg.method == "pga":
            bounds.append(SiloErasure.of(self.cfg, erasure.overrides).radius * (1 + 1e-3))
        norm = global_norm(delta)
        report = {"delta_norm": norm}
        if not bounds:
            return delta, report
        bound = min(bounds)
        clipped, factor = clip_by_norm(delta, bound, norm)
        report["delta_bound"] = bound
        if factor < 1.0:
            report["clip_factor"] = factor
            log.warning(
                "erasure %s of silo %d: delta norm %.4g clipped to the bound %.4g",
                erasure.request_id,
                erasure.silo,
                norm,
                bound,
            )
        return clipped, report

    def _apply(
        self,
        erasure: Erasure,
        new: Params,
        sig: GradientSignature | None,
        metrics: dict[str, float],
        bounds: dict[str, float] | None = None,
        gradient: ForgetGradient | None = None,
    ) -> None:
        """Put the erased model in force: the erasure boundary, verification, durability."""
        srv, protects = self.srv, self._protects
        kept: dict[str, float] = {}  # what the calibrating event says of what is protected
        if sig is not None and self.cfg.signature_unique:
            sig, kept = self._unique(erasure, sig)
        if sig is not None:
            self.signature = sig if self.signature is None else self.signature.merge(sig)
        jump = ErasureJump.between(srv.params, new) if "jump" in protects else None
        if jump is not None:
            self.jumps.append(jump)
        if "gradient" in protects:
            kept["forget_gradient"] = float(gradient is not None)
            if gradient is not None:
                self.gradients.append(gradient)
            else:
                log.warning(
                    "erasure %s: unlearning.protect=%s but silo %d sent no forget gradient "
                    "(an older silo, or FedEraser): it is not protected against",
                    erasure.request_id,
                    self.cfg.protect,
                    erasure.silo,
                )
        if self.projects_applied:  # what the server carries past the boundary, calibrated
            dropped = srv.pipeline.at_boundary(str(erasure.silo), self.project)
            log.info(
                "erasure %s: %d buffered update(s) of silo %d dropped; the buffer, the server "
                "optimiser's moment and error-feedback residuals projected",
                erasure.request_id,
                dropped,
                erasure.silo,
            )
        if erasure.sample_ids:
            self.excluded.setdefault(erasure.silo, []).extend(erasure.sample_ids)
        else:
            self.retired.add(erasure.silo)
            self.ledger.forget(str(erasure.silo))
        before = float(srv.evaluate_fn(srv.params)["score"])  # just before the boundary
        erasure.around_boundary = (srv.params, new)
        srv.apply_erasure(new)
        erasure.boundary = self.boundary = srv.version
        erasure.applied_t = srv.clock.now
        after = float(srv.evaluate_fn(srv.params)["score"])  # just after it
        erasure.metrics_at_boundary = {
            **self.verify_fn(srv.params, erasure.silo, erasure.sample_ids),
            **{f"silo_{k}": v for k, v in metrics.items()},  # what the silo reported
            **(bounds or {}),  # the server's bound on the silo's delta (bound_delta)
            **kept,  # signature_unique's share removed; whether a forget gradient came
            "score_before": before,
            "score_after": after,
            "boundary_dip": before - after,
        }
        self.applied.add(erasure.request_id)
        srv.checkpoint()  # the model with the erasure is durable before the store says so
        self.store.transition(
            erasure.request_id,
            State.CALIBRATING,
            actor="server",
            model_version=srv.version,
            boundary_version=srv.version,
            metrics=erasure.metrics_at_boundary,
            detail=f"erasure applied at version {srv.version}; calibrating",
        )
        self.event(erasure, "calibrating", **erasure.metrics_at_boundary)
        self.halting = False  # re-evaluated by the next poll if more requests wait
        if self.cfg.halt and not srv.barrier:  # (a sync round restarts everyone by itself)
            for silo in self.halted_silos():
                srv.dispatch(silo)  # the halted federation resumes

    def _unique(
        self, erasure: Erasure, sig: GradientSignature
    ) -> tuple[GradientSignature | None, dict[str, float]]:
        """``unlearning.signature_unique``: ``sig`` without the span of the other silos'
        latest accepted updates (`GradientSignature.without_span`; None: nothing of it is
        unique), and what that did: ``signature_shared``, the share of the signature in that
        span (`GradientSignature.span_share`), the ranks before and after, and how many
        updates spanned it."""
        vectors = [
            flatten(p, sig.names)
            for silo, p in self.recent
            if silo != erasure.silo and all(n in p for n in sig.names)
        ]
        shared = sig.span_share(vectors)
        unique = sig.without_span(vectors)
        report = {
            "signature_shared": shared,
            "signature_rank_sent": float(sig.rank),
            "signature_rank_unique": float(0 if unique is None else unique.rank),
            "unique_updates": float(len(vectors)),
        }
        log.info(
            "erasure %s: %.1f%% of its signature lies in the span of %d update(s) of other "
            "silos; rank %d -> %d",
            erasure.request_id,
            100 * shared,
            len(vectors),
            sig.rank,
            0 if unique is None else unique.rank,
        )
        return unique, report

    def failed(self, erasure: Erasure, why: str) -> None:
        """The erasure cannot be carried out: ``failed`` with ``why`` (a silo that went down
        is ``requeue``'s, not this)."""
        if self.active.get(erasure.request_id) is not erasure:
            return  # an attempt already given up (requeued): its request has moved on
        self.active.pop(erasure.request_id, None)
        self.store.transition(
            erasure.request_id,
            State.FAILED,
            actor="server",
            model_version=self.srv.version,
            detail=why,
        )
        self.event(erasure, "failed", detail=why)

    def requeue(self, erasure: Erasure, why: SiloLost) -> None:
        """Its silo went down mid-erasure: back to ``queued`` (the audit row says why), to be
        started again by ``poll`` when the silo is back; ``failed`` after
        ``unlearning.max_attempts`` losses that were not the silo being offline."""
        srv, rid = self.srv, erasure.request_id
        if self.active.get(rid) is not erasure or erasure.boundary is not None:
            return  # not in progress, or already applied (then it is not lost)
        if why.offline:
            detail = (
                f"{WENT_OFFLINE}: {why}; will retry when it returns "
                "(not counted against unlearning.max_attempts)"
            )
            self.not_before[rid] = srv.clock.now + srv.cfg.server.offline_retry_s
        else:
            n = 1 + sum(1 for a in self.store.requeues(rid) if a.detail.startswith(WENT_DOWN))
            if n >= self.max_attempts:
                self.failed(
                    erasure,
                    f"{WENT_DOWN} {n} times (unlearning.max_attempts={self.max_attempts}); "
                    f"last: {why}",
                )
                return
            detail = (
                f"{WENT_DOWN} (attempt {n} of {self.max_attempts}): {why}; "
                "will retry when it returns"
            )
        del self.active[rid]
        self.waiting.add(erasure.silo)  # no training for it before the erasure starts again
        log.warning("erasure %s of silo %d back to queued: %s", rid, erasure.silo, detail)
        self.store.transition(
            rid, State.QUEUED, actor="server", model_version=srv.version, detail=detail
        )
        self.event(erasure, "queued", detail=detail)

    def event(self, e: Erasure, state: str, **extra: Any) -> None:
        """The ``erasure`` event of ``e`` entering ``state`` (metrics.jsonl)."""
        srv = self.srv
        srv.events.write(
            "erasure",
            t=srv.clock.now,
            version=srv.version,
            request=e.request_id,
            silo=e.silo,
            state=state,
            **extra,
        )

    def row(self, e: Erasure) -> dict[str, Any]:
        """What the summary reports of an applied erasure."""
        # latency as the requester sees it: from submission to the erasure in the model;
        # others' work counts while the silo erased (a halted federation drains its work in
        # flight between submission and the start of erasing, and starts nothing new)
        latency, clock = (e.applied_t or 0.0) - e.submitted_t, self.srv.clock.kind
        if e.submitted_wall_ms is not None:  # submitted before a restart, on the virtual clock
            applied = [
                a.time_ms
                for a in self.store.audit(e.request_id)
                if a.action == "transition" and a.to_state is State.CALIBRATING
            ]
            if applied:  # from submission to the erasure in the model, both on the wall clock
                latency, clock = (applied[0] - e.submitted_wall_ms) / 1000, "wall"
        return {
            "request": e.request_id,
            "silo": e.silo,
            "scope": "silo" if not e.sample_ids else f"{len(e.sample_ids)} samples",
            "submitted_t": e.submitted_t,
            "started_t": e.started_t,
            "boundary_version": e.boundary,
            "erasure_latency_s": latency,
            "latency_clock": clock,  # "virtual" or "wall": the clock erasure_latency_s is on
            "updates_from_others_while_erasing": self.srv.updates_accepted_between(
                e.started_t or 0.0, e.applied_t or 0.0
            ),
            # the global test score just before vs just after the boundary (positive: a drop)
            "boundary_dip": e.metrics_at_boundary.get("boundary_dip"),
            "at_boundary": e.metrics_at_boundary,
        }

    def on_version(self) -> None:
        """Verify erasures whose relearning window has passed."""
        srv = self.srv
        for rid, e in list(self.active.items()):
            if e.boundary is None:
                continue
            since = srv.version - e.boundary
            if since < self.cfg.relearn_versions:
                every = self.cfg.watch_every
                if every and since > 0 and since % every == 0:
                    self._watch(e, since)
                continue
            after = self._verify(e)
            e.around_boundary = None
            row = {**self.row(e), "after_relearn": after, "verified_version": srv.version}
            self.report.append(row)
            del self.active[rid]
            self.store.transition(
                rid,
                State.VERIFIED,
                actor="server",
                model_version=srv.version,
                metrics=after,
                detail=f"verified after {self.cfg.relearn_versions} versions",
            )
            self.event(e, "verified", **after)

    def _verify(self, e: Erasure) -> dict[str, float]:
        """The verification metrics of the current model for ``e``, with how far it went back
        toward the pre-erasure model (``reversion_ratio``; not after a restart)."""
        srv = self.srv
        metrics = self.verify_fn(srv.params, e.silo, e.sample_ids)
        if e.around_boundary is not None:
            w_pre, w_b = e.around_boundary
            metrics["reversion_ratio"] = reversion_ratio(srv.params, w_b, w_pre)
        return metrics

    def _watch(self, e: Erasure, since: int) -> None:
        """An ``erasure_watch`` event: the erased model's verification metrics ``since``
        versions after the boundary, and its reversion ratio (``unlearning.watch_every``)."""
        srv = self.srv
        metrics = self._verify(e)
        srv.events.write(
            "erasure_watch",
            t=srv.clock.now,
            version=srv.version,
            request=e.request_id,
            silo=e.silo,
            since_boundary=since,
            **metrics,
        )

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The erasures in progress, the ledger, the signatures, the one-sided directions, the
        window of recent updates (``signature_unique``) and the FedEraser history."""
        return {
            "jumps": [j.state_dict() for j in self.jumps],
            "gradients": [g.state_dict() for g in self.gradients],
            "recent": [{"silo": silo, "tensors": clone(p)} for silo, p in self.recent],
            "ledger": self.ledger.state_dict(),
            "history": None if self.history is None else self.history.state_dict(),
            "signature": None if self.signature is None else self.signature.state_dict(),
            "boundary": self.boundary,
            "retired": sorted(self.retired),
            "excluded": {str(k): list(v) for k, v in self.excluded.items()},
            "applied": sorted(self.applied),
            "schedule": [list(x) for x in self.schedule],
            "report": list(self.report),
            "calibrating": {
                rid: {
                    "silo": e.silo,
                    "sample_ids": e.sample_ids,
                    "boundary": e.boundary,
                    "submitted_t": e.submitted_t,
                    "submitted_wall_ms": e.submitted_wall_ms,
                    "started_t": e.started_t,
                    "applied_t": e.applied_t,
                    "metrics": e.metrics_at_boundary,
                }
                for rid, e in self.active.items()
                if e.boundary is not None
            },
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.jumps = [ErasureJump.from_state(j) for j in d.get("jumps", [])]
        self.gradients = [ForgetGradient.from_state(g) for g in d.get("gradients", [])]
        self.recent.clear()  # (absent in older checkpoints: the window starts empty)
        for r in d.get("recent", []):
            self.recent.append((int(r["silo"]), clone(r["tensors"])))
        self.ledger.load_state_dict(d["ledger"])
        if self.history is not None and d.get("history"):  # (absent: FedEraser was off)
            self.history.load_state_dict(d["history"])
        if d["signature"] is not None:
            self.signature = GradientSignature(basis=torch.zeros(0, 0), names=[])
            self.signature.load_state_dict(d["signature"])
        self.boundary = int(d["boundary"])
        self.retired = set(d["retired"])
        self.excluded = {int(k): list(v) for k, v in d["excluded"].items()}
        self.applied = set(d["applied"])
        self.schedule = [tuple(x) for x in d["schedule"]]  # type: ignore[misc]
        self.report = list(d["report"])
        for rid, c in d["calibrating"].items():
            self.active[rid] = Erasure(
                rid,
                c["silo"],
                c["sample_ids"],
                c["submitted_t"],
                started_t=c["started_t"],
                submitted_wall_ms=c.get("submitted_wall_ms"),  # absent in older checkpoints
                boundary=c["boundary"],
                applied_t=c["applied_t"],
                metrics_at_boundary=c["metrics"],
            )

    def reconcile(self) -> None:
        """After a restart: match the store's unfinished requests with the restored model.

        The model with an erasure applied is checkpointed before the store moves the request
        to calibrating, so: erasing + applied -> the transition was lost, finish it; erasing
        and not applied -> the erasure never reached a checkpoint, run it again (the silo
        is sent train.unlearn anew); queued -> picked up by ``poll`` as usual. A request
        resumed mid-erasure (erasing, calibrating) gets an audit row saying so (``note``).

        The store can also be ahead of the checkpoint: a request verified (or failed) after
        the last checkpoint and before the server died is restored as calibrating. It is done:
        it leaves the active set instead of being verified a second time (which the lifecycle
        forbids: verified -> verified), and its verification stays the store's.
        """
        for rid in list(self.active):
            done = self.store.get(rid)
            if done is not None and is_terminal(done.state):
                log.info(
                    "erasure %s was %s after the checkpoint this run resumed from: not verified "
                    "again",
                    rid,
                    done.state,
                )
                del self.active[rid]
        for req in self.store.unfinished():
            if req.state is State.CALIBRATING:  # applied; verified after its window
                self.store.note(
                    req.id,
                    actor="server",
                    model_version=self.srv.version,
                    detail="resumed after restart (calibrating)",
                )
            if req.state is not State.ERASING:
                continue
            if req.id in self.applied:
                self.store.transition(
                    req.id,
                    State.CALIBRATING,
                    actor="server",
                    model_version=self.srv.version,
                    detail="resumed after a restart",
                )
            elif req.silo in self.srv.roster:
                log.info("erasure %s restarts after a server restart", req.id)
                self._start(req, resumed=True)
            else:  # its silo is not here after the restart: it waits, queued, for it
                detail = (
                    f"{WENT_OFFLINE}: silo {req.silo} is not in the roster after a server "
                    "restart; will start when it returns"
                )
                log.warning("erasure %s of silo %d back to queued: %s", req.id, req.silo, detail)
                self.store.transition(
                    req.id,
                    State.QUEUED,
                    actor="server",
                    model_version=self.srv.version,
                    detail=detail,
                )


def _add(a: Params, b: Params) -> Params:
    """``a + b`` on ``a``'s floating tensors. Unlike ``fedasync.tensors.add``, ``b`` may hold
    only the floating tensors (the ledger records nothing else)."""
    return {k: (a[k] + b[k]) if a[k].is_floating_point() else a[k] for k in a}
