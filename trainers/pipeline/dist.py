"""A real P-stage pipeline: one process per stage, activations and gradients sent stage to
stage with ``torch.distributed`` (gloo on CPU).

Papers: as :mod:`trainers.pipeline.emulate` (GPipe, 1F1B-flush, PipeDream-2BW). Each rank
builds the whole model from the seed and keeps its own stage, so every rank starts from the
emulator's weights; it runs its stage's operations in :func:`stage_order`'s order: a forward
receives its input from the previous rank (rank 0 reads the ids), keeps input and output for
its backward and sends the output on (sends are ``isend``: 1F1B's interleaving would
deadlock on blocking sends); a backward receives the gradient of its output from the next
rank (the last rank starts from the loss) and sends its input's gradient back. After the
batch each rank steps its own optimiser. 2BW computes under the stage's previous weights
(a stashed copy) and applies the gradient to the newest, stage by stage, as the emulator
does. Every rank computes on one thread. Rendezvous is a file in a temporary folder, so no
port is taken; processes are started by ``torch.multiprocessing`` and joined, and a rank
that fails ends the run with an error naming its stage.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainers.pipeline.emulate import stage_order
from trainers.pipeline.model import GPTConfig, build_stages


@dataclass(frozen=True)
class PipeJob:
    """What every rank needs to run the same pipeline."""

    cfg: GPTConfig
    stages: int
    schedule: str
    micro: int
    steps: int
    batch: int
    lr: float
    seed: int = 0
    data_seed: int = 0
    delay: int = 1


def synthetic_batches(job: PipeJob) -> list[tuple[Tensor, Tensor]]:
    """The job's batches (the same on every rank): windows of a seeded random id stream."""
    g = torch.Generator().manual_seed(job.data_seed)
    ctx = job.cfg.context
    stream = torch.randint(0, job.cfg.vocab_size, (max(4 * ctx * job.batch, 4096),), generator=g)
    out = []
    for _ in range(job.steps):
        s = torch.randint(0, stream.numel() - ctx - 1, (job.batch,), generator=g)
        idx = s[:, None] + torch.arange(ctx)
        out.append((stream[idx], stream[idx + 1]))
    return out


TORCH_SCHEDULES = ("torch-gpipe", "torch-1f1b")
"""``torch.distributed.pipelining``'s own ScheduleGPipe / Schedule1F1B, the reference the
synchronous schedules are checked against."""


def _torch_schedule(rank: int, job: PipeJob, out_dir: str) -> None:
    """The same job on ``torch.distributed.pipelining``'s schedule (rank's stage, its own
    AdamW, gradients scaled by 1/m as ours are)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = build_stages(job.cfg, job.stages, job.seed)[rank]
    opt = torch.optim.AdamW(stage.parameters(), lr=job.lr)
    mb = job.batch // job.micro
    example = (
        torch.zeros(mb, job.cfg.context, dtype=torch.long)
        if rank == 0
        else torch.zeros(mb, job.cfg.context, job.cfg.d_model)
    )
    pipe_stage = PipelineStage(stage, rank, job.stages, torch.device("cpu"), input_args=example)

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    kind = ScheduleGPipe if job.schedule == "torch-gpipe" else Schedule1F1B
    sched = kind(pipe_stage, job.micro, loss_fn=loss_fn)
    losses = []
    for x, y in synthetic_batches(job):
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == job.stages - 1:
            got: list[Tensor] = []
            sched.step(target=y, losses=got)
            losses.append(sum(float(v) for v in got) / job.micro)
        else:
            sched.step()
        opt.step()
    _save(rank, job, stage, losses, out_dir)


def _save(rank: int, job: PipeJob, stage: torch.nn.Module, losses: list[float], out: str) -> None:
    torch.save(
        {k: v.detach().clone() for k, v in stage.state_dict().items()},
        Path(out) / f"stage{rank}.pt",
    )
    if rank == job.stages - 1:
        (Path(out) / "losses.json").write_text(json.dumps(losses))


def _rank_main(rank: int, job: PipeJob, rendezvous: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=job.stages
    )
    try:
        if job.schedule in TORCH_SCHEDULES:
            _torch_schedule(rank, job, out_dir)
            return
        stage = build_stages(job.cfg, job.stages, job.seed)[rank]
        opt = torch.optim.AdamW(stage.parameters(), lr=job.lr)
        stale = copy.deepcopy(stage) if job.schedule == "2bw" and job.delay else None
        previous = copy.deepcopy(stage.state_dict()) if stale is not None else None
        ops = stage_order(job.schedule, job.stages, job.micro)[rank]
        last, first = rank == job.stages - 1, rank == 0
        losses = []
        for x, y in synthetic_batches(job):
            work = stage
            if stale is not None:
                assert previous is not None
                stale.load_state_dict(previous)  # W(t−1) (W(0) at the first step)
                previous = copy.deepcopy(stage.state_dict())
                work = stale
            work.zero_grad(set_to_none=True)
            xs, ys = x.chunk(job.micro), y.chunk(job.micro)
            held: dict[int, tuple[Tensor, Tensor]] = {}
            sends: list[Any] = []
            total = 0.0
            for kind, i in ops:
                if kind == "F":
                    if first:
                        inp = xs[i]
                    else:
                        inp = torch.empty(xs[i].shape[0], job.cfg.context, job.cfg.d_model)
                        dist.recv(inp, src=rank - 1)
                        inp.requires_grad_(True)
                    out = work(inp)
                    held[i] = (inp, out)
                    if not last:
                        sends.append(dist.isend(out.detach().contiguous(), dst=rank + 1))
                else:
                    inp, out = held.pop(i)
                    if last:
                        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), ys[i].reshape(-1))
                        total += float(loss.detach())
                        (loss / job.micro).backward()
                    else:
                        grad = torch.empty_like(out)
                        dist.recv(grad, src=rank + 1)
                        out.backward(grad)
                    if not first:
                        assert inp.grad is not None
                        sends.append(dist.isend(inp.grad.contiguous(), dst=rank - 1))
            for req in sends:
                req.wait()
            if work is not stage:
                for p, q in zip(stage.parameters(), work.parameters()):
                    p.grad = None if q.grad is None else q.grad.clone()
            opt.step()
            losses.append(total / job.micro)
        _save(rank, job, stage, losses, out_dir)
    finally:
        dist.destroy_process_group()


class StageFailed(RuntimeError):
    """A stage's process failed; the message names the stage."""


def run_pipeline(job: PipeJob, out_dir: Path) -> dict[str, Any]:
    """Run ``job`` on ``job.stages`` processes; the last stage's per-batch losses and every
    stage's final weights (``stage{r}.pt`` in ``out_dir``)."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fa-pipe-") as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        try:
            mp.spawn(_rank_main, args=(job, rendezvous, str(out_dir)), nprocs=job.stages, join=True)
        except mp.ProcessRaisedException as e:
            raise StageFailed(
                f"pipeline stage {e.error_index} failed: {str(e).strip().splitlines()[-1][:300]}"
            ) from e
        except mp.ProcessExitedException as e:
            raise StageFailed(
                f"pipeline stage {e.error_index} died (exit code {e.exit_code})"
            ) from e
    losses = json.loads((out_dir / "losses.json").read_text())
    weights = [torch.load(out_dir / f"stage{r}.pt", weights_only=True) for r in range(job.stages)]
    return {"losses": losses, "weights": weights, "job": asdict(job)}
