"""What the server sends its silos: train, calibration and unlearn requests, built and sent.

Paper: none. ``JobRequests`` builds each job's message (protocol/messages.py,
protocol/erasure_messages.py) from the server's state: its job id and timing on the clock,
the weights it starts from (the current model, or those kept for a resumed job), the fault a
robustness run injects, the samples the silo must leave out, and its seed, derived from
(``run.seed``, silo, job id) so that no generator state is kept (``train_seed``,
``unlearn_seed``). It is given what it reads. Every message leaves through the dispatcher's
``send`` (server/dispatch.py), which refuses a second job for a busy silo. Whether a silo is
sent training work at all is the loop's decision; this module only builds what it was told
to send.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedasync import Params, seeds
from fedasync.clock import Clock
from fedasync.events import EventLog
from protocol.config import SiloErasure
from protocol.erasure_messages import UnlearnRequest
from protocol.ids import fraction_ids
from protocol.messages import TrainRequest
from server.config import FedAsyncConfig
from server.dispatch import Dispatcher, FaultSchedule
from server.intake import Job, JobKind

log = logging.getLogger("fedasync.server")


def train_seed(seed: int, silo: int, job_id: int) -> int:
    """The seed of ``silo``'s train (or calibration) job ``job_id`` in a run of ``seed``."""
    return seeds.int_seed(seed, "job.train", silo, job_id)


def unlearn_seed(seed: int, silo: int, job_id: int) -> int:
    """The seed of ``silo``'s unlearn job ``job_id`` in a run of ``seed``."""
    return seeds.int_seed(seed, "job.unlearn", silo, job_id)


class JobRequests:
    """Builds the server's messages to its silos and sends them through its dispatcher
    (``jobs``), on ``clock``, naming each silo's node from ``roster`` (filled once the silos
    are known). ``model`` gives the current version and weights; ``erased_ids`` a silo's
    samples erased so far; ``faults`` what a robustness run injects (a ``fault`` event each).

    ``sample_ids_fn`` (silo -> its sample ids; None where the server holds no silo data)
    gives the ids a seeded share of which a silo never trains on (``lab.exclude_samples``).
    """

    def __init__(
        self,
        cfg: FedAsyncConfig,
        setup_json: str,
        run_dir: Path,
        *,
        jobs: Dispatcher,
        faults: FaultSchedule,
        clock: Clock,
        events: EventLog,
        roster: Mapping[int, int],
        model: Callable[[], tuple[int, Params]],
        erased_ids: Callable[[int], Sequence[str]],
        sample_ids_fn: Any = None,
    ):
        self.cfg, self.setup_json, self.run_dir = cfg, setup_json, run_dir
        self.jobs, self.faults, self.clock, self.events = jobs, faults, clock, events
        self.roster, self.model, self.erased_ids = roster, model, erased_ids
        self.sample_ids_fn = sample_ids_fn
        self._never: dict[int, tuple[str, ...]] = {}  # lab.exclude_samples, by silo

    def base_kept(self, version: int) -> bool:
        """Whether jobs of base ``version`` can be sent that version's weights (the current
        model, or weights kept for jobs sent earlier; see dispatch.MAX_SNAPSHOTS)."""
        return version == self.model()[0] or version in self.jobs.sent

    def train(self, silo: int, resend: Mapping[str, Any] | None = None) -> None:
        """Send ``silo`` a train job: a new one from the newest model, or (on resume) its old
        job as it was sent (``resend``: its job id, base version, timing and fault, as
        ``Dispatcher.jobs_to_resend`` keeps them)."""
        version, current = self.model()
        job_id = self.jobs.new_job_id() if resend is None else int(resend["job_id"])
        base_version = version if resend is None else int(resend["base_version"])
        timing = None if resend is None else (resend["dispatched_at"], resend["finishes_at"])
        fault = None if resend is None else resend["fault"]
        if not self.base_kept(base_version):
            # a resumed job whose weights were dropped (dispatch.MAX_SNAPSHOTS): it
            # is sent the current model instead, as of the current version
            log.info("job %d of silo %d re-sent at version %d", job_id, silo, version)
            base_version = version
        params = current if base_version == version else self.jobs.sent[base_version]
        self.jobs.keep_sent(base_version, params)
        if fault is None:
            f = self.faults.take(silo, version, self.clock.now)
            if f is not None:
                self.events.write("fault", t=self.clock.now, version=version, **f)
            fault = "" if f is None else str(f["kind"])
        if timing is None:
            jt = self.clock.schedule(silo, job_id, self.cfg.client.local_steps)
            timing = (jt.dispatched_at, jt.finishes_at)
        keep = self.faults.replay_pending(silo)
        self._push_train(silo, job_id, base_version, params, timing, fault=fault, keep=keep)

    def _push_train(
        self,
        silo: int,
        job_id: int,
        base_version: int,
        params: Params,
        timing: tuple[float, float],
        *,
        fault: str = "",
        keep: bool = False,
        local_steps: int | None = None,
        kind: JobKind = JobKind.TRAIN,
        erasure: Any = None,
    ) -> bool:
        """Build ``silo``'s train message (protocol/messages.py) and send it."""
        cfg = self.cfg
        request = TrainRequest(
            setup_json=self.setup_json,
            job_id=job_id,
            base_version=base_version,
            seed=train_seed(cfg.run.seed, silo, job_id),
            params=params,
            fault=fault,
            keep_reply=keep,
            exclude=self.excluded_ids(silo),
            relearn=silo == cfg.lab.backdoor.relearn_silo
            and cfg.lab.backdoor.enabled
            and self.clock.now >= cfg.lab.backdoor.relearn_after_s,
            local_steps=local_steps,
            # where silos without a privacy-db node config keep their ledger
            privacy_dir=str((self.run_dir / "privacy").resolve())
            if cfg.client.dp.enabled
            else None,
        )
        msg = request.to_message(self.roster[silo], ttl=cfg.server.reply_timeout_s)
        job = Job("", silo, self.roster[silo], job_id, base_version, *timing, 0.0, fault)
        job.kind, job.erasure = kind, erasure
        return self.jobs.send(msg, job, self.model()[0])

    def calibration(self, silo: int, start: Params, steps: int, erasure: Any) -> bool:
        """FedEraser: a train message of ``steps`` local steps from the model being rebuilt."""
        job_id, timing = self._side_job(silo, steps)
        return self._push_train(
            silo,
            job_id,
            self.model()[0],
            start,
            timing,
            local_steps=steps,
            kind=JobKind.CALIBRATE,
            erasure=erasure,
        )

    def _side_job(self, silo: int, steps: float) -> tuple[int, tuple[float, float]]:
        """A new job id and (dispatched, finishes) for a job of ``steps`` steps outside the
        regular schedule (erasure work: no jitter, as the virtual clock's schedule has)."""
        job_id = self.jobs.new_job_id()
        jt = self.clock.schedule(silo, job_id, steps, jitter=False)
        return job_id, (jt.dispatched_at, jt.finishes_at)

    def unlearn(self, silo: int, start: Params, erasure: Any) -> bool:
        """Send ``silo`` a train.unlearn message: erase ``erasure``'s samples from ``start``.
        False when refused (the silo holds a job): the coordinator starts erasures only on an
        idle silo, so this is a bug's trace, and the coordinator puts the request back in its
        queue."""
        version = self.model()[0]
        # the erasure's own size (scaled to its forget set) over the configured one
        erase = SiloErasure.of(erasure.overrides, self.cfg.unlearning, self.cfg.lab.erasure)
        # the erasure steps, then one gradient per signature batch; one that stops by itself
        # is scheduled after the least it can take, and settled by its reply (``Dispatcher.settle``)
        least, most = erase.work_bounds(self.cfg.client.batch_size)
        job_id, timing = self._side_job(silo, least)
        request = UnlearnRequest(
            setup_json=self.setup_json,
            job_id=job_id,
            base_version=version,
            seed=unlearn_seed(self.cfg.run.seed, silo, job_id),
            params=start,
            erasure=erase,
            forget=tuple(erasure.sample_ids),
        )
        msg = request.to_message(self.roster[silo], ttl=self.cfg.server.reply_timeout_s)
        job = Job("", silo, self.roster[silo], job_id, version, *timing, 0.0)
        job.kind, job.erasure = JobKind.UNLEARN, erasure
        if most > least and not self.clock.realtime:
            job.work = (least, most)
        return self.jobs.send(msg, job, version)

    def excluded_ids(self, silo: int) -> tuple[str, ...]:
        """The samples ``silo`` trains without: those erased before, and a seeded share it
        never trains on (``lab.exclude_samples``: a sample-level erasure's retraining)."""
        gone = self.erased_ids(silo)
        if silo not in self._never:
            share = self.cfg.lab.excluded_share(silo)
            ids = self.silo_sample_ids(silo)
            if share is not None and not ids:
                raise RuntimeError(
                    f"lab.exclude_samples names silo {silo}, whose sample ids this server "
                    "does not hold (simulation only)"
                )
            seed = self.cfg.run.seed
            never = fraction_ids(ids, seed, silo, share) if share is not None else ()
            self._never[silo] = tuple(never)
        return (*gone, *self._never[silo])

    def silo_sample_ids(self, silo: int) -> list[str]:
        """The sample ids ``silo`` holds (empty when the server was given no ``sample_ids_fn``)."""
        return [] if self.sample_ids_fn is None else list(self.sample_ids_fn(silo))
