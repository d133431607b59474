"""What central (server-side) DP costs in accuracy, and what it buys in epsilon, on the default run.

Runs the default simulation (brain-tissue, 6 silos, FedAsync, ``--budget-s`` virtual s) on
Flower's simulation engine: once with server-side clipping only (``server.clip_norm``, the
baseline), then with Gaussian noise on every release for each noise multiplier in
``--sigmas`` (``server.dp.noise_multiplier``). Prints final and best test accuracy, versions,
and the largest and smallest per-silo central epsilon at delta 1e-5 (``summary.json``).
Each run takes about a minute; the commands are printed.

    .venv/bin/python benchmarks/central_dp.py [--clip 0.15] [--sigmas 1.0 0.1 0.01] [--mode fedasync]

Last line: ``central_dp_accuracy_ratio=<final accuracy with the first sigma / clip only>``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(out: Path, name: str, common: list[str], extra: list[str]) -> tuple[dict, float]:
    cmd = [str(ROOT / ".venv/bin/fedasync"), "simulate", f"run.name={name}", *common, *extra]
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / name / "summary.json").read_text()), time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clip", type=float, default=0.15, help="server.clip_norm (C)")
    ap.add_argument("--sigmas", type=float, nargs="+", default=[1.0, 0.1, 0.01])
    ap.add_argument("--mode", default="fedasync", choices=["fedasync", "fedbuff", "sync"])
    ap.add_argument("--budget-s", type=float, default=400.0, help="virtual seconds per run")
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: a temp dir)")
    ap.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="central-dp-"))
    common = [
        f"run.out_dir={out}",
        "lab.compare_sync=false",
        "run.progress=false",
        f"run.budget_s={args.budget_s}",
        f"server.mode={args.mode}",
        f"server.clip_norm={args.clip}",
        *(["server.sample_weighting=false"] if args.mode != "fedasync" else []),
        *args.overrides,
    ]
    rows: list[tuple[str, dict, float]] = []
    s, wall = run(out, "clip", common, [])
    rows.append(("clip only", s, wall))
    for sigma in args.sigmas:
        s, wall = run(out, f"sigma-{sigma:g}", common, [f"server.dp.noise_multiplier={sigma}"])
        rows.append((f"sigma {sigma:g}", s, wall))
    print(
        f"\n{'':10s} {'final acc':>9s} {'best acc':>9s} {'versions':>8s} {'wall s':>7s} "
        f"{'max eps':>10s} {'min eps':>10s}"
    )
    for name, s, wall in rows:
        eps = list(s.get("central_dp", {}).get("epsilon", {}).values())
        hi, lo = (f"{max(eps):10.3g}", f"{min(eps):10.3g}") if eps else (f"{'-':>10s}",) * 2
        print(
            f"{name:10s} {s['final_score']:9.3f} {s['best_score']:9.3f} "
            f"{s['versions']:8d} {wall:7.0f} {hi} {lo}"
        )
    print(f"runs in {out}")
    base = rows[0][1]["final_score"]
    print(f"central_dp_accuracy_ratio={rows[1][1]['final_score'] / base:.3f}")


if __name__ == "__main__":
    main()
