"""Delay robustness of asynchronous pipeline schedules: AdamW against Muon, PipeDream-2BW's
one-step delay with and without delay error feedback, PACI, and Muon's momentum (issue 12
§5, the delay-robustness study).

The claims tested (arXiv 2606.30634): at the same number of tokens, the validation-loss gap
between asynchronous training with a constant one-step delay (2BW: W(t+1) = W(t) − ν
∇f(W(t−1))) and synchronous training is tiny for Muon (0.012 in the paper) and large for
AdamW (> 0.2); a higher momentum is more robust to the delay; error feedback recovers 50-90%
of the remaining gap.

Set-up: P = 2 stages, m = 4 micro-batches, the six-play Shakespeare corpus, character
vocabulary, on the single-process emulator (:func:`trainers.pipeline.emulate.emulate`, which
computes what a real pipeline computes; a test checks it against one process per stage).
Every run builds its stages' workers with :func:`trainers.pipeline.dist.make_worker` and runs
the whole run's operation order in one :func:`emulate` call; a per-stage ``on_step`` hook
copies the stage's weights every ``--eval-every`` steps, and the validation loss (nats per
character, fixed held-out windows) is computed from those copies afterwards. Batch t of seed
s is :class:`trainers.pipeline.dist.BatchSource`'s batch t with data_seed = 1000 + s (its
own seeded generator per batch), so every arm of a seed sees the same batches from the same
initial weights. (The first version of this benchmark drew batches from one generator, so
its numbers are not comparable run for run with these.)

Arms per optimiser, learning rate and seed (``--arms`` picks a subset; ``1f1b`` is always
run, every gap is to it):

- ``1f1b``: synchronous 1F1B with a flush every batch.
- ``2bw``: PipeDream-2BW, every batch computed under the weights one step old.
- ``2bw+ef``: 2BW with delay error feedback (:class:`fedasync.corrections.
  DelayErrorFeedback`, β = ``--beta``, default 1): each stage's step applies
  g_t + β·(g_t − g_{t−1}) instead of g_t, where g_t = ∇f(W(t−1)) is the stale gradient. The
  error step t−1 made is g_t − g_{t−1} (the gradient then due, now known, minus the one
  applied), fed back one step late; with β = 1 it is a linear extrapolation of the gradient
  one step ahead, with two batches' noise in the difference.
- ``paci``: PACI without weight stashing, P = 2, m = 4: stage 0 runs one forward ahead, so
  the first micro-batch of each batch crosses one optimiser step between its forward and
  its backward (drift ≤ 1, checked at every backward; the table reports the largest seen).

Momentum sweep (``--momenta``, default 0.9 0.95 0.98; none to skip): Muon at the first lr,
``1f1b`` and ``2bw`` at each momentum. The momentum is Muon's (the blocks' weight matrices);
AdamW's β1 stays at 0.9 everywhere: in the AdamW runs and for the embeddings, the head and
the vectors of the Muon runs. The main table uses Muon's momentum 0.95 (runs the sweep
shares are run once).

Output: validation loss after the last step, mean ± half-range over seeds; gaps to sync per
seed; "EF recovers" = (gap_2bw − gap_2bw+ef) / gap_2bw per seed, mean ± half-range ("within
spread" when the half-range exceeds the mean); then the momentum table. The last lines are
``pipeline_delay_ef_recovery_{adamw,muon}=`` (the fraction at the first lr) and
``pipeline_delay_gap_adamw_over_muon=`` (2BW's mean gap, AdamW over Muon, at the first lr).

Run time: the first version ran 24 runs of 300 steps (d = 64, 4 blocks) in 455 s on two
one-thread processes, about 38 process-seconds a run. The default here is 60 runs (4 arms
x 2 optimisers x 2 lrs x 3 seeds, plus 12 for the momenta 0.9 and 0.98), so about
60 x 38 / 2 ≈ 1140 s, some 19 minutes on 2 processes (an estimate, not measured; the
workers also record their timelines and memory, which costs a little more).

    .venv/bin/python benchmarks/pipeline_delay.py            # the full study (~19 min)
    .venv/bin/python benchmarks/pipeline_delay.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ARMS = ("1f1b", "2bw", "2bw+ef", "paci")
SCHEDULE = {"1f1b": "1f1b", "2bw": "2bw", "2bw+ef": "2bw", "paci": "paci"}
OPTIMIZERS = ("adamw", "muon")
MOMENTUM = 0.95
"""Muon's momentum in the main table (StageOptimizer's default)."""

Key = tuple[str, str, float, int, float]
"""(arm, optimiser, lr, seed, Muon's momentum)."""


@functools.lru_cache(maxsize=1)
def _corpus() -> Any:
    from trainers.pipeline.corpus import load_corpus

    return load_corpus()


class Capture:
    """A stage's ``on_step`` hook: a copy of its weights every ``every`` steps and at the end."""

    def __init__(self, every: int, steps: int) -> None:
        self.every, self.steps = every, steps
        self.weights: dict[int, dict[str, Any]] = {}

    def __call__(self, w: Any, t: int) -> None:
        step = t + 1
        if step % self.every == 0 or step == self.steps:
            self.weights[step] = {k: v.detach().clone() for k, v in w.stage.state_dict().items()}


def run_one(job: tuple[Key, argparse.Namespace]) -> tuple[Key, float, list[float], int]:
    """One run: its key, the final validation loss, the curve and the largest drift seen."""
    import torch

    torch.set_num_threads(1)
    from trainers.pipeline.corpus import batch
    from trainers.pipeline.dist import BatchSource, PipeJob, make_worker
    from trainers.pipeline.emulate import emulate, evaluate
    from trainers.pipeline.model import GPTConfig, build_stages

    key, a = job
    arm, opt, lr, seed, momentum = key
    data = _corpus()
    cfg = GPTConfig(
        data.vocab.size, d_model=a.d_model, n_layers=a.layers, n_heads=4, context=a.context
    )
    pj = PipeJob(
        cfg,
        stages=2,
        schedule=SCHEDULE[arm],
        micro=a.micro,
        steps=a.steps,
        batch=a.batch,
        lr=lr,
        seed=seed,
        data_seed=1000 + seed,
        delay=1,
        optimizer=opt,
        momentum=momentum,
        correction=a.beta if arm == "2bw+ef" else None,
        data="corpus",
        eval_every=a.eval_every,
    )
    hooks = [Capture(a.eval_every, a.steps) for _ in range(pj.stages)]
    device = torch.device("cpu")
    workers = [make_worker(pj, r, device, hooks[r]) for r in range(pj.stages)]
    emulate(workers, BatchSource(pj), a.steps)
    gv = torch.Generator().manual_seed(99)
    val = [batch(data.val, a.context, a.batch, gv) for _ in range(a.val_batches)]
    stages = build_stages(cfg, pj.stages, seed)
    curve = []
    for step in sorted(hooks[0].weights):
        for s, h in zip(stages, hooks):
            s.load_state_dict(h.weights[step])
        curve.append(evaluate(stages, val))
    drift = max(max(w.drift_seen, default=0) for w in workers)
    return key, curve[-1], curve, drift


def ms(xs: list[float], scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    """Mean ± half-range of ``xs`` (times ``scale``), or a dash when there is none."""
    if not xs:
        return "—"
    m, h = statistics.fmean(xs) * scale, (max(xs) - min(xs)) / 2 * scale
    return f"{m:.{digits}f}{unit} ± {h:.{digits}f}{unit}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        default=list(ARMS),
        help="arms of the main table (1f1b is always run: every gap is to it)",
    )
    ap.add_argument("--beta", type=float, default=1.0, help="2bw+ef's error-feedback β")
    ap.add_argument(
        "--momenta",
        type=float,
        nargs="*",
        default=[0.9, 0.95, 0.98],
        help="Muon momenta for the sweep at the first lr (none: no sweep)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 20 steps, 1 seed, the first lr, d = 32, 2 blocks, context 32",
    )
    a = ap.parse_args()
    if a.quick:
        a.steps, a.eval_every, a.seeds, a.lrs = 20, 10, a.seeds[:1], a.lrs[:1]
        a.d_model, a.layers, a.context, a.val_batches = 32, 2, 32, 2
    arms = ["1f1b"] + [x for x in ARMS if x in a.arms and x != "1f1b"]
    lr0 = a.lrs[0]
    t0 = time.perf_counter()
    keys: list[Key] = [
        (arm, o, lr, seed, MOMENTUM)
        for o in OPTIMIZERS
        for lr in a.lrs
        for seed in a.seeds
        for arm in arms
    ]
    keys += [
        (arm, "muon", lr0, seed, mom)
        for mom in a.momenta
        for seed in a.seeds
        for arm in ("1f1b", "2bw")
    ]
    keys = list(dict.fromkeys(keys))  # the sweep's runs at MOMENTUM are the main table's
    from tqdm import tqdm

    from fedasync.progress import progress

    res: dict[Key, float] = {}
    drift: dict[Key, int] = {}
    with ProcessPoolExecutor(a.procs) as pool, progress(len(keys), "runs", tty_bar=tqdm) as bar:
        for key, final, _, d in pool.map(run_one, [(k, a) for k in keys]):
            res[key], drift[key] = final, d
            bar.update(1)

    def losses(arm: str, o: str, lr: float, mom: float = MOMENTUM) -> list[float]:
        return [res[(arm, o, lr, s, mom)] for s in a.seeds if (arm, o, lr, s, mom) in res]

    def gaps(arm: str, o: str, lr: float, mom: float = MOMENTUM) -> list[float]:
        sync = losses("1f1b", o, lr, mom)
        other = losses(arm, o, lr, mom)
        return [x - y for x, y in zip(other, sync)] if len(other) == len(sync) else []

    def recovery(o: str, lr: float) -> list[float]:
        g2, gef = gaps("2bw", o, lr), gaps("2bw+ef", o, lr)
        return [(x - y) / x for x, y in zip(g2, gef) if x != 0]

    paci_drift = max((d for k, d in drift.items() if k[0] == "paci"), default=None)
    print(
        f"\n## Delay against sync (1F1B), P = 2, m = {a.micro}, {a.steps} steps of "
        f"{a.batch} x {a.context} characters, d = {a.d_model}, {a.layers} blocks; validation "
        f"loss (nats/char) after the last step, {len(a.seeds)} seed(s), mean ± half-range; "
        f"Muon momentum {MOMENTUM}, AdamW β1 0.9; 2BW+EF β = {a.beta:g}"
        + (f"; PACI's largest drift seen: {paci_drift} step(s)" if paci_drift is not None else "")
    )
    print(
        "| optimiser | lr | sync | 2BW | gap (2BW − sync) | 2BW+EF | gap (2BW+EF − sync) "
        "| PACI | gap (PACI − sync) | EF recovers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for o in OPTIMIZERS:
        for lr in a.lrs:
            rec = recovery(o, lr)
            note = ""
            if rec and (max(rec) - min(rec)) / 2 > abs(statistics.fmean(rec)):
                note = " (within spread)"
            cells = [ms(losses("1f1b", o, lr))]
            for arm in ("2bw", "2bw+ef", "paci"):
                cells += [ms(losses(arm, o, lr)), ms(gaps(arm, o, lr))]
            cells.append(ms(rec, 100, 0, "%") + note)
            print(f"| {o} | {lr:g} | " + " | ".join(cells) + " |")
    if a.momenta:
        print(
            f"\n## Muon's momentum, lr {lr0:g} (AdamW's β1 stays 0.9 for the embeddings, the "
            f"head and the vectors), {len(a.seeds)} seed(s), mean ± half-range"
        )
        print("| momentum | sync | 2BW | gap (2BW − sync) |")
        print("|---|---|---|---|")
        for mom in a.momenta:
            print(
                f"| {mom:g} | {ms(losses('1f1b', 'muon', lr0, mom))} | "
                f"{ms(losses('2bw', 'muon', lr0, mom))} | {ms(gaps('2bw', 'muon', lr0, mom))} |"
            )
    print(f"\nwall time {time.perf_counter() - t0:.0f} s ({len(keys)} runs)")
    for o in OPTIMIZERS:
        rec = recovery(o, lr0)
        print(f"pipeline_delay_ef_recovery_{o}={statistics.fmean(rec) if rec else math.nan:.3f}")
    ga, gm = gaps("2bw", "adamw", lr0), gaps("2bw", "muon", lr0)
    ratio = (
        statistics.fmean(ga) / statistics.fmean(gm)
        if ga and gm and statistics.fmean(gm)
        else math.nan
    )
    print(f"pipeline_delay_gap_adamw_over_muon={ratio:.3f}")


if __name__ == "__main__":
    main()
