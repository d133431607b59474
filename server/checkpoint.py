"""What a server checkpoint holds, and how it is captured and restored.

A checkpoint is everything the loop needs to continue as if it had never stopped: the global
weights and version, the aggregator (FedBuff's buffer and the server optimiser), the
error-feedback residuals, the norm detector, the clock, the jobs in flight with the weights
they were sent (so they can be re-sent identically), pending retries and faults, the counters
behind the summary, and the byte offset of metrics.jsonl. All randomness is derived from
(seed, silo, job id), so there is no generator state to save. Files are written atomically
with a SHA-256 digest and verified when read (fedasync.checkpoint); `check_resumable` tells,
before any engine starts, whether a run can continue from one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.errors import CheckpointError
from fedasync.types import Params

if TYPE_CHECKING:
    from server.loop import AsyncServer

FORMAT = 1
CHECKPOINT_FILE = "checkpoint.pt"
"""The checkpoint's name in the run folder (``<run.out_dir>/<run.name>/checkpoint.pt``)."""


@dataclass
class CheckpointState:
    version: int
    params: dict[str, Any]
    aggregator: dict[str, Any]
    error_feedback: dict[str, Any]
    norms: dict[str, Any]
    clock: dict[str, Any]
    next_job_id: int
    jobs: list[dict[str, Any]]
    base_params: dict[int, dict[str, Any]]
    retries: list[tuple[float, int]]
    pending_faults: list[dict[str, Any]]
    faults_fired: list[dict[str, Any]]
    counters: dict[str, Any]
    events_offset: int
    mode: str
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls, srv: AsyncServer) -> CheckpointState:
        train = [
            j
            for j in sorted(srv.inflight.values(), key=lambda j: j.job_id)
            if j.kind == "train"  # an erasure in flight is restarted from the store instead
        ]
        jobs = [
            {
                "silo": j.silo,
                "job_id": j.job_id,
                "base_version": j.base_version,
                "dispatched_at": j.dispatched_at,
                "finishes_at": j.finishes_at,
                "fault": j.fault,
            }
            for j in train
        ]
        bases: dict[int, Params] = {}
        for j in train:
            v = j.base_version
            if v not in bases:
                bases[v] = srv.params if v == srv.version else srv.sent[v]
        return cls(
            version=srv.version,
            params=srv.params,
            aggregator=srv.aggregator.state_dict(),
            error_feedback=srv.ef.state_dict(),
            norms=srv.norms.state_dict(),
            clock=srv.clock.state_dict(),
            next_job_id=srv.next_job_id,
            jobs=jobs,
            base_params=bases,
            retries=list(srv.retries),
            pending_faults=list(srv.pending_faults),
            faults_fired=list(srv.faults_fired),
            counters={
                "rejected": dict(srv.rejected),
                "per_silo": {k: dict(v) for k, v in srv.per_silo.items()},
                "staleness_seen": list(srv.staleness_seen),
                "evals": list(srv.evals),
                "updates_applied": srv.updates_applied,
                "updates_accepted": srv.updates_accepted,
            },
            events_offset=srv.events.offset(),
            mode=srv.cfg.server.mode,
            extra={
                "erasure": srv.erasure.state_dict() if srv.erasure is not None else None,
                "accept_times": list(srv.accept_times),
                "started_at": srv.started_at,
            },
        )

    def restore(self, srv: AsyncServer) -> list[dict[str, Any]]:
        """Load this state into ``srv``; return the jobs to re-send."""
        if self.mode != srv.cfg.server.mode:
            raise CheckpointError(
                f"checkpoint is of server.mode={self.mode}, the run is "
                f"server.mode={srv.cfg.server.mode}; set server.mode={self.mode}, or "
                "run.resume=false"
            )
        srv.version = self.version
        srv.params = self.params
        srv.aggregator.load_state_dict(self.aggregator)
        srv.ef.load_state_dict(self.error_feedback)
        srv.norms.load_state_dict(self.norms)
        srv.clock.load_state_dict(self.clock)
        srv.next_job_id = self.next_job_id
        srv.sent = {int(v): p for v, p in self.base_params.items()}
        srv.retries = [tuple(r) for r in self.retries]  # type: ignore[misc]
        srv.pending_faults = list(self.pending_faults)
        srv.faults_fired = list(self.faults_fired)
        c = self.counters
        srv.rejected.clear()
        srv.rejected.update(c["rejected"])
        for k, v in c["per_silo"].items():
            srv.per_silo[int(k)] = dict(v)
        srv.staleness_seen = list(c["staleness_seen"])
        srv.evals = list(c["evals"])
        srv.updates_applied = int(c["updates_applied"])
        srv.updates_accepted = int(c["updates_accepted"])
        srv.accept_times = list(self.extra.get("accept_times", []))
        started = self.extra.get("started_at")
        srv.started_at = 0.0 if started is None else float(started)  # the budget's origin
        if srv.erasure is not None and self.extra.get("erasure") is not None:
            srv.erasure.load_state_dict(self.extra["erasure"])
        return list(self.jobs)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"format": FORMAT, **asdict(self)}


def save_state(path: Path, state: CheckpointState) -> None:
    save_checkpoint(path, state.to_dict())


def load_state(path: Path) -> CheckpointState:
    """The verified server state in ``path``; CheckpointError (naming the file) otherwise."""
    d = load_checkpoint(path)
    if d.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is of server format {d.get('format')!r}, this fedasync reads "
            f"{FORMAT}; use the fedasync that wrote it, or set run.resume=false"
        )
    d.pop("format")
    try:
        return CheckpointState(**d)
    except TypeError as e:
        raise CheckpointError(
            f"checkpoint {path} does not hold a server state ({e}); set run.resume=false"
        ) from e


def check_resumable(path: Path, mode: str, model: dict[str, torch.Tensor]) -> None:
    """Refuse, before anything starts, a checkpoint a run of ``mode`` whose global model has
    the keys, shapes and dtypes of ``model`` cannot continue from: missing a digest, damaged,
    non-finite, of another server mode, or of another model. A missing file is fine (the run
    starts afresh). Raises CheckpointError naming the file and the key to change."""
    if not path.exists():
        return
    state = load_state(path)
    if state.mode != mode:
        raise CheckpointError(
            f"checkpoint {path} is of server.mode={state.mode}, the run is "
            f"server.mode={mode}; set server.mode={state.mode}, or run.resume=false"
        )
    have = {k: (tuple(v.shape), v.dtype) for k, v in state.params.items()}
    want = {k: (tuple(v.shape), v.dtype) for k, v in model.items()}
    if have != want:
        differ = sorted(set(have) ^ set(want)) or sorted(k for k in have if have[k] != want[k])
        raise CheckpointError(
            f"checkpoint {path} holds another model than this run's (first difference: "
            f"{differ[0]}); set data.benchmark/data.network as in the run that wrote it, "
            "or run.resume=false"
        )
