"""A server's checkpoint: what it holds, how it is captured from the server and restored.

A checkpoint is everything the loop needs to continue as if it had never stopped, as
``server_state`` composes it from the server's parts: the global weights and version, the jobs
in flight (re-sent identically), the byte offset of metrics.jsonl, the loop's own state (the
clock, the budget's origin) and each part's ``state_dict`` (the dispatcher's job ids, retries
and the weights the jobs were sent, the faults, the correction pipeline's aggregator and
residuals, the intake's norm detectors, the run statistics, privacy, the cancellations, the
erasure coordinator, the best evaluated model). Each checkpoint also keeps the weights as a
model snapshot first (server/models.py), for ``fedasync export``. ``load_server_state``
hands each part back its own; ``write_checkpoint``
and ``resume`` are what the loop and the run call. All randomness is derived from
(seed, silo, job id), so there is no generator state to save. Files are written atomically
with a SHA-256 digest and verified when read (fedasync.checkpoint); `check_resumable` tells,
before any engine starts, whether a run can continue from one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.errors import CheckpointError
from fedasync.flat import flatten

if TYPE_CHECKING:
    from server.loop import AsyncServer

log = logging.getLogger("fedasync.server")

FORMAT = 2
"""Format 2: the server's state is its own (``loop``) plus each part's ``state_dict``."""
CHECKPOINT_FILE = "checkpoint.pt"
"""The checkpoint's name in the run folder (``<run.out_dir>/<run.name>/checkpoint.pt``)."""


@dataclass
class CheckpointState:
    """A server checkpoint as ``server_state`` returns it, typed where it is read
    before a server exists (the mode and the model, checked by ``check_resumable``)."""

    mode: str
    version: int
    params: dict[str, Any]
    jobs: list[dict[str, Any]]
    """The train jobs in flight, to re-send identically."""
    events_offset: int
    """metrics.jsonl's length at the checkpoint (a resume truncates what came after)."""
    loop: dict[str, Any] = field(default_factory=dict)
    parts: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The fields as ``load_server_state`` takes them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """What the file holds: the fields and the format."""
        return {"format": FORMAT, **self.as_dict()}


def save_state(path: Path, state: CheckpointState) -> None:
    """Write ``state`` to ``path`` atomically, sealed with its digest."""
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


def server_state(srv: AsyncServer) -> dict[str, Any]:
    """Everything ``srv``'s loop needs to continue as if it had never stopped: the version and
    weights, the train jobs in flight (re-sent identically; an erasure in flight is restarted
    from the erasure store instead), the event log's length, the clock, and each part's
    ``state_dict`` under ``parts``, as ``torch.optim.Optimizer`` combines its groups."""
    return {
        "mode": srv.cfg.server.mode,
        "version": srv.version,
        "params": srv.params,
        "jobs": [
            {
                "silo": j.silo,
                "job_id": j.job_id,
                "base_version": j.base_version,
                "dispatched_at": j.dispatched_at,
                "finishes_at": j.finishes_at,
                "fault": j.fault,
            }
            for j in srv.jobs.train_jobs()
        ],
        "events_offset": srv.events.offset(),
        "loop": {"clock": srv.clock.state_dict(), "started_at": srv.started_at},
        "parts": {
            "dispatcher": srv.jobs.state_dict(srv.params, srv.version),
            "faults": srv.faults.state_dict(),
            "pipeline": srv.pipeline.state_dict(),
            "intake": srv.intake.state_dict(),
            "stats": srv.stats.state_dict(),
            "privacy": srv.privacy.state_dict(),
            "cancels": srv.cancels.state_dict(),
            "erasure": srv.erasure.state_dict(),  # (None without erasures)
            "best": srv.best.state_dict(),  # (None before an evaluation scored)
        },
    }


def load_server_state(srv: AsyncServer, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Restore into ``srv`` what ``server_state`` returned; the train jobs to re-send."""
    srv.version = int(state["version"])
    srv.params = flatten(state["params"])  # (saved as a plain dict)
    loop, parts = state["loop"], state["parts"]
    srv.clock.load_state_dict(loop["clock"])
    started = loop["started_at"]
    srv.started_at = 0.0 if started is None else float(started)  # the budget's origin
    srv.jobs.load_state_dict(parts["dispatcher"])
    srv.faults.load_state_dict(parts["faults"])
    srv.pipeline.load_state_dict(parts["pipeline"])
    srv.intake.load_state_dict(parts["intake"])
    srv.stats.load_state_dict(parts["stats"])
    srv.privacy.load_state_dict(parts["privacy"])
    if "cancels" in parts:  # (checkpoints written before cancellation have none)
        srv.cancels.load_state_dict(parts["cancels"])
    if parts["erasure"] is not None:  # (ignored by a run that cannot erase)
        srv.erasure.load_state_dict(parts["erasure"])
    srv.best.load_state_dict(parts.get("best"))  # (checkpoints written before it have none)
    return list(state["jobs"])


def write_checkpoint(srv: AsyncServer) -> None:
    """Write ``srv``'s model snapshot (server/models.py), then its ``checkpoint.pt``
    (atomically, with a digest) and a ``checkpoint`` event."""
    srv.models.save(srv.version, srv.params)
    save_state(srv.ckpt_path, CheckpointState(**server_state(srv)))
    srv.events.write("checkpoint", t=srv.clock.now, version=srv.version)


def resume(srv: AsyncServer) -> bool:
    """Restore ``srv`` from its ``checkpoint.pt`` if present and re-send the jobs that were in
    flight; False when there is none (the run starts afresh)."""
    if not srv.ckpt_path.exists():
        return False
    state = load_state(srv.ckpt_path)
    if state.mode != srv.cfg.server.mode:
        raise CheckpointError(
            f"checkpoint is of server.mode={state.mode}, the run is "
            f"server.mode={srv.cfg.server.mode}; set server.mode={state.mode}, or "
            "run.resume=false"
        )
    jobs = load_server_state(srv, state.as_dict())
    srv.events.truncate(state.events_offset)
    srv.models.drop(after=srv.version)  # written past the checkpoint by the run that stopped
    srv.erasure.reconcile()
    srv.events.write("resume", t=srv.clock.now, version=srv.version)
    log.info("resumed from %s at version %d, t=%.1f", srv.ckpt_path, srv.version, srv.clock.now)
    # jobs whose base weights the checkpoint kept go out first, as they were: re-sending a
    # job whose weights were dropped stores the current model, which could evict them
    for j in sorted(jobs, key=lambda j: not srv.requests.base_kept(j["base_version"])):
        srv.dispatch(
            j["silo"],
            job_id=j["job_id"],
            base_version=j["base_version"],
            timing=(j["dispatched_at"], j["finishes_at"]),
            fault=j["fault"],
        )
    if not srv.barrier:  # a silo between two jobs at the checkpoint (its reply just taken)
        busy = {j.silo for j in srv.inflight.values()}
        for silo in sorted(srv.roster):
            if silo not in busy and not srv.is_down(silo):
                srv.dispatch(silo)
    return True
