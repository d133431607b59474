"""A real P-stage pipeline: one process per stage, activations and gradients sent stage to
stage with ``torch.distributed`` (gloo on CPU, NCCL when every stage has its own GPU).

Each rank builds the whole model from the seed, keeps its own stage and runs it in a
:class:`trainers.pipeline.worker.StageWorker` in its schedule's operation order
(:func:`trainers.pipeline.schedule.run_order`): a forward receives its input from the
previous rank (rank 0 reads the ids) and sends its output on; a backward receives the
gradient of its output from the next rank (the last rank starts from the targets) and sends
its input's gradient back. Sends are ``isend`` (1F1B's interleaving would deadlock on
blocking sends), completed ones are let go as the run goes, the rest are waited for at the
end. Every rank computes on ``threads`` threads. Rendezvous is a file in a temporary folder,
so no port is taken. Processes are started by ``torch.multiprocessing`` and joined; a rank
that fails or dies ends the run with :class:`StageFailed` naming the stage, and the others
are stopped.

A signal (Ctrl-C reaches every process of the foreground group): the stage processes ignore
SIGINT (they start with it blocked and then ignore it), and the parent stops them. On the
first signal the parent asks every stage for a checkpoint of one common step, the step after
the furthest any stage has made (a shared array: each stage records its last step, and saves
when it reaches the step asked for), waits until all of them are written (at most
``STOP_GRACE_S``, or until a second signal), then stops the stages and raises
:class:`fedasync.interrupt.Interrupted`; the run resumes from the last step every stage saved
(:func:`latest_checkpoint`).

After each step a rank may write its weights for evaluation (``evals/``) and a checkpoint
(``checkpoints/``, atomic, through :mod:`fedasync.checkpoint`). At the end it writes
``rank{r}.json``: its timeline, measured memory, drift histogram and (last rank) losses.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedasync import seeds
from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.corrections import DelayErrorFeedback
from fedasync.interrupt import (
    DeferredStop,
    Interrupted,
    children_start_deaf,
    ignore_interrupts,
    shielded,
)
from trainers.pipeline.model import GPTConfig, build_stages
from trainers.pipeline.optim import StageOptimizer
from trainers.pipeline.schedule import run_order
from trainers.pipeline.worker import MicroBatches, StageWorker


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
    optimizer: str = "adamw"
    momentum: float = 0.95
    weight_decay: float = 0.0
    warmup: int = 0
    muon_dtype: str = "auto"
    """Muon's orthogonalisation dtype (``optim.muon_dtype``; auto resolves per stage device)."""
    correction: float | None = None
    """The delay error-feedback coefficient β (2BW, PACI), or None for none."""
    max_drift: int | None = None
    """PACI's bound on the steps a micro-batch may cross (None: the schedule's own)."""
    data: str = "synthetic"
    """synthetic (a seeded random id stream) or corpus (the Shakespeare plays)."""
    val_fraction: float = 0.1
    start: int = 0
    """First batch (a resumed run starts at its checkpoint's step)."""
    eval_every: int = 0
    checkpoint_every: int = 0
    kill_stage: int = -1
    kill_at_step: int = 0
    threads: int = 1
    device: str = "cpu"
    comm: str = "gloo"
    extra: dict[str, Any] = field(default_factory=dict)
    """Stored with every checkpoint (the run's config, to refuse resuming another run)."""


class BatchSource:
    """Batch ``t`` of a job: ``data.batch`` windows of its id stream (the corpus's training
    text, or a seeded random stream for ``synthetic``), drawn with batch t's own seeded
    generator, so any process and a resumed run draw the same batch ``t``. ``corpus`` is an
    already loaded :class:`trainers.pipeline.corpus.Corpus` to use instead of loading it."""

    def __init__(self, job: PipeJob, corpus: Any = None) -> None:
        self.job = job
        if job.data == "corpus":
            if corpus is None:
                from trainers.pipeline.corpus import load_corpus

                corpus = load_corpus(val_fraction=job.val_fraction)
            self.stream = corpus.train
        elif job.data == "synthetic":
            n = max(4 * job.cfg.context * job.batch, 4096)
            g = torch.Generator().manual_seed(job.data_seed)
            self.stream = torch.randint(0, job.cfg.vocab_size, (n,), generator=g)
        else:
            raise ValueError(f"data must be synthetic or corpus, got {job.data!r:.40}")

    def __call__(self, t: int) -> tuple[Tensor, Tensor]:
        """Batch ``t``: ids and next-id targets, each ``(data.batch, context)``."""
        from trainers.pipeline.corpus import batch

        g = torch.Generator().manual_seed(
            seeds.linear_seed(self.job.data_seed, "pipeline.batch", t)
        )
        return batch(self.stream, self.job.cfg.context, self.job.batch, g)


STOP_GRACE_S = 10.0
"""After a first signal, how long the parent waits for every stage's checkpoint of the step it
asked for before it stops them anyway (the run then resumes from an earlier checkpoint)."""

TORCH_SCHEDULES = ("torch-gpipe", "torch-1f1b")
"""``torch.distributed.pipelining``'s own ScheduleGPipe / Schedule1F1B, the reference the
synchronous schedules are checked against."""


def eval_path(out: Path, step: int, rank: int) -> Path:
    """Where rank ``rank`` writes its stage's weights after ``step`` (for evaluation)."""
    return out / "evals" / f"step{step:06d}_stage{rank}.pt"


def checkpoint_path(out: Path, step: int, rank: int) -> Path:
    """Where rank ``rank`` writes its checkpoint of ``step``."""
    return out / "checkpoints" / f"step{step:06d}_stage{rank}.pt"


def latest_checkpoint(out: Path, stages: int) -> int | None:
    """The last step every stage has a checkpoint of (a stage that died mid-write leaves the
    step incomplete, and the one before is used)."""
    folder = out / "checkpoints"
    if not folder.is_dir():
        return None
    steps: dict[int, set[int]] = {}
    for f in folder.glob("step*_stage*.pt"):
        try:
            step, rank = f.stem[4:].split("_stage")
            steps.setdefault(int(step), set()).add(int(rank))
        except ValueError:
            continue
    done = [s for s, ranks in steps.items() if ranks >= set(range(stages))]
    return max(done) if done else None


def make_worker(job: PipeJob, rank: int, device: torch.device, on_step: Any = None) -> StageWorker:
    """Rank ``rank``'s stage of the job's model, its optimiser and correction."""
    stage = build_stages(job.cfg, job.stages, job.seed)[rank].to(device)
    opt = StageOptimizer(
        stage,
        job.optimizer,
        lr=job.lr,
        momentum=job.momentum,
        weight_decay=job.weight_decay,
        warmup=job.warmup,
        muon_dtype=job.muon_dtype,
    )
    fix = DelayErrorFeedback(job.correction) if job.correction is not None else None
    return StageWorker(
        stage,
        opt,
        job.schedule,
        job.micro,
        delay=job.delay,
        correction=fix,
        max_drift_bound=job.max_drift,
        on_step=on_step,
    )


class StepHook:
    """After a stage's step: evaluation weights, checkpoint, the injected fault, progress.

    ``steps``: a shared array of ``job.stages + 1`` ints (``run_pipeline``'s): the hook records
    its stage's last step at ``[rank]`` and saves a checkpoint also when the step is the one
    asked for at ``[stages]`` (a stop's common step; 0: none)."""

    def __init__(
        self, job: PipeJob, out: Path, rank: int, queue: Any = None, steps: Any = None
    ) -> None:
        self.job, self.out, self.rank, self.queue, self.steps = job, out, rank, queue, steps

    def __call__(self, w: StageWorker, t: int) -> None:
        """After step ``t`` (0-based) of ``w``: the fault, the eval weights, the checkpoint (keeping
        the newest two) and, from the last stage, the step's mean loss to ``queue``."""
        job, step = self.job, t + 1
        asked = 0
        if self.steps is not None:
            with self.steps.get_lock():
                self.steps[self.rank] = step
                asked = self.steps[job.stages]
        if job.kill_stage == self.rank and step == job.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # the injected fault: this stage dies
        if (job.eval_every and step % job.eval_every == 0) or step == job.steps:
            weights = {k: v.detach().cpu().clone() for k, v in w.stage.state_dict().items()}
            path = eval_path(self.out, step, self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(weights, path)
        every = job.checkpoint_every and step % job.checkpoint_every == 0
        if (every or step == asked) and step < job.steps:
            state = {"worker": w.state_dict(), "step": step, "rank": self.rank, "config": job.extra}
            save_checkpoint(checkpoint_path(self.out, step, self.rank), state)
            for old in sorted((self.out / "checkpoints").glob(f"step*_stage{self.rank}.pt"))[:-2]:
                old.unlink(missing_ok=True)
        if self.queue is not None and w.last:
            ls = [w.losses[j] for j in range(t * job.micro, step * job.micro) if j in w.losses]
            self.queue.put((step, sum(ls) / max(len(ls), 1), time.perf_counter()))


def resume_worker(w: StageWorker, job: PipeJob, out: Path, rank: int) -> None:
    """Load the rank's checkpoint of step ``job.start``."""
    state = load_checkpoint(checkpoint_path(out, job.start, rank))
    w.load_state_dict(state["worker"])


def rank_result(w: StageWorker) -> dict[str, Any]:
    """What a rank writes to ``rank{r}.json``: events, memory, drift histogram, losses, version."""
    return {
        "stage": w.index,
        "events": w.events,
        "memory": w.memory(),
        "drift": {str(k): v for k, v in sorted(w.drift_seen.items())},
        "losses": {str(k): v for k, v in w.losses.items()},
        "version": w.version,
    }


def _torch_schedule(rank: int, job: PipeJob, out_dir: str) -> None:
    """The same job on ``torch.distributed.pipelining``'s schedule (rank's stage, its own
    AdamW, gradients scaled by 1/m as ours are)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = build_stages(job.cfg, job.stages, job.seed)[rank]
    opt = torch.optim.AdamW(stage.parameters(), lr=job.lr, weight_decay=job.weight_decay)
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
    losses: dict[str, float] = {}
    source = BatchSource(job)
    for t, (x, y) in enumerate(source(t) for t in range(job.steps)):
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == job.stages - 1:
            got: list[Tensor] = []
            sched.step(target=y, losses=got)
            for i, v in enumerate(got):
                losses[str(t * job.micro + i)] = float(v.detach())
        else:
            sched.step()
        opt.step()
    torch.save(stage.state_dict(), Path(out_dir) / f"stage{rank}.pt")
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"losses": losses, "events": []}))


def _rank_main(
    rank: int, job: PipeJob, rendezvous: str, out_dir: str, queue: Any, steps: Any = None
) -> None:
    ignore_interrupts()  # the parent stops this process (module docstring)
    import torch.distributed as dist

    torch.set_num_threads(job.threads)
    device = torch.device(f"cuda:{rank}" if job.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        job.comm, init_method=f"file://{rendezvous}", rank=rank, world_size=job.stages
    )
    try:
        if job.schedule in TORCH_SCHEDULES:
            _torch_schedule(rank, job, out_dir)
            return
        out = Path(out_dir)
        hook = StepHook(job, out, rank, queue, steps)
        w = make_worker(job, rank, device, hook)
        if job.start:
            resume_worker(w, job, out, rank)
        data = BatchSource(job) if (w.first or w.last) else None
        m, P = job.micro, job.stages
        ops = run_order(job.schedule, P, m, job.steps - job.start, job.start, job.delay)[rank]
        hidden = (job.batch // m, job.cfg.context, job.cfg.d_model)
        batches = MicroBatches(data, m, keep=P // m + 2, device=device) if data else None

        sends: list[Any] = []
        for kind, j in ops:
            if kind == "F":
                if w.first:
                    assert batches is not None
                    inp = batches(j)[0]
                else:
                    inp = torch.empty(hidden, device=device)
                    dist.recv(inp, src=rank - 1)
                y = w.forward(j, inp)
                if not w.last:
                    sends.append(dist.isend(y.contiguous(), dst=rank + 1))
            else:
                if w.last:
                    assert batches is not None
                    incoming = batches(j)[1]
                else:
                    incoming = torch.empty(hidden, device=device)
                    dist.recv(incoming, src=rank + 1)
                g = w.backward(j, incoming)
                if g is not None:
                    sends.append(dist.isend(g.contiguous(), dst=rank - 1))
            if len(sends) > 8:
                sends = [r for r in sends if not r.is_completed()]
        for r in sends:
            r.wait()
        (out / f"rank{rank}.json").write_text(json.dumps(rank_result(w)))
        torch.save(
            {k: v.detach().cpu() for k, v in w.stage.state_dict().items()},
            out / f"stage{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


class StageFailed(RuntimeError):
    """A stage's process failed or died; the message names the stage."""


def run_pipeline(job: PipeJob, out_dir: Path, progress: Any = None) -> dict[str, Any]:
    """Run ``job`` on ``job.stages`` processes; per-micro-batch losses (last stage), every
    stage's final weights, and each rank's result (timeline, memory, drift).

    ``progress(step, loss)`` is called as the last stage finishes each step. A signal stops
    the stages, after a checkpoint of a common step when they can make one in time (module
    docstring), and raises :class:`fedasync.interrupt.Interrupted`."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx_mp = mp.get_context("spawn")
    queue = ctx_mp.SimpleQueue()
    steps = ctx_mp.Array("i", job.stages + 1)  # each stage's last step; the step asked for
    with tempfile.TemporaryDirectory(prefix="fa-pipe-") as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        with DeferredStop(STOP_GRACE_S) as stop:
            with children_start_deaf():
                ctx = mp.start_processes(
                    _rank_main,
                    args=(job, rendezvous, str(out_dir), queue, steps),
                    nprocs=job.stages,
                    join=False,
                    start_method="spawn",
                )
            try:
                asked: int | None = None
                while True:
                    done = ctx.join(timeout=0.2)
                    while not queue.empty():
                        step, loss, _ = queue.get()
                        if progress is not None:
                            progress(step, loss)
                    if done:
                        break
                    if stop.requested is not None:
                        if asked is None:
                            asked = _ask_checkpoint(job, steps)
                        if not asked or all(
                            checkpoint_path(out_dir, asked, r).exists() for r in range(job.stages)
                        ):
                            stop.check()
                stop.check()  # asked for as the stages finished: the run stops all the same
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                if stop.requested is not None:  # a stage the signal reached (SIGHUP): the stop
                    raise Interrupted(stop.requested) from None
                if isinstance(e, mp.ProcessRaisedException):
                    raise StageFailed(
                        f"pipeline stage {e.error_index} failed: "
                        f"{str(e).strip().splitlines()[-1][:300]}"
                    ) from e
                how = (
                    f"was killed by signal {signal.Signals(-e.exit_code).name}"
                    if e.exit_code is not None and e.exit_code < 0
                    else f"exited with code {e.exit_code}"
                )
                raise StageFailed(f"pipeline stage {e.error_index} died: its process {how}") from e
            finally:
                with shielded():  # bounded (5 s, then SIGKILL); a second Ctrl-C must not cut it
                    _stop_stages(ctx.processes)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(job.stages)]
    losses = ranks[-1]["losses"]
    weights = [torch.load(out_dir / f"stage{r}.pt", weights_only=True) for r in range(job.stages)]
    ordered = [losses[k] for k in sorted(losses, key=int)]
    per_batch = [
        sum(ordered[i : i + job.micro]) / job.micro for i in range(0, len(ordered), job.micro)
    ]
    return {"losses": per_batch, "weights": weights, "ranks": ranks, "job": asdict(job)}


def _ask_checkpoint(job: PipeJob, steps: Any) -> int:
    """Ask every stage for a checkpoint of the step after the furthest any has made; that step,
    or 0 when none can be asked for (no step made yet, or that step is the run's last)."""
    with steps.get_lock():
        furthest = max(steps[: job.stages])
        if furthest == 0 or furthest + 1 >= job.steps:
            return 0
        steps[job.stages] = furthest + 1
        return furthest + 1


def _stop_stages(processes: list[Any]) -> None:
    """Stop the stage processes still running (SIGTERM, then SIGKILL what outlives 5 s)."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in processes:
        p.join(max(deadline - time.monotonic(), 0.0))
        if p.is_alive():
            p.kill()
            p.join(5)
