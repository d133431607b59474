"""Delay robustness of PipeDream-2BW's one-step delay: AdamW against Muon (issue 12 §5, first
part; the error-feedback correction is not built yet).

The claim tested (arXiv 2606.30634): at the same number of tokens, the validation-loss gap
between asynchronous training with a constant one-step delay (2BW: W(t+1) = W(t) − ν
∇f(W(t−1))) and synchronous training is tiny for Muon (0.012 in the paper) and large for
AdamW (> 0.2). Runs on the single-process emulator (:mod:`trainers.pipeline.emulate`), which
computes what a real 2-stage pipeline computes (a test checks it against two processes):
P = 2 stages, m = 4 micro-batches, the six-play Shakespeare corpus, character vocabulary.
Per optimiser, learning rate and seed: ``1f1b`` (sync) and ``2bw`` (one-step delay) from the
same initial weights on the same batches; the validation loss (nats per character, fixed
held-out windows) at the end; gap = 2bw − sync, mean ± half-range over seeds. Runs go on a
pool of processes of one thread each.

    .venv/bin/python benchmarks/pipeline_delay.py            # 3 seeds, 2 lrs (~6 min)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_one(
    job: tuple[str, str, float, int, argparse.Namespace],
) -> tuple[str, str, float, int, float, list[float]]:
    import torch

    torch.set_num_threads(1)
    from trainers.pipeline.corpus import batch, load_corpus
    from trainers.pipeline.emulate import Emulator, evaluate
    from trainers.pipeline.model import GPTConfig, build_stages
    from trainers.pipeline.optim import StageOptimizer

    schedule, opt, lr, seed, a = job
    data = load_corpus()
    cfg = GPTConfig(
        data.vocab.size, d_model=a.d_model, n_layers=a.layers, n_heads=4, context=a.context
    )
    stages = build_stages(cfg, 2, seed)
    emu = Emulator(stages, lambda s: StageOptimizer(s, opt, lr=lr), schedule, a.micro, delay=1)
    g = torch.Generator().manual_seed(1000 + seed)
    gv = torch.Generator().manual_seed(99)
    val = [batch(data.val, a.context, a.batch, gv) for _ in range(a.val_batches)]
    curve = []
    for step in range(a.steps):
        emu.step(*batch(data.train, a.context, a.batch, g))
        if (step + 1) % a.eval_every == 0:
            curve.append(evaluate(stages, val))
    return schedule, opt, lr, seed, curve[-1], curve


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
    a = ap.parse_args()
    t0 = time.perf_counter()
    jobs = [
        (s, o, lr, seed, a)
        for o in ("adamw", "muon")
        for lr in a.lrs
        for seed in a.seeds
        for s in ("1f1b", "2bw")
    ]
    from tqdm import tqdm

    res = {}
    with ProcessPoolExecutor(a.procs) as pool:
        for r in tqdm(pool.map(run_one, jobs), total=len(jobs), desc="runs"):
            res[r[:4]] = r[4]
    print(
        f"\n## One-step delay (2BW) against sync (1F1B), P = 2, m = {a.micro}, {a.steps} steps of "
        f"{a.batch} x {a.context} characters, d = {a.d_model}, {a.layers} blocks; validation "
        f"loss (nats/char), {len(a.seeds)} seeds, mean ± half-range"
    )
    print("| optimiser | lr | sync | 2BW | gap (2BW − sync) |")
    print("|---|---|---|---|---|")
    gaps = {}
    for o in ("adamw", "muon"):
        for lr in a.lrs:
            sync = [res[("1f1b", o, lr, s)] for s in a.seeds]
            asyn = [res[("2bw", o, lr, s)] for s in a.seeds]
            gap = [x - y for x, y in zip(asyn, sync)]
            gaps[(o, lr)] = statistics.fmean(gap)

            def ms(xs: list[float]) -> str:
                return f"{statistics.fmean(xs):.3f} ± {(max(xs) - min(xs)) / 2:.3f}"

            print(f"| {o} | {lr:g} | {ms(sync)} | {ms(asyn)} | {ms(gap)} |")
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    ratio = (
        gaps[("adamw", a.lrs[0])] / gaps[("muon", a.lrs[0])]
        if gaps[("muon", a.lrs[0])]
        else float("nan")
    )
    print(f"pipeline_delay_gap_adamw_over_muon={ratio:.3f}")


if __name__ == "__main__":
    main()
