"""FedAsync, FedBuff, CA2FL and synchronous FedAvg on the same benchmark, silos, speeds, clock.

10 silos, 2 of them 10x slower (the FedBuff paper's straggler setting, Nguyen et al. 2022).
Every mode runs through Flower's simulation engine for the same virtual-time budget, on each
``--seeds`` seed (the seed draws the data split, the stragglers and the initial model).
Prints, per seed and mode, the final and best test score and the virtual time to reach 95%
(and 100%) of that seed's sync best; then per mode the mean ± spread (half the range) over
the seeds. Writes ``results.json`` and each seed's ``accuracy_vs_time.png`` in the output
folder (in ``seed<S>/`` with more than one seed; ``results_over_seeds.json`` beside them), and last the line ``speedup_vs_sync=<float>`` (the best async mode's mean
time-to-target speedup).

    .venv/bin/python benchmarks/async_vs_sync.py                 # the reported setting, seed 0
    .venv/bin/python benchmarks/async_vs_sync.py --seeds 0,1,2   # three seeds, with spread
    .venv/bin/python benchmarks/async_vs_sync.py --budget-s 800  # quicker, less converged
    .venv/bin/python benchmarks/async_vs_sync.py data.benchmark=radiomics-lesion  # any override
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spread import fmt, mean_spread  # noqa: E402

from server.summary import time_to_target  # noqa: E402
from simulations.config import load_config  # noqa: E402
from simulations.launcher import run_engine, setup_logging  # noqa: E402
from simulations.plots import plot_score_vs_time  # noqa: E402

MODES = {
    "sync": ["server.mode=sync"],
    "fedasync": [
        "server.mode=fedasync",
        "server.alpha=0.3",
        "server.staleness.fn=polynomial",
        "server.staleness.a=0.5",
    ],
    "fedbuff": [
        "server.mode=fedbuff",
        "server.buffer_size=4",
        "server.staleness.fn=polynomial",
        "server.staleness.a=0.5",
    ],
    # CA2FL (Wang et al. 2024): FedBuff's K, no staleness weight (its cache calibrates instead)
    "ca2fl": ["server.mode=ca2fl", "server.buffer_size=4"],
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--silos", type=int, default=10)
    ap.add_argument("--stragglers", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=10.0)
    ap.add_argument("--budget-s", type=float, default=2000.0)
    ap.add_argument("--seed", type=int, default=0, help="one seed (without --seeds)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds, e.g. 0,1,2")
    ap.add_argument("--out", default="runs/bench-async-vs-sync")
    ap.add_argument("--modes", default="sync,fedasync,fedbuff,ca2fl")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    setup_logging(out)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    modes = args.modes.split(",")
    per_seed = {
        seed: run_seed(args, out if len(seeds) == 1 else out / f"seed{seed}", seed, modes)
        for seed in seeds
    }
    print(f"\nover seeds {','.join(map(str, seeds))}: mean ± spread (half the range)")
    print(f"{'mode':9s} {'final':>15s} {'best':>15s} {'speedup at 95%':>15s} {'at 100%':>15s}")
    speed95: dict[str, tuple[float, float] | None] = {}
    for mode in modes:
        rows = [per_seed[s][mode] for s in seeds]
        cols = [mean_spread([r[k] for r in rows]) for k in ("final", "best")]
        speed95[mode] = mean_spread([r["speedup_at_95%"] for r in rows])
        at100 = mean_spread([r["speedup_at_100%"] for r in rows])
        print(
            f"{mode:9s} {fmt(cols[0], '.4f'):>15s} {fmt(cols[1], '.4f'):>15s} "
            f"{fmt(speed95[mode]):>15s} {fmt(at100):>15s}"
        )
    (out / "results_over_seeds.json").write_text(
        json.dumps({"seeds": seeds, "per_seed": {str(s): r for s, r in per_seed.items()}}, indent=2)
    )
    means = [ms[0] for m, ms in speed95.items() if m != "sync" and ms is not None]
    print(f"speedup_vs_sync={max(means) if means else 0.0:.2f}")


def run_seed(args: argparse.Namespace, out: Path, seed: int, modes: list[str]) -> dict[str, Any]:
    """Every mode on ``seed`` into ``out``: its table, ``results.json`` and plot; the rows."""
    common = [
        f"run.out_dir={out}",
        f"run.seed={seed}",
        f"run.budget_s={args.budget_s}",
        "lab.compare_sync=false",
        f"silos.count={args.silos}",
        "lab.speed.profile=stragglers",
        f"lab.speed.straggler_fraction={args.stragglers / args.silos}",
        f"lab.speed.straggler_slowdown={args.slowdown}",
        "server.max_staleness=null",
        "server.eval_every=5",
        "server.checkpoint_every=0",
        "server.evaluate_silos=false",
    ]
    summaries = {}
    for mode in modes:
        cfg = load_config(None, common + MODES[mode] + [f"run.name={mode}"] + args.overrides)
        t0 = time.monotonic()
        summaries[mode] = run_engine(cfg, out / mode)
        print(
            f"[seed {seed} {mode}] done in {time.monotonic() - t0:.0f}s wall, "
            f"{summaries[mode]['versions']} versions",
            flush=True,
        )
    ref = summaries.get("sync") or next(iter(summaries.values()))
    metric = ref["metric"]
    # the issue's target (95% of sync's best) and a stricter one (all of sync's best)
    targets = {"95%": 0.95 * ref["best_score"], "100%": ref["best_score"]}
    t_ref = {k: time_to_target(ref["evals"], v) for k, v in targets.items()}
    rows = {}
    print(
        f"\nseed {seed}\n{'mode':9s} {'final':>7s} {'best':>7s} {'versions':>8s} "
        f"{'stale_mean':>10s} {'t_95%_s':>8s} {'speedup':>8s} {'t_100%_s':>8s} {'speedup':>8s}"
    )
    for mode, s in summaries.items():
        row = {
            "final": s["final_score"],
            "best": s["best_score"],
            "versions": s["versions"],
            "staleness_mean": s["staleness_mean"],
        }
        cells = []
        for k, v in targets.items():
            t = time_to_target(s["evals"], v)
            speed = (t_ref[k] / t) if (t and t_ref[k]) else None
            row[f"time_to_{k}_s"], row[f"speedup_at_{k}"] = t, speed
            cells.append(
                f"{(f'{t:.0f}' if t else 'never'):>8s} {(f'{speed:.2f}x' if speed else '-'):>8s}"
            )
        rows[mode] = row
        print(
            f"{mode:9s} {s['final_score']:7.4f} {s['best_score']:7.4f} {s['versions']:8d} "
            f"{s['staleness_mean']:10.2f} " + " ".join(cells)
        )
    print(
        f"targets: {targets['95%']:.4f} (95% of sync's best) and {targets['100%']:.4f} {metric}; "
        f"virtual budget {args.budget_s:.0f}s"
    )
    (out / "results.json").write_text(
        json.dumps({"targets": targets, "metric": metric, "rows": rows}, indent=2)
    )
    plot_score_vs_time(summaries, out / "accuracy_vs_time.png", metric, targets["95%"])
    return rows


if __name__ == "__main__":
    main()
