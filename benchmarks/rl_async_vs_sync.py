"""Asynchronous RL against sync on the virtual clock's cost profiles: time to the same reward.

Every run trains the same policy on the same task (``sort``, long-tailed list lengths) from
the same warm start, with the same B (groups per learner step), G (samples per group),
learning rate and correction (``decoupled``), on 64 virtual rollout workers, for the same
number of learner steps. Per cost profile (``clock.profile``, docs/rl.md "Cost profiles":
``local`` = the costs measured here, ``gen45``/``gen70``/``gen80`` = generation that share of
a sync step, ``gen80_tail`` = 80% with reasoning-length tails) and per seed, ``sync`` and
``streaming`` (S = ``--staleness``) run ``--steps`` learner steps with a held-out evaluation
every ``--eval-every`` steps.

1. The per-token generation cost is measured once (median of a few repeats) and every run of
   every profile gets it (``clock.gen_token_s``); ``local`` also gets the measured learner
   cost; the other profiles set the learner's from it. The virtual clock, not the machine's
   load, decides every time below.
2. The task where RL moves the needle: a short warm start (``--warm-start`` 30 supervised
   steps) leaves the policy at 0.20-0.45 held-out accuracy (by seed), and lr 1e-3 lets sync
   GRPO reach its plateau of ~0.47-0.58 in 100 steps: +0.11 to +0.33 (seeds 0-4; lr 2e-3
   was worse on 4 of 5 seeds). The previous setting (80 warm-start steps, lr 3e-4) started at
   ~0.62 and gained 1-5 points, so time-to-target was evaluation noise.
3. Time to target: one held-out accuracy ``--target`` (0.45) for every seed and mode (or, with
   ``--gain``, per seed its warm start + gain); a run reaches it at the first evaluation from
   which every later one stays at or above it ("reached and kept"). Speedup = sync's time /
   streaming's, per seed; mean ± half-range
   over seeds. Beside it: the profile's limit (an overlapping schedule needs at least
   max(learner step, generation work / workers) per version: with ample workers Amdahl's
   1/(1 − f)) as calibrated on sync's first 4 batches, and as realised (sync's time / its
   learner's time over the whole run: the tail's makespans vary from batch to batch, so 4
   batches only estimate it; "of limit" is against the realised one), the share of sync's
   step that generation took, the throughput ratio (virtual seconds per version), the steps
   ratio (streaming's versions to target / sync's: what staleness costs in learning per step)
   and the final accuracy against sync's spread.
4. ``profiles.png``: the time-to-target speedup per profile, with its spread and the limit;
   ``curves_seed<seed>.png``: held-out accuracy vs virtual time of both modes per profile.
5. Last line ``rl_speedup_vs_sync=<x>``: streaming vs sync in time to target, the
   ``gen80_tail`` profile's mean over seeds (the one before it: the same for every profile).

    .venv/bin/python benchmarks/rl_async_vs_sync.py               # 5 seeds x 5 profiles, ~35 min
    .venv/bin/python benchmarks/rl_async_vs_sync.py --quick       # 1 seed, 2 profiles, ~3 min
    .venv/bin/python benchmarks/rl_async_vs_sync.py --profiles local gen80 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from spread import fmt, mean_spread  # noqa: E402

from fedasync.devices import pick_device  # noqa: E402
from fedasync.events import read_events  # noqa: E402
from trainers.rl.backend import build_policy, build_task  # noqa: E402
from trainers.rl.config import load_rl_config  # noqa: E402
from trainers.rl.engine import RLRun  # noqa: E402
from trainers.rl.learner import Learner  # noqa: E402
from trainers.rl.policy import warm_start  # noqa: E402
from trainers.rl.profiles import PROFILES  # noqa: E402
from trainers.rl.rollout import generate_group  # noqa: E402

MODES = ("sync", "streaming")
HEADLINE = "gen80_tail"


def base_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    """The task, policy and learner every run shares (mode, profile, seed vary)."""
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
        f"rollout.workers={args.workers}",
        f"rollout.max_staleness={args.staleness}",
        f"learner.lr={args.lr}",
        f"learner.minibatches={args.minibatches}",
        "learner.correction=decoupled",
        "run.device=cpu",
    ]


# ----------------------------------------------------------------- 1. per-token costs
def measure_costs(args: argparse.Namespace, repeats: int) -> dict[str, float]:
    """Median per-token costs of generation (a batch of B groups) and learning (one step)."""
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
    gen, learn = [], []
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
        learner = Learner(build_policy(cfg).to(device), cfg.learner, 1.0, device)
        t1 = time.perf_counter()
        m = learner.step(groups, 0)
        if r:
            gen.append(dt / max(sum(g.tokens for g in groups), 1))
            learn.append((time.perf_counter() - t1) / max(m["tokens"], 1))
    return {"gen_token_s": statistics.median(gen), "learn_token_s": statistics.median(learn)}


# ----------------------------------------------------------------- one run
def kept_from(evals: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluation from which every later one is at or above ``target``."""
    hit = None
    for e in evals:
        if e["accuracy"] >= target - 1e-9:
            hit = hit or e
        else:
            hit = None
    return hit


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One (profile, mode, seed) run; returns what the tables need (runs in a worker process)."""
    torch.set_num_threads(1)
    args = argparse.Namespace(**job["args"])
    profile, mode, seed = job["profile"], job["mode"], job["seed"]
    costs = job["costs"]
    out = Path(args.out)
    name = f"{profile}-{mode}-s{seed}"
    extra = [f"clock.gen_token_s={costs['gen_token_s']}", f"clock.profile={profile}"]
    if profile == "local":
        extra.append(f"clock.learn_token_s={costs['learn_token_s']}")
    cfg = load_rl_config(
        None,
        base_overrides(args, seed)
        + [
            f"run.out_dir={out}",
            f"run.name={name}",
            f"run.max_steps={args.steps}",
            f"run.eval_every={args.eval_every}",
            f"rollout.mode={mode}",
        ]
        + extra,
    )
    run_dir = out / name
    run = RLRun(cfg, run_dir)
    s = run.run()
    events = read_events(run_dir / "metrics.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    start = next(e for e in events if e["event"] == "start")
    learn_s = sum(e["tokens"] for e in steps) * float(start["learn_token_s"])
    return {
        "profile": profile,
        "mode": mode,
        "seed": seed,
        "versions": s["versions"],
        "time_s": s["time_s"],
        "s_per_version": s["time_s"] / max(s["versions"], 1),
        "learn_s": learn_s,
        "initial_accuracy": s["initial_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "evals": [{k: e[k] for k in ("t", "version", "accuracy")} for e in s["evals"]],
        "limit": start["profile"].get("limit"),
        "dropped": s["dropped"],
        "worker_utilisation": s["worker_utilisation"],
        "run_dir": str(run_dir),
    }


def plot(table: list[dict[str, Any]], runs: list[dict[str, Any]], out: Path, seed: int) -> None:
    """profiles.png (speedup and limit per profile) and curves_seed<seed>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(table))
    sp = [r["speedup"] or (math.nan, 0.0) for r in table]
    ax.bar(xs, [m for m, _ in sp], yerr=[h for _, h in sp], capsize=4, label="streaming / sync")
    ax.plot(xs, [r["limit"] for r in table], "k_", markersize=30, mew=2, label="limit")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), [r["profile"] for r in table])
    ax.set_ylabel("time-to-target speedup (mean ± half-range)")
    ax.set_title("streaming vs sync, time to the same held-out accuracy (virtual clock)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "profiles.png", dpi=120)
    plt.close(fig)

    profiles = [r["profile"] for r in table]
    fig, axes = plt.subplots(1, len(profiles), figsize=(3.2 * len(profiles), 3.2), squeeze=False)
    for ax, p in zip(axes[0], profiles, strict=True):
        for r in runs:
            if r["profile"] == p and r["seed"] == seed:
                ax.plot(
                    [e["t"] for e in r["evals"]],
                    [e["accuracy"] for e in r["evals"]],
                    marker=".",
                    label=r["mode"],
                )
        ax.set_title(p)
        ax.set_xlabel("virtual s")
    axes[0][0].set_ylabel("held-out accuracy")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / f"curves_seed{seed}.png", dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument("--quick", action="store_true", help="one seed, local and gen80_tail")
    ap.add_argument("--out", default="runs/bench_rl")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--steps", type=int, default=100, help="learner steps of every run")
    ap.add_argument(
        "--target", type=float, default=0.45, help="held-out accuracy target, every seed and mode"
    )
    ap.add_argument("--gain", type=float, help="instead of --target: per seed, warm start + this")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--staleness", type=int, default=2, help="S of streaming")
    ap.add_argument("--batch-groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--minibatches",
        type=int,
        default=1,
        help="optimiser steps per batch (PPO's clip acts from 2)",
    )
    ap.add_argument("--warm-start", type=int, default=30)
    ap.add_argument("--max-len", type=int, default=16)
    ap.add_argument("--tail", type=float, default=1.2)
    ap.add_argument("--cost-repeats", type=int, default=5)
    ap.add_argument("--gen-token-s", type=float, help="use this instead of measuring")
    ap.add_argument("--learn-token-s", type=float, help="use this instead of measuring")
    ap.add_argument(
        "--report-only", action="store_true", help="tables and plots from <out>/results.json"
    )
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.profiles = args.seeds[:1], ["local", HEADLINE]
        args.cost_repeats = min(args.cost_repeats, 3)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    if args.report_only:
        saved = json.loads((out / "results.json").read_text())
        runs, costs = saved["runs"], saved["costs"]
        report(args, runs, costs, out, t_start)
        return
    costs = measure_costs(args, args.cost_repeats)
    given = {"gen_token_s": args.gen_token_s, "learn_token_s": args.learn_token_s}
    costs |= {k: v for k, v in given.items() if v is not None}
    print(
        f"costs (median of {args.cost_repeats}, B={args.batch_groups}, G={args.group_size}): "
        f"generation {costs['gen_token_s'] * 1e3:.3f} ms per generated token, learning "
        f"{costs['learn_token_s'] * 1e3:.4f} ms per batch token (the latter: profile local only)",
        flush=True,
    )
    jobs = [
        {"args": vars(args), "profile": p, "mode": m, "seed": s, "costs": costs}
        for p in args.profiles
        for s in args.seeds
        for m in MODES
    ]
    runs: list[dict[str, Any]] = []
    from tqdm import tqdm

    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs.extend(tqdm(pool.map(run_one, jobs), total=len(jobs), desc="runs", unit="run"))
    report(args, runs, costs, out, t_start)


def report(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    costs: dict[str, float],
    out: Path,
    t_start: float,
) -> None:
    """The per-seed and per-profile tables, the plots, results.json and the figure lines."""
    args.profiles = list(dict.fromkeys(r["profile"] for r in runs))
    args.seeds = list(dict.fromkeys(r["seed"] for r in runs))

    # per seed: the target from the warm start (the same in every profile and mode)
    table: list[dict[str, Any]] = []
    for p in args.profiles:
        rows = []
        for seed in args.seeds:
            sync = next(
                r for r in runs if (r["profile"], r["mode"], r["seed"]) == (p, "sync", seed)
            )
            st = next(
                r for r in runs if (r["profile"], r["mode"], r["seed"]) == (p, "streaming", seed)
            )
            target = args.target if args.gain is None else sync["initial_accuracy"] + args.gain
            hs, ht = kept_from(sync["evals"], target), kept_from(st["evals"], target)
            rows.append(
                {
                    "seed": seed,
                    "target": target,
                    "sync_ttt": hs["t"] if hs else None,
                    "stream_ttt": ht["t"] if ht else None,
                    "sync_versions": hs["version"] if hs else None,
                    "stream_versions": ht["version"] if ht else None,
                    "steps_ratio": ht["version"] / hs["version"]
                    if hs and ht and hs["version"] > 0
                    else None,
                    "speedup": hs["t"] / ht["t"] if hs and ht and ht["t"] > 0 else None,
                    "throughput": sync["s_per_version"] / st["s_per_version"],
                    "gen_share": 1 - sync["learn_s"] / sync["time_s"],
                    "sync_final": sync["final_accuracy"],
                    "stream_final": st["final_accuracy"],
                    "initial": sync["initial_accuracy"],
                    "limit": sync["limit"],
                    # the run's own: sync's time over its learner's (the Amdahl bound of the
                    # steps it really took, where the reference batches only estimate it)
                    "realised_limit": sync["time_s"] / sync["learn_s"],
                    "dropped": sum(st["dropped"].values()),
                }
            )
        sync_fin = [r["sync_final"] for r in rows]
        st_fin = mean_spread([r["stream_final"] for r in rows])
        lo, hi = min(sync_fin), max(sync_fin)
        limit = rows[0]["limit"]  # the first seed's calibration (1/(1 − f) with ample workers)
        table.append(
            {
                "profile": p,
                "rows": rows,
                "speedup": mean_spread([r["speedup"] for r in rows]),
                "reached": sum(r["speedup"] is not None for r in rows),
                "throughput": mean_spread([r["throughput"] for r in rows]),
                "steps_ratio": mean_spread([r["steps_ratio"] for r in rows]),
                "gen_share": mean_spread([r["gen_share"] for r in rows]),
                "limit": limit,
                "realised_limit": mean_spread([r["realised_limit"] for r in rows]),
                "sync_final": mean_spread(sync_fin),
                "stream_final": st_fin,
                "final_within_sync_spread": st_fin is not None and lo - 1e-9 <= st_fin[0] <= hi,
                "gain": mean_spread([r["sync_final"] - r["initial"] for r in rows]),
            }
        )

    print(
        f"\nsort, lengths 2..{args.max_len} (tail {args.tail}), B={args.batch_groups}, "
        f"G={args.group_size}, lr={args.lr}, decoupled, streaming S={args.staleness}, "
        f"{args.workers} workers, warm start {args.warm_start} steps, {args.steps} steps, "
        f"{args.eval_prompts} held-out prompts every {args.eval_every} steps; target "
        + (f"{args.target}" if args.gain is None else f"per seed = its warm start + {args.gain}")
        + f" held-out accuracy, reached and kept; seeds {args.seeds}"
    )
    print(
        "per seed: profile seed  target  sync t (version)  streaming t (version)  speedup  "
        "s/v ratio  dropped"
    )

    def tv(t: float | None, v: int | None) -> str:
        return "-" if t is None else f"{t:.3f} ({v})"

    for t in table:
        for r in t["rows"]:
            sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
            print(
                f"  {t['profile']:10s} {r['seed']:>2d}  {r['target']:.3f}  "
                f"{tv(r['sync_ttt'], r['sync_versions']):>15s}  "
                f"{tv(r['stream_ttt'], r['stream_versions']):>15s}  "
                f"{sp:>7s}  {r['throughput']:>6.2f}  {r['dropped']:>5d}"
            )
    print(
        f"\n{'profile':10s} {'gen share':>11s} {'limit':>6s} {'realised':>11s} {'speedup ttt':>13s} "
        f"{'of limit':>8s} {'s/v ratio':>12s} {'steps ratio':>12s} {'sync gain':>13s} "
        f"{'sync final':>13s} {'stream final':>13s}"
    )
    for t in table:
        real = t["realised_limit"][0] if t["realised_limit"] else t["limit"]
        of = "-" if t["speedup"] is None else f"{t['speedup'][0] / real:.0%}"
        print(
            f"{t['profile']:10s} {fmt(t['gen_share']):>11s} {t['limit']:>5.2f}x "
            f"{fmt(t['realised_limit']):>11s} "
            f"{fmt(t['speedup']):>13s} {of:>8s} {fmt(t['throughput']):>12s} "
            f"{fmt(t['steps_ratio']):>12s} "
            f"{fmt(t['gain'], '+.3f'):>13s} {fmt(t['sync_final'], '.3f'):>13s} "
            f"{fmt(t['stream_final'], '.3f'):>13s}"
            + ("" if t["final_within_sync_spread"] else " (outside sync's range)")
            + (
                f" reached {t['reached']}/{len(args.seeds)}"
                if t["reached"] < len(args.seeds)
                else ""
            )
        )
    plot(table, runs, out, args.seeds[0])
    print(f"plots: {out / 'profiles.png'}, {out / f'curves_seed{args.seeds[0]}.png'}")
    (out / "results.json").write_text(
        json.dumps({"args": vars(args), "costs": costs, "runs": runs, "table": table}, indent=2)
    )
    print(f"({time.monotonic() - t_start:.0f} s)")
    for t in table:
        v = "nan" if t["speedup"] is None else f"{t['speedup'][0]:.3f}"
        real = t["realised_limit"][0] if t["realised_limit"] else t["limit"]
        print(
            f"rl_speedup_vs_sync_{t['profile']}={v} (limit {t['limit']:.2f} by calibration, "
            f"{real:.2f} realised)"
        )
    head = next((t for t in table if t["profile"] == HEADLINE), table[-1])
    v = "nan" if head["speedup"] is None else f"{head['speedup'][0]:.3f}"
    print(f"rl_speedup_vs_sync={v}")


if __name__ == "__main__":
    main()
