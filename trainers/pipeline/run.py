"""One pipeline-parallel training run from a :class:`PipelineConfig`: the pipeline (one
process per stage, or the one-process emulator), evaluation, measurements, the run folder.

The run folder (``<run.out_dir>/<run.name>``) holds ``metrics.jsonl`` (a ``step`` event per
optimiser step with the batch's training loss and the seconds since the run started, an
``eval`` event with the held-out loss every ``run.eval_every`` steps, ``resume``, and at the
end ``measured``: the measured and simulated bubble, tokens per second, the largest drift),
``summary.json`` (final held-out loss, tokens per second, measured bubble and memory per
stage, the drift seen, the simulator's prediction from the measured stage costs),
``events.json`` (every operation's start and end, per stage), ``checkpoints/``, ``evals/``
(each stage's weights at each evaluation: the ranks write them as they go, the parent
evaluates the whole model from them after the run) and, with ``plots`` in ``run.trackers``,
``timeline.png`` and ``loss.png``.

Resuming (``run.resume=true``) continues from the last step every stage has a checkpoint
of, with the same config (``run.steps``, ``run.resume``, ``run.progress``, ``run.trackers``,
``run.checkpoint_every`` and ``faults.*`` may differ). GPipe, 1F1B and 2BW resume to the
same weights as an uninterrupted run (a test); PACI's drift pattern depends on the pipeline
being full, and a resumed run refills it, so its first batch after the resume crosses no
version.

A signal (Ctrl-C, SIGTERM, SIGHUP) at any moment stops the run with
:class:`fedasync.interrupt.Interrupted` once every stage process is gone
(:func:`trainers.pipeline.dist.run_pipeline` first has the stages checkpoint one common step);
the exception says where it stopped and the last step every stage has a checkpoint of (None:
none yet, the run starts afresh).

One file (under 500 lines) because it writes the whole run folder described above, from
set-up and resume through the measured summary to the plots, and says where a stop found it; the pipeline itself, the
emulator and the simulator are apart (``dist``, ``emulate``, ``simulate``).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fedasync import seeds
from fedasync.checkpoint import load_checkpoint
from fedasync.errors import CheckpointError, ConfigError
from fedasync.events import EventLog, read_events
from fedasync.interrupt import Interrupted
from runkit.folder import RunFolder, check_compatible
from runkit.keys import SINK_KEYS
from runkit.sinks import following
from trainers.pipeline.config import PipelineConfig, to_container
from trainers.pipeline.dist import (
    BatchSource,
    PipeJob,
    StepHook,
    checkpoint_path,
    eval_path,
    latest_checkpoint,
    make_worker,
    rank_result,
    resume_worker,
    run_pipeline,
)
from trainers.pipeline.model import GPTConfig, build_stages
from trainers.pipeline.optim import resolve_muon_dtype

log = logging.getLogger("fedasync.pipeline")

OWNED = ("evals", "checkpoints", "events.json", "rank*.json", "stage*.pt")
"""What a fresh run clears from its folder besides metrics.jsonl and summary.json."""

MAY_DIFFER_ON_RESUME = (  # the checkpoint's config against the run's (runkit.folder)
    "run.steps",
    "run.resume",
    "run.progress",
    "run.plots",
    *(f"run.{k}" for k in SINK_KEYS),
    "run.checkpoint_every",
    "faults.kill_stage",
    "faults.kill_at_step",
)


def resolve_device(cfg: PipelineConfig) -> tuple[str, str]:
    """(device, comm) for the run: CUDA with NCCL when every stage process can have a GPU
    (the emulator needs one), the CPU with gloo otherwise."""
    want, P = cfg.run.device, cfg.pipeline.stages
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = 1 if cfg.pipeline.backend == "emulate" else P
    if want == "cuda" and gpus < need:
        raise ConfigError(
            f"run.device=cuda needs {need} GPU(s) for pipeline.backend="
            f"{cfg.pipeline.backend} with {P} stages; this machine has {gpus}"
        )
    device = "cuda" if want == "cuda" or (want == "auto" and gpus >= need) else "cpu"
    if want == "auto" and 0 < gpus < need:
        log.warning("%d GPU(s) for %d stage processes: the pipeline runs on the CPU", gpus, P)
    comm = cfg.pipeline.comm
    if comm == "auto":
        comm = "nccl" if device == "cuda" else "gloo"
    return device, comm


def job_of(cfg: PipelineConfig, vocab_size: int, start: int = 0) -> PipeJob:
    """The :class:`PipeJob` every stage runs for ``cfg``."""
    device, comm = resolve_device(cfg)
    p, o = cfg.pipeline, cfg.optim
    return PipeJob(
        cfg=GPTConfig(
            vocab_size,
            d_model=cfg.model.d_model,
            n_layers=cfg.model.n_layers,
            n_heads=cfg.model.n_heads,
            context=cfg.model.context,
        ),
        stages=p.stages,
        schedule=p.schedule,
        micro=p.micro,
        steps=cfg.run.steps,
        batch=cfg.data.batch,
        lr=o.lr,
        seed=cfg.run.seed,
        data_seed=cfg.data.seed,
        delay=p.delay,
        optimizer=o.name,
        momentum=o.momentum,
        weight_decay=o.weight_decay,
        warmup=o.warmup,
        muon_dtype=o.muon_dtype,
        correction=cfg.correction.beta if cfg.correction.error_feedback else None,
        max_drift=p.max_drift if p.schedule == "paci" else None,
        data="corpus",
        val_fraction=cfg.data.val_fraction,
        start=start,
        eval_every=cfg.run.eval_every,
        checkpoint_every=cfg.run.checkpoint_every,
        kill_stage=cfg.faults.kill_stage,
        kill_at_step=cfg.faults.kill_at_step,
        threads=cfg.run.threads,
        device=device,
        comm=comm,
        extra=to_container(cfg),
    )


def _resume_step(cfg: PipelineConfig, run_dir: Path) -> int:
    step = latest_checkpoint(run_dir, cfg.pipeline.stages)
    if step is None:
        raise CheckpointError(
            f"run.resume=true but {str(run_dir)[:200]}/checkpoints holds no step that every one "
            f"of the {cfg.pipeline.stages} stages saved (run.checkpoint_every="
            f"{cfg.run.checkpoint_every}); start without run.resume"
        )
    saved = load_checkpoint(checkpoint_path(run_dir, step, 0)).get("config") or {}
    check_compatible(
        saved,
        to_container(cfg),
        MAY_DIFFER_ON_RESUME,
        what=f"the checkpoint in {str(run_dir)[:200]}",
    )
    if step >= cfg.run.steps:
        raise CheckpointError(
            f"the checkpoint is at step {step}, not before run.steps={cfg.run.steps}"
        )
    return step


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    # a line torn by a crash stays in the middle once the resumed run appends: skipped
    return read_events(path, skip_bad=True) if path.exists() else []


class _Where:
    """How far a run got, for the line a signal's stop prints."""

    def __init__(self) -> None:
        self.phase = "start-up"
        """start-up, training or finishing."""
        self.ours = False
        """The run folder's checkpoints are this run's (it resumes, or cleared the folder)."""
        self.step: int | None = None
        """The last step the last stage finished (None: none yet)."""
        self.steps = 0

    def describe(self) -> str:
        if self.phase == "finishing":
            return f"after training ({self.steps} steps), while it evaluated and wrote its outputs"
        if self.phase == "training" and self.step is not None:
            return f"at step {self.step}"
        if self.phase == "training":
            return "as the stages started (no step yet)"
        return "during start-up"


class _Progress:
    """The progress bar, and the ``step`` lines of metrics.jsonl written as the last stage
    reports each step (so a run that dies keeps the steps it made)."""

    def __init__(self, cfg: PipelineConfig, start: int, events: EventLog, where: _Where) -> None:
        self.where = where
        self.events = events
        self.t0 = time.perf_counter()
        self.bar: Any = None
        if cfg.run.progress:
            from tqdm import tqdm

            from fedasync.progress import progress

            self.bar = progress(
                cfg.run.steps,
                f"pipeline {cfg.pipeline.schedule}",
                tty_bar=tqdm,
                initial=start,
                unit="step",
                leave=False,
            )

    def __call__(self, step: int, loss: float) -> None:
        self.events.write(
            "step", step=step, loss=loss, time_s=round(time.perf_counter() - self.t0, 4)
        )
        self.where.step = step
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.n = step  # after the postfix, so a line shows this step's loss
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _QueueToProgress:
    def __init__(self, progress: _Progress) -> None:
        self.progress = progress

    def put(self, item: tuple[int, float, float]) -> None:
        self.progress(item[0], item[1])


def _emulate(job: PipeJob, run_dir: Path, progress: _Progress, corpus: Any) -> list[dict[str, Any]]:
    from trainers.pipeline.emulate import emulate

    torch.set_num_threads(job.threads)
    device = torch.device("cuda:0" if job.device == "cuda" else "cpu")
    workers = []
    for r in range(job.stages):
        hook = StepHook(job, run_dir, r, _QueueToProgress(progress))
        w = make_worker(job, r, device, hook)
        if job.start:
            resume_worker(w, job, run_dir, r)
        workers.append(w)
    source = BatchSource(job, corpus)

    def get_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = source(t)
        return x.to(device), y.to(device)

    emulate(workers, get_batch, job.steps - job.start, start=job.start)
    return [rank_result(w) for w in workers]


def evaluate_saved(job: PipeJob, run_dir: Path, steps: list[int], corpus: Any) -> dict[int, float]:
    """Held-out loss of the whole model at each of ``steps`` from the stages' saved weights."""
    from trainers.pipeline.corpus import batch
    from trainers.pipeline.emulate import evaluate

    g = torch.Generator().manual_seed(seeds.EVAL_SEED)
    n = job.extra.get("run", {}).get("eval_batches", 8)
    val = [batch(corpus.val, job.cfg.context, job.batch, g) for _ in range(n)]
    stages = build_stages(job.cfg, job.stages, job.seed)
    out = {}
    for step in steps:
        for r, s in enumerate(stages):
            s.load_state_dict(torch.load(eval_path(run_dir, step, r), weights_only=True))
        out[step] = evaluate(stages, val)
    return out


def measure(job: PipeJob, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's measured bubble and step time, and what the simulator predicts for the same
    run from its measured per-stage costs."""
    from trainers.pipeline.simulate import Timeline, from_measurements, simulate

    events = [e for r in ranks for e in r["events"]]
    batches = job.steps - job.start
    sched = "1f1b" if job.schedule == "2bw" and job.delay == 0 else job.schedule
    if not events or batches < 1:
        return {}
    measured = Timeline.from_events(sched, job.stages, job.micro, batches, events)
    costs = from_measurements(events, comm=None, stages=job.stages)
    predicted = simulate(sched, job.stages, job.micro, batches, costs)
    return {
        "bubble_fraction": measured.bubble_fraction,
        "idle_fractions": measured.idle_fractions,
        "step_time_s": measured.step_time,
        "steady_step_time_s": measured.steady_step_time,
        "stage_costs_s": {
            "forward": costs.forward,
            "backward": costs.backward,
            "step": costs.step,
            "comm": costs.comm,
        },
        "simulated": {
            "bubble_fraction": predicted.bubble_fraction,
            "step_time_s": predicted.step_time,
            "steady_step_time_s": predicted.steady_step_time,
        },
    }


def run_config(cfg: PipelineConfig) -> dict[str, Any]:
    """Run ``cfg``; its summary (also ``summary.json`` in the run folder), the metrics sinks
    following its event log (runkit.sinks). A signal ends it with
    :class:`fedasync.interrupt.Interrupted` (module docstring)."""
    where = _Where()
    try:
        with following(cfg.run, "pipeline", config=to_container(cfg)):
            return _run_config(cfg, where)
    except Interrupted as e:
        run_dir = Path(cfg.run.out_dir) / cfg.run.name
        e.run_dir, e.where = run_dir, where.describe()
        step = latest_checkpoint(run_dir, cfg.pipeline.stages) if where.ours else None
        if step is not None:
            e.checkpoint = f"of step {step} in {run_dir / 'checkpoints'}"
        raise


def _run_config(cfg: PipelineConfig, where: _Where) -> dict[str, Any]:
    from trainers.pipeline.corpus import load_corpus

    folder = RunFolder(cfg.run.out_dir, cfg.run.name, owned=OWNED, may_differ=MAY_DIFFER_ON_RESUME)
    run_dir = folder.path
    run_dir.mkdir(parents=True, exist_ok=True)
    where.ours, where.steps = cfg.run.resume, cfg.run.steps
    start = _resume_step(cfg, run_dir) if cfg.run.resume else 0
    corpus = load_corpus(val_fraction=cfg.data.val_fraction)
    job = job_of(cfg, corpus.vocab.size, start)
    # the event log appears as the stages are about to start (a watcher takes it for that)
    if start:  # the steps after the checkpoint are made again: their events go
        folder.open_events(to_container(cfg))
        folder.keep_events(lambda e: int(e.get("step") or 0) <= start)
        assert folder.events is not None
        folder.events.write("resume", step=start)
        log.info("resuming %s at step %d", run_dir, start)
    else:
        folder.start(to_container(cfg))
        where.ours = True
    try:
        return _train_and_measure(cfg, folder, job, corpus, start, where)
    finally:
        folder.close()


def _train_and_measure(
    cfg: PipelineConfig, folder: RunFolder, job: PipeJob, corpus: Any, start: int, where: _Where
) -> dict[str, Any]:
    run_dir, elog = folder.path, folder.events
    assert elog is not None
    progress = _Progress(cfg, start, elog, where)
    t0 = time.perf_counter()
    where.phase = "training"
    try:
        if cfg.pipeline.backend == "emulate":
            ranks = _emulate(job, run_dir, progress, corpus)
        else:
            ranks = run_pipeline(job, run_dir, progress=progress)["ranks"]
    finally:
        progress.close()
    where.phase = "finishing"
    wall = time.perf_counter() - t0
    events = [e for r in ranks for e in r["events"]]
    origin = min((e["start"] for e in events), default=0.0)
    for e in events:
        e["start"] -= origin
        e["end"] -= origin
    (run_dir / "events.json").write_text(json.dumps(events))
    losses = {int(k): v for k, v in ranks[-1]["losses"].items()}
    m = job.micro
    # evaluations recorded before a resume, and those of this run's saved weights
    vals = {
        e["step"]: e["val_loss"]
        for e in _read_metrics(folder.events_path)
        if e.get("event") == "eval"
    }
    eval_steps = sorted(
        step
        for p in (run_dir / "evals").glob("step*_stage0.pt")
        if (step := int(p.stem[4:10])) not in vals
        and all(eval_path(run_dir, step, r).exists() for r in range(job.stages))
    )
    new = evaluate_saved(job, run_dir, eval_steps, corpus)
    for step in eval_steps:
        elog.write("eval", step=step, val_loss=new[step])
    vals.update(new)
    tokens = (cfg.run.steps - start) * cfg.data.batch * cfg.model.context
    measured = measure(job, ranks)
    drift: dict[str, int] = {}
    for r in ranks:
        for k, v in r["drift"].items():
            drift[k] = drift.get(k, 0) + v
    summary: dict[str, Any] = {
        "schedule": cfg.pipeline.schedule,
        "backend": cfg.pipeline.backend,
        "optimizer": cfg.optim.name,
        "muon_dtype": str(resolve_muon_dtype(cfg.optim.muon_dtype, job.device)).removeprefix(
            "torch."
        )
        if cfg.optim.name == "muon"
        else None,
        "stages": job.stages,
        "micro": job.micro,
        "device": job.device,
        "steps": cfg.run.steps,
        "start": start,
        "final_val_loss": vals[max(vals)] if vals else None,
        "val_loss": {str(k): v for k, v in vals.items()},
        "final_train_loss": statistics.fmean(
            losses[j] for j in range((cfg.run.steps - 1) * m, cfg.run.steps * m) if j in losses
        )
        if losses
        else None,
        "wall_s": wall,
        "tokens": tokens,
        # over the pipeline's own span (process start-up and evaluation excluded)
        "tokens_per_s": tokens / max(max((e["end"] for e in events), default=wall), 1e-9),
        "memory": [r["memory"] for r in ranks],
        "drift": dict(sorted(drift.items(), key=lambda kv: int(kv[0]))),
        "max_drift_seen": max((int(k) for k in drift), default=0),
        "measured": measured,
        "correction": job.correction,
        "run_dir": str(run_dir),
    }
    elog.write(  # the run's measured figures as an event too: the metrics sinks follow the log
        "measured",
        step=cfg.run.steps,
        bubble_fraction=measured.get("bubble_fraction"),
        simulated_bubble_fraction=measured.get("simulated", {}).get("bubble_fraction"),
        tokens_per_s=summary["tokens_per_s"],
        max_drift_seen=summary["max_drift_seen"],
    )
    folder.write_summary(summary)
    if cfg.run.plots:
        summary["plots"] = [str(p) for p in plot_run(run_dir, job, events, losses, vals, start)]
    return summary


def plot_run(
    run_dir: Path,
    job: PipeJob,
    events: list[dict[str, Any]],
    losses: dict[int, float],
    vals: dict[int, float],
    start: int,
) -> list[Path]:
    """timeline.png (a window of four batches after the first, from the run's own clock)
    and loss.png."""
    from trainers.pipeline.plots import plot_loss, plot_timeline

    m = job.micro
    lo = start + 1 if job.steps - start > 5 else start
    window = [e for e in events if lo <= e["micro"] // m < lo + 4]
    out = [
        plot_timeline(
            window,
            run_dir / "timeline.png",
            f"{job.schedule}, P={job.stages}, m={m}: batches {lo}-{lo + 3} ({job.device})",
        )
    ]
    steps = sorted({j // m for j in losses})
    train = [
        (t + 1, statistics.fmean(losses[j] for j in range(t * m, (t + 1) * m) if j in losses))
        for t in steps
    ]
    curves = {"train (batch)": train, "held-out": sorted(vals.items())}
    out.append(plot_loss(curves, run_dir / "loss.png", "step", f"{job.schedule} loss"))
    return out
