"""FedAsync, FedBuff and synchronous FedAvg on the same benchmark, silos, speeds and clock.

10 silos, 2 of them 10x slower (the FedBuff paper's straggler setting, Nguyen et al. 2022).
Every mode runs through Flower's simulation engine for the same virtual-time budget. Prints,
per mode, the final and best test score and the virtual time to reach 95% of sync's best;
writes ``results.json`` and ``accuracy_vs_time.png`` in the output folder, and last the line
``speedup_vs_sync=<float>`` (the best async mode's time-to-target speedup).

    .venv/bin/python benchmarks/async_vs_sync.py                 # the reported setting
    .venv/bin/python benchmarks/async_vs_sync.py --budget-s 800  # quicker, less converged
    .venv/bin/python benchmarks/async_vs_sync.py data.benchmark=radiomics-lesion  # any override
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--silos", type=int, default=10)
    ap.add_argument("--stragglers", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=10.0)
    ap.add_argument("--budget-s", type=float, default=2000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench-async-vs-sync")
    ap.add_argument("--modes", default="sync,fedasync,fedbuff")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    setup_logging(out)
    common = [
        f"run.out_dir={out}",
        f"run.seed={args.seed}",
        f"run.budget_s={args.budget_s}",
        "run.compare_sync=false",
        f"silos.count={args.silos}",
        "silos.speed_profile=stragglers",
        f"silos.straggler_fraction={args.stragglers / args.silos}",
        f"silos.straggler_slowdown={args.slowdown}",
        "server.max_staleness=null",
        "server.eval_every=5",
        "server.checkpoint_every=0",
        "server.evaluate_silos=false",
    ]
    summaries = {}
    for mode in args.modes.split(","):
        cfg = load_config(None, common + MODES[mode] + [f"run.name={mode}"] + args.overrides)
        t0 = time.monotonic()
        summaries[mode] = run_engine(cfg, out / mode)
        print(
            f"[{mode}] done in {time.monotonic() - t0:.0f}s wall, {summaries[mode]['versions']} versions",
            flush=True,
        )
    ref = summaries.get("sync")
    target = 0.95 * (ref or next(iter(summaries.values())))["best_accuracy"]
    t_sync = time_to_target(ref["evals"], target) if ref else None
    rows = {}
    metric = next(iter(summaries.values()))["metric"]
    print(
        f"\n{'mode':9s} {'final':>7s} {'best':>7s} {'versions':>8s} {'stale_mean':>10s} {'t_target_s':>10s} {'speedup':>7s}"
    )
    for mode, s in summaries.items():
        t = time_to_target(s["evals"], target)
        speed = (t_sync / t) if (t and t_sync) else None
        rows[mode] = {
            "final": s["final_accuracy"],
            "best": s["best_accuracy"],
            "versions": s["versions"],
            "staleness_mean": s["staleness_mean"],
            "time_to_target_s": t,
            "speedup_vs_sync": speed,
        }
        print(
            f"{mode:9s} {s['final_accuracy']:7.4f} {s['best_accuracy']:7.4f} {s['versions']:8d} "
            f"{s['staleness_mean']:10.2f} {(f'{t:.0f}' if t else 'never'):>10s} "
            f"{(f'{speed:.2f}x' if speed else '-'):>7s}"
        )
    print(
        f"target: {target:.4f} {metric} (95% of sync's best), virtual budget {args.budget_s:.0f}s"
    )
    (out / "results.json").write_text(
        json.dumps({"target": target, "metric": metric, "rows": rows}, indent=2)
    )
    plot_score_vs_time(summaries, out / "accuracy_vs_time.png", metric, target)
    speedups = [
        r["speedup_vs_sync"] for m, r in rows.items() if m != "sync" and r["speedup_vs_sync"]
    ]
    print(f"speedup_vs_sync={max(speedups) if speedups else 0.0:.2f}")


if __name__ == "__main__":
    main()
