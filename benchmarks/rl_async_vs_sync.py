"""Throughput of asynchronous RL: sync, one-step-off, async(S) and streaming(S) to one target.

Issue 10 §5. Every mode trains the same policy on the same task (``sort``, long-tailed list
lengths), with the same B (groups per learner step), G (samples per group), learning rate and
correction (``decoupled``), on 64 virtual rollout workers, for the same number of learner
steps. What differs is only who generates what under which version (docs/rl.md, "Modes").

1. The per-token costs are measured once on this machine, median of a few repeats: generation
   per generated token (a worker's group of G samples, the warm-started policy), learning per
   batch token (one learner step on a batch of B groups). Every run of every mode and seed
   gets the same two numbers (``clock.gen_token_s``, ``clock.learn_token_s``), so the
   virtual clock, not the machine's load, decides every time below.
2. Per seed, each mode runs ``--steps`` learner steps (no early stop) with a held-out
   evaluation every ``--eval-every`` steps. Time-to-target is the virtual time of the first
   evaluation at or above the target (the engine's ``run.target_accuracy`` rule; a run is
   the same up to that point whether or not it stops there, so one run gives both the
   time-to-target and the final accuracy at equal steps). Speedup = sync's time-to-target /
   the mode's, per seed, then mean over seeds. Also: virtual seconds per version, final
   accuracy at equal steps and whether it is within 1 point of sync's (mean over seeds).
   The target is ``--target`` if given, else per seed its warm-started held-out accuracy +
   ``--gain`` (3 points): every mode of a seed starts from the same warm start, and RL moves
   held-out accuracy by only a few points here, so one absolute number is either below a
   seed's start or beyond another's reach in the budget (seen: starts 0.60-0.66).
3. Speedup against the number of workers (4 .. 128), one seed, ``--sweep-steps`` steps, as
   the ratio of virtual seconds per version (sync / mode): ``speedup_vs_workers.png``.
4. ``modes_seed<first seed>.png``: held-out accuracy vs virtual time, one line per mode.
5. The wall-clock ratio with real Ray actors (``rollout.backend=ray rollout.clock=wall``,
   2 workers): seconds per version of sync and streaming (skipped under ``--quick``).
6. Last line ``rl_speedup_vs_sync=<x>``: streaming vs sync in virtual seconds per version (the
   same number of versions, final accuracy compared beside it), mean over seeds. Not the
   time-to-target ratio: held-out accuracy curves are flat and noisy here, so where they first
   cross a target is evaluation noise (one run: 3.29x with a spread of 3.08, above the cap).

Where the gain comes from, and what caps it. A sync step is (the batch's generation, which
ends with its longest group: every other worker idles at the barrier) + (the learner's step,
during which every worker idles). Streaming keeps the workers generating while the learner
trains and never waits for a particular group, so its time per version tends to
max(learner step, generation work / workers). Its speedup over sync is therefore capped by

    (sync step time) / (learner step time)        -- printed as "cap" for every sweep point

and it reaches the cap only once the workers out-generate the learner. The learner is one
device whatever the number of workers, so with many workers the learner's share decides.
On this machine the measured costs make the learner's share large: a learner step on B = 16
groups (~1,650 prompt+completion tokens at ~0.085 ms) takes several times longer than the
batch's longest group (~130 generated tokens at ~0.4 ms), so at 64 workers the cap is about
1.3x, not the >= 3x the issue asks for (anchors 2-3x come from systems where generation
dominates a sync step, with long reasoning tails and a data-parallel learner). The speedup
does not grow with the number of workers here: with few workers sync's generation is long
and streaming hides it behind the learner (the largest gain), with many workers sync's
generation shrinks to one group's time while the learner's step stays, so the ratio falls
toward the cap. Streaming's gain comes from workers that would idle at the barrier, and the
learner's share caps it; what reaches 3x is a learner step at most half of the barrier's
generation time (a learner about ten times faster per token than measured here, e.g. data
parallel over many devices, or a much heavier length tail), not more workers.

Defaults and why. ``sort`` with lengths 2..16 from a truncated Pareto with exponent 1.2 (the
task's defaults: median 3, a few of 15-16) is a long-tailed task this policy learns; B = 16
groups of G = 8 (128 samples a step) with lr 3e-4 is the setting where RL improves held-out
accuracy on every seed (1e-3 and above degraded it); S = 2 (the default, docs/rl.md) admits 3B = 48
groups in flight; a warm start of 80 supervised steps (~0.62 held-out accuracy on seed 0)
leaves RL headroom, and 80 steps let sync gain ~5-6 points. One torch thread (``--threads``):
the machine is shared and oversubscribed threads made a learner step 10x slower. B is not raised to the worker count: it would only make the learner's share
larger (B = 64: cap ~1.1x). B smaller (4, 8) raises the cap (~1.7x, ~1.5x) but is a toy batch
for GRPO; a heavier tail (max length 45, exponent 0.8) moves the cap only to ~1.4x at B = 16.

    .venv/bin/python benchmarks/rl_async_vs_sync.py                  # 3 seeds, ~15 min
    .venv/bin/python benchmarks/rl_async_vs_sync.py --quick          # 1 seed, short, ~3 min
    .venv/bin/python benchmarks/rl_async_vs_sync.py --learn-token-s 1e-5   # a faster learner
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from fedasync.events import read_events  # noqa: E402
from trainers.rl.config import load_rl_config  # noqa: E402
from trainers.rl.engine import RLRun, build_policy, build_task, pick_device  # noqa: E402
from trainers.rl.learner import Learner  # noqa: E402
from trainers.rl.policy import warm_start  # noqa: E402
from trainers.rl.rollout import generate_group  # noqa: E402

MODES = ("sync", "one_step_off", "async", "streaming")
SWEEP_MODES = ("async", "streaming")
"""Modes of the workers sweep besides sync (``--quick``: streaming only)."""


def base_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    """The task, policy and learner every run shares (mode, workers, steps vary)."""
    return [
        f"run.seed={seed}",
        "run.progress=false",
        "run.plots=false",
        f"run.eval_prompts={args.eval_prompts}",
        "task.name=sort",
        f"task.max_len={args.max_len}",
        f"task.tail={args.tail}",
        f"policy.warm_start_steps={args.warm_start}",
        f"rollout.group_size={args.group_size}",
        f"rollout.batch_groups={args.batch_groups}",
        f"learner.lr={args.lr}",
        "learner.correction=decoupled",
        "run.device=cpu",
    ]


# ----------------------------------------------------------------- 1. per-token costs
def measure_costs(args: argparse.Namespace, repeats: int) -> dict[str, Any]:
    """Median per-token costs of generation (a group of G) and learning (a batch of B)."""
    cfg = load_rl_config(None, base_overrides(args, args.seeds[0]))
    device = pick_device(cfg.run.device)
    task = build_task(cfg)
    policy = build_policy(cfg).to(device)
    warm_start(
        policy,
        task,
        steps=cfg.policy.warm_start_steps,
        batch_size=cfg.policy.warm_start_batch,
        lr=cfg.policy.warm_start_lr,
        seed=cfg.run.seed,
        device=device,
    )
    policy.eval()
    B, G = cfg.rollout.batch_groups, cfg.rollout.group_size
    gen, learn, batches = [], [], []
    for r in range(repeats + 1):  # repeat 0 warms up the code paths, not counted
        t0 = time.perf_counter()
        groups = [
            generate_group(
                policy,
                task,
                seed=10_000 + r,
                group_id=i,
                version=0,
                group_size=G,
                temperature=cfg.rollout.temperature,
                device=device,
            )
            for i in range(B)
        ]
        dt = time.perf_counter() - t0
        if r:
            gen.append(dt / max(sum(g.tokens for g in groups), 1))
        batches.append(groups)
    for r in range(repeats + 1):
        probe = copy.deepcopy(policy)
        learner = Learner(probe, cfg.learner, cfg.rollout.temperature, device)
        t0 = time.perf_counter()
        m = learner.step(batches[r], 0)
        dt = time.perf_counter() - t0
        if r:
            learn.append(dt / max(m["tokens"], 1))
    return {
        "gen_token_s": statistics.median(gen),
        "learn_token_s": statistics.median(learn),
        "gen_samples": gen,
        "learn_samples": learn,
        "repeats": repeats,
        "batch_groups": B,
        "group_size": G,
    }


# ----------------------------------------------------------------- one run
def run_one(
    args: argparse.Namespace,
    out: Path,
    name: str,
    mode: str,
    seed: int,
    workers: int,
    steps: int,
    eval_every: int,
    costs: dict[str, Any],
    extra: list[str] | None = None,
) -> dict[str, Any]:
    cfg = load_rl_config(
        None,
        base_overrides(args, seed)
        + [
            f"run.out_dir={out}",
            f"run.name={name}",
            f"run.max_steps={steps}",
            f"run.eval_every={eval_every}",
            f"rollout.mode={mode}",
            f"rollout.max_staleness={args.staleness}",
            f"rollout.workers={workers}",
            f"clock.gen_token_s={costs['gen_token_s']}",
            f"clock.learn_token_s={costs['learn_token_s']}",
        ]
        + (extra or []),
    )
    backend = None
    if cfg.rollout.backend == "ray":
        from trainers.rl.cli import make_backend

        backend = make_backend(cfg)
        if backend is None:
            raise RuntimeError("Ray is not available (the one-process mode would run instead)")
    run_dir = out / name
    s = RLRun(cfg, run_dir, backend).run()
    events = read_events(run_dir / "metrics.jsonl")
    st = [e for e in events if e["event"] == "step"]
    taus = Counter()
    for e in st:
        for k, n in e["staleness_hist"].items():
            taus[int(k)] += n
    n_tau = sum(taus.values())
    first_t = st[0]["t"] if st else math.nan
    # first eval at or above the target: the engine's run.target_accuracy rule
    target = args.target if args.target is not None else s["initial_accuracy"] + args.gain
    hit = next((e for e in s["evals"] if e["accuracy"] >= target - 1e-9), None)
    learn_s = [e["tokens"] * costs["learn_token_s"] for e in st]
    return {
        "mode": mode,
        "seed": seed,
        "workers": workers,
        "steps": s["versions"],
        "time_s": s["time_s"],
        "s_per_version": s["time_s"] / max(s["versions"], 1),
        # from the first step's end to the last's: no warm start, no fill of the pipeline
        "s_per_version_steady": (
            (st[-1]["t"] - first_t) / (len(st) - 1) if len(st) > 1 else math.nan
        ),
        "learner_step_s": statistics.mean(learn_s) if learn_s else math.nan,
        "target": target,
        "time_to_target_s": hit["t"] if hit else None,
        "versions_to_target": hit["version"] if hit else None,
        "initial_accuracy": s["initial_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "evals": s["evals"],
        "mean_staleness": sum(k * n for k, n in taus.items()) / max(n_tau, 1),
        "staleness_hist": {str(k): n for k, n in sorted(taus.items())},
        "dropped": s["dropped"],
        "worker_utilisation": s["worker_utilisation"],
        "response_length_first5": statistics.mean(e["response_length"] for e in st[:5])
        if st
        else math.nan,
        "response_length": statistics.mean(e["response_length"] for e in st) if st else math.nan,
        "batch_reward_first5": statistics.mean(e["reward"] for e in st[:5]) if st else math.nan,
        "step_times": [e["t"] for e in st],
        "run_dir": str(run_dir),
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def mean_spread(xs: list[float]) -> str:
    """``mean ± half-range`` (the spread over seeds), '-' if empty."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.2f} ± {(max(xs) - min(xs)) / 2:.2f}"


# ----------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="one seed, few steps, no Ray (~3 min)")
    ap.add_argument("--out", default="runs/bench_rl")
    ap.add_argument("--steps", type=int, default=80, help="learner steps of every mode run")
    ap.add_argument(
        "--target", type=float, help="held-out accuracy target (default: per seed, see --gain)"
    )
    ap.add_argument(
        "--gain",
        type=float,
        default=0.03,
        help="without --target, a seed's target is its warm-started accuracy + this",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)"
    )
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--staleness", type=int, default=2, help="S of async and streaming")
    ap.add_argument("--batch-groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warm-start", type=int, default=80)
    ap.add_argument("--max-len", type=int, default=16)
    ap.add_argument("--tail", type=float, default=1.2)
    ap.add_argument("--sweep-workers", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    ap.add_argument("--sweep-steps", type=int, default=20)
    ap.add_argument("--ray-steps", type=int, default=8)
    ap.add_argument("--cost-repeats", type=int, default=5)
    ap.add_argument("--gen-token-s", type=float, help="use this instead of measuring")
    ap.add_argument("--learn-token-s", type=float, help="use this instead of measuring")
    args = ap.parse_args()
    if args.quick:
        args.seeds = args.seeds[:1]
        args.steps = min(args.steps, 20)
        args.sweep_steps = min(args.sweep_steps, 8)
        args.eval_prompts = min(args.eval_prompts, 128)
        args.cost_repeats = min(args.cost_repeats, 3)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    # 1. costs
    costs = measure_costs(args, args.cost_repeats)
    measured = {k: costs[k] for k in ("gen_token_s", "learn_token_s")}
    if args.gen_token_s is not None:
        costs["gen_token_s"] = args.gen_token_s
    if args.learn_token_s is not None:
        costs["learn_token_s"] = args.learn_token_s
    print(
        f"per-token costs (median of {costs['repeats']}, B={costs['batch_groups']}, "
        f"G={costs['group_size']}): generation {measured['gen_token_s'] * 1e3:.3f} ms per "
        f"generated token, learning {measured['learn_token_s'] * 1e3:.4f} ms per batch token"
        + (
            f"; the runs use {costs['gen_token_s'] * 1e3:.3f} / "
            f"{costs['learn_token_s'] * 1e3:.4f} ms (given)"
            if (args.gen_token_s, args.learn_token_s) != (None, None)
            else ""
        ),
        flush=True,
    )

    # 2. modes x seeds, to the same number of steps
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        for mode in MODES:
            r = run_one(
                args,
                out,
                f"{mode}-s{seed}",
                mode,
                seed,
                args.workers,
                args.steps,
                args.eval_every,
                costs,
            )
            runs.append(r)
            print(
                f"  seed {seed} {mode:12s}: {r['initial_accuracy']:.3f} -> "
                f"{r['final_accuracy']:.3f} in {r['time_s']:.2f} s virtual, "
                f"target at {fmt(r['time_to_target_s'])} s (version "
                f"{r['versions_to_target']})",
                flush=True,
            )
    sync_of = {r["seed"]: r for r in runs if r["mode"] == "sync"}
    for r in runs:
        base = sync_of[r["seed"]]
        r["speedup_ttt"] = (
            base["time_to_target_s"] / r["time_to_target_s"]
            if base["time_to_target_s"] and r["time_to_target_s"]
            else None
        )
        r["speedup_per_version"] = base["s_per_version"] / r["s_per_version"]

    print(
        f"\nsort, lengths {2}..{args.max_len} (tail {args.tail}), B={args.batch_groups}, "
        f"G={args.group_size}, lr={args.lr}, decoupled, S={args.staleness}, "
        f"{args.workers} workers, warm start {args.warm_start} steps, {args.steps} steps, "
        f"{args.eval_prompts} held-out prompts every {args.eval_every} steps, virtual clock; "
        + (
            f"target {args.target} held-out accuracy"
            if args.target is not None
            else f"target per seed = its warm-started accuracy + {args.gain}: "
            + ", ".join(f"seed {k} {r['target']:.3f}" for k, r in sync_of.items())
        )
    )
    head = (
        f"{'mode':12s} {'seed':>4s} {'time-to-target s':>16s} {'versions':>8s} "
        f"{'s/version':>9s} {'final acc':>9s} {'speedup ttt':>11s} {'speedup s/v':>11s} "
        f"{'staleness':>9s} {'dropped':>7s}"
    )
    print(head)
    for r in runs:
        print(
            f"{r['mode']:12s} {r['seed']:>4d} {fmt(r['time_to_target_s']):>16s} "
            f"{fmt(r['versions_to_target'], 'd'):>8s} {r['s_per_version']:>9.4f} "
            f"{r['final_accuracy']:>9.3f} {fmt(r['speedup_ttt']):>11s} "
            f"{r['speedup_per_version']:>11.2f} {r['mean_staleness']:>9.2f} "
            f"{sum(r['dropped'].values()):>7d}"
        )
    print(f"\nover seeds {args.seeds} (mean ± half-range)")
    print(
        f"{'mode':12s} {'time-to-target s':>16s} {'versions':>14s} {'final acc':>12s} "
        f"{'speedup ttt':>12s} {'speedup s/v':>12s} {'final vs sync':>13s}"
    )
    table = []
    sync_final = statistics.mean(r["final_accuracy"] for r in sync_of.values())
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        ttt = [r["time_to_target_s"] for r in rs]
        sp = [r["speedup_ttt"] for r in rs]
        fin = statistics.mean(r["final_accuracy"] for r in rs)
        row = {
            "mode": mode,
            "reached": sum(t is not None for t in ttt),
            "time_to_target_mean": statistics.mean(t for t in ttt if t is not None)
            if any(t is not None for t in ttt)
            else None,
            "speedup_ttt_mean": statistics.mean(x for x in sp if x is not None)
            if any(x is not None for x in sp)
            else None,
            "speedup_ttt_seeds": sum(x is not None for x in sp),
            "speedup_per_version_mean": statistics.mean(r["speedup_per_version"] for r in rs),
            "final_mean": fin,
            "final_minus_sync": fin - sync_final,
            "within_1_point": abs(fin - sync_final) <= 0.01,
            "dropped": dict(sum((Counter(r["dropped"]) for r in rs), Counter())),
        }
        table.append(row)
        print(
            f"{mode:12s} {mean_spread(ttt):>16s} "
            f"{mean_spread([r['versions_to_target'] for r in rs]):>14s} "
            f"{mean_spread([r['final_accuracy'] for r in rs]):>12s} "
            f"{mean_spread(sp):>12s} "
            f"{mean_spread([r['speedup_per_version'] for r in rs]):>12s} "
            f"{row['final_minus_sync'] * 100:>+10.1f} pt"
            + ("" if row["within_1_point"] else " (not within 1)")
            + (f"  reached {row['reached']}/{len(rs)}" if row["reached"] < len(rs) else "")
        )
    for row in table:
        if row["dropped"]:
            print(f"  {row['mode']} dropped (all seeds): {row['dropped']}")
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    print(
        "  length bias (mean response length of the first 5 learnt batches / of all, "
        "batch reward of the first 5): "
        + ", ".join(
            f"{m} {statistics.mean(r['response_length_first5'] for r in rs):.2f}/"
            f"{statistics.mean(r['response_length'] for r in rs):.2f}/"
            f"{statistics.mean(r['batch_reward_first5'] for r in rs):.2f}"
            for m, rs in by_mode.items()
        )
    )

    # 3. speedup vs workers (one seed, fixed steps, seconds per version)
    seed0 = args.seeds[0]
    sweep: list[dict[str, Any]] = []
    sweep_modes = ("streaming",) if args.quick else SWEEP_MODES
    print(
        f"\nspeedup vs workers (seed {seed0}, {args.sweep_steps} steps, virtual seconds per "
        f"version; cap = sync step / learner step)"
    )
    print(
        f"{'workers':>7s} {'sync s/v':>9s} "
        + " ".join(f"{m + ' s/v':>13s}" for m in sweep_modes)
        + " "
        + " ".join(f"{m + ' x':>11s}" for m in sweep_modes)
        + f" {'learner s':>9s} {'cap':>6s} {'sync util':>9s} {'str util':>8s}"
    )
    for w in args.sweep_workers:
        row: dict[str, Any] = {"workers": w}
        for mode in ("sync", *sweep_modes):
            r = run_one(
                args,
                out / "sweep",
                f"{mode}-w{w}",
                mode,
                seed0,
                w,
                args.sweep_steps,
                args.sweep_steps,
                costs,
            )
            row[mode] = {
                k: r[k]
                for k in ("s_per_version", "learner_step_s", "worker_utilisation", "final_accuracy")
            }
        for mode in sweep_modes:
            row[f"{mode}_speedup"] = row["sync"]["s_per_version"] / row[mode]["s_per_version"]
        row["cap"] = row["sync"]["s_per_version"] / row["sync"]["learner_step_s"]
        sweep.append(row)
        print(
            f"{w:>7d} {row['sync']['s_per_version']:>9.4f} "
            + " ".join(f"{row[m]['s_per_version']:>13.4f}" for m in sweep_modes)
            + " "
            + " ".join(f"{row[m + '_speedup']:>11.2f}" for m in sweep_modes)
            + f" {row['sync']['learner_step_s']:>9.4f} {row['cap']:>6.2f}"
            f" {row['sync']['worker_utilisation']:>9.2f}"
            f" {row['streaming']['worker_utilisation']:>8.2f}",
            flush=True,
        )
    from trainers.rl.plots import plot_modes, plot_speedup_vs_workers

    png_sweep = plot_speedup_vs_workers(
        [r["workers"] for r in sweep],
        {
            **{m: [r[f"{m}_speedup"] for r in sweep] for m in sweep_modes},
            "cap: sync step / learner step": [r["cap"] for r in sweep],
        },
        out / "speedup_vs_workers.png",
    )
    # 4. modes, seed 0
    png_modes = plot_modes(
        {
            m: Path(r["run_dir"])
            for m in MODES
            for r in runs
            if r["mode"] == m and r["seed"] == seed0
        },
        out / f"modes_seed{seed0}.png",
        title=f"sort, {args.workers} workers, B={args.batch_groups}, G={args.group_size}, "
        f"S={args.staleness}, seed {seed0} (virtual clock)",
    )
    print(f"plots: {png_sweep}, {png_modes}")

    # 5. wall clock with Ray actors
    ray_result: dict[str, Any] = {}
    if args.quick:
        ray_result = {"measured": False, "reason": "skipped under --quick"}
    else:
        try:
            spv = {}
            for mode in ("sync", "streaming"):
                r = run_one(
                    args,
                    out / "ray",
                    f"{mode}-ray",
                    mode,
                    seed0,
                    2,
                    args.ray_steps,
                    args.ray_steps,
                    costs,
                    extra=["rollout.backend=ray", "rollout.clock=wall", "rollout.workers=2"],
                )
                spv[mode] = r["s_per_version_steady"]
            ray_result = {
                "measured": True,
                "s_per_version": spv,
                "ratio": spv["sync"] / spv["streaming"],
            }
        except Exception as e:  # noqa: BLE001 - the Ray backend is optional here
            ray_result = {"measured": False, "reason": f"{type(e).__name__}: {e}"[:300]}
    if ray_result["measured"]:
        s = ray_result["s_per_version"]
        print(
            f"wall clock, Ray actors, 2 workers, {args.ray_steps} steps: sync "
            f"{s['sync']:.3f} s/version, streaming {s['streaming']:.3f} s/version, ratio "
            f"{ray_result['ratio']:.2f} (wall time: shares the machine with whatever else runs)"
        )
    else:
        print(f"wall clock with Ray actors: not measured: {ray_result['reason']}")

    streaming = next(r for r in table if r["mode"] == "streaming")
    speedup_ttt = streaming["speedup_ttt_mean"]
    speedup = streaming["speedup_per_version_mean"]
    at64 = next((r for r in sweep if r["workers"] == args.workers), None)
    if at64 is not None:
        print(
            f"at {args.workers} workers the cap (sync step / learner step) is "
            f"{at64['cap']:.2f}x; streaming's seconds-per-version speedup is "
            f"{fmt(speedup)}x (goal >= 3x: "
            + ("reached" if speedup is not None and speedup >= 3 else "not reached")
            + f"); its time-to-target speedup is {fmt(speedup_ttt)}x"
        )
        if speedup_ttt is not None and speedup_ttt > at64["cap"] * 1.05:
            print(
                "  the time-to-target speedup exceeds the throughput cap: it comes from where "
                "the noisy held-out accuracy curves first cross the target (evaluation noise, "
                "one eval every few steps), not from throughput; read the s/version speedup"
            )
    (out / "results.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "costs": costs,
                "measured_costs": measured,
                "runs": runs,
                "table": table,
                "sweep": sweep,
                "ray": ray_result,
                "rl_speedup_vs_sync": speedup,
                "rl_speedup_vs_sync_time_to_target": speedup_ttt,
            },
            indent=2,
        )
    )
    print(f"({time.monotonic() - t_start:.0f} s)")
    print(f"rl_speedup_vs_sync={fmt(speedup, '.3f') if speedup is not None else 'nan'}")


if __name__ == "__main__":
    main()
