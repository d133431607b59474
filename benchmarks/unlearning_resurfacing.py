"""Does erased influence come back? Each calibration arm against retraining, over seeds.

A verification run (issue 14 §3): one fast silo's training data carries a strong backdoor
(brain-tissue: half its samples get a 12x12 checkerboard trigger and label 1; attack success
rate ≥ 0.9 before the request); at ``--erase-at-s`` virtual seconds it asks to be forgotten
and the federation trains on. Every evaluation verifies the backdoor on the current model
(``lab.backdoor.watch``), in every arm and in retraining, so each arm's backdoor success rate
(ASR) and membership-inference AUC can be compared with retraining's at the same virtual
times after the request.

Scenarios (``--scenarios``):

- ``leftover``: leftover features. From the request on, another fast silo also trains on
  ``--relearn-samples`` of the erased poisoned samples (8, 32, 128); retraining gets the
  same exposure at the same time.
- ``async-state``: the four paths of stale server state at full strength: a 10x straggler
  (``--slowdown``; 30 for the harsher run), FedBuff K=4 with server momentum 0.9, delay
  compensation 0.5, error feedback (top 50%), no staleness bound. Nothing relearns on
  purpose; what comes back comes through stale work and carried state.
- ``reversion``: long training after the erasure with no forget data anywhere (FedAsync).

Arms (``--arms``): ``none`` (no calibration), ``reply`` (today's: each reply projected out of
the erased data's signature as it arrives), ``applied`` (the change each fold applies,
after every correction and the optimiser, with the server's carried state projected at the
boundary; ``protect=both``: signature and the erasure's own jump), ``drop`` (drop all work
based before the boundary, no projection), and retraining from scratch without the silo on
the same seed. More arms: any name in ``ARMS``.

Measures per run, from the request's boundary to the end: the resurfacing gap, mean over
evaluations of max(0, ASR_arm(t) − ASR_retrain(t)) (retraining's series interpolated at the
arm's times), the same for MIA AUC; the reversion ratio ρ at the end (``erasure_watch``);
final test accuracy (mean of the last 3 evaluations) and forget accuracy against retraining
and its noise floor (retrain vs retrain over seeds: landing below it is over-erasure); and
the distances to the retrained model of the same seed at the end, in outputs (mean
Jensen–Shannon divergence of test-set predictions, beside retraining's own floor: retrain vs
retrain over seeds) and in weights (relative L2; same initialisation, so no floor across
seeds); the latency: request → first evaluation within the noise floor of retraining on ASR,
forget accuracy and MIA and within 1 point of the pre-request test accuracy. Over seeds:
mean, spread, and a paired bootstrap 95% CI of each arm's reduction of the uncalibrated
gap. Writes ``runs.csv``, ``summary.csv`` and ``resurfacing.png``; the last line is
``resurfacing_gap_reduction=<x>``: the share of the uncalibrated arm's ASR resurfacing gap
that the default calibration (``lab.erasure.calibration_target`` of the packaged config)
removes, pooled over the scenarios run.

Runs are subprocesses (``fedasync simulate``), ``--jobs`` at a time; a run whose
``summary.json`` exists is not run again (delete the folder, or ``--fresh``), so an
interrupted benchmark goes on where it stopped.

    .venv/bin/python benchmarks/unlearning_resurfacing.py                 # 5 seeds, 2 scenarios
    .venv/bin/python benchmarks/unlearning_resurfacing.py --scenarios leftover --relearn-samples 8,32,128
    .venv/bin/python benchmarks/unlearning_resurfacing.py --scenarios async-state --slowdown 30
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedasync.erasure_metrics import (  # noqa: E402
    noise_floor,
    output_divergence,
    relative_l2,
    resurfacing_gap,
)

ARMS: dict[str, list[str]] = {
    "none": ["lab.erasure.calibration=false"],
    "reply": ["lab.erasure.calibration=true", "lab.erasure.calibration_target=reply"],
    "applied": [
        "lab.erasure.calibration=true",
        "lab.erasure.calibration_target=applied",
        "lab.erasure.protect=both",
    ],
    "applied-subspace": [
        "lab.erasure.calibration=true",
        "lab.erasure.calibration_target=applied",
        "lab.erasure.protect=subspace",
    ],
    "applied-jump": [
        "lab.erasure.calibration=true",
        "lab.erasure.calibration_target=applied",
        "lab.erasure.protect=jump",
    ],
    "drop": ["lab.erasure.calibration=false", "lab.erasure.pre_boundary=drop"],
}
"""Erasure arms: config overrides on top of the scenario's."""

BENCHMARKS: dict[str, list[str]] = {
    # iid: with the natural split the backdoored site's label skew, not the trigger, is what
    # the federation learns from it (ASR = ASR without trigger); a solid bright corner is
    # white matter to the other sites and is not learnt either (measured before this script)
    "brain-tissue": [
        "data.partition=iid",
        "silos.count=4",
        "client.lr=0.1",
        "server.alpha=0.6",
        "lab.backdoor.fraction=0.5",
        "lab.backdoor.target_label=1",
        "lab.backdoor.trigger_size=12",
        "lab.backdoor.trigger_pattern=checker",
    ],
    "nuclei": [
        "silos.count=4",
        "lab.backdoor.fraction=0.5",
        "lab.backdoor.target_label=0",
        "lab.backdoor.trigger_size=16",
        "lab.backdoor.trigger_pattern=checker",
    ],
}
"""Per benchmark: the federation and a backdoor strong enough to resurface."""

FORGETTING = ("bd_asr", "bd_mia_auc", "bd_forget_accuracy")
"""Forgetting metrics read from the ``eval`` events (``lab.backdoor.watch``)."""
LATENCY_GAP = 0.01
EFFECTIVE_MARGIN = 0.1
"""An erasure is effective when its ASR at the boundary is at most retraining's + this."""
"""The latency's accuracy condition: within 1 point of the pre-request test accuracy."""


@dataclass
class Run:
    """One simulation: a scenario, an arm (or ``retrain``), a seed."""

    scenario: str
    arm: str
    seed: int
    variant: str
    overrides: list[str]
    folder: Path
    result: dict[str, Any] = field(default_factory=dict)


def _fast_silos(count: int, fraction: float, slowdown: float, seed: int) -> list[int]:
    """The silos that are not stragglers on ``seed`` (the server draws them the same way)."""
    from server.clock import silo_speeds
    from server.config import SilosConfig
    from server.config_lab import SpeedLab

    speeds = silo_speeds(
        SilosConfig(count=count),
        SpeedLab(profile="stragglers", straggler_fraction=fraction, straggler_slowdown=slowdown),
        seed,
    )
    return [i for i, s in enumerate(speeds) if s == 1.0]


def _scenario(name: str, variant: str, args: argparse.Namespace, seed: int) -> list[str]:
    """The scenario's overrides; ``variant`` is its parameter (samples, slowdown)."""
    count = int(
        next(o for o in BENCHMARKS[args.benchmark] if o.startswith("silos.count=")).split("=")[1]
    )
    slowdown = float(variant) if name == "async-state" else 10.0
    fast = _fast_silos(count, 0.25, slowdown, seed)
    silo, peer = fast[0], fast[1]
    out = [
        f"lab.speed.straggler_slowdown={slowdown}",
        f"lab.backdoor.silo={silo}",
        f"erasures=[{{silo: {silo}, at_s: {args.erase_at_s}}}]",
    ]
    if name == "leftover":
        out += [
            f"lab.backdoor.relearn_silo={peer}",
            f"lab.backdoor.relearn_after_s={args.erase_at_s}",
            f"lab.backdoor.relearn_samples={int(variant)}",
        ]
    elif name == "async-state":
        out += [
            "server.mode=fedbuff",
            "server.buffer_size=4",
            "server.optimizer.kind=momentum",
            "server.optimizer.momentum=0.9",
            "server.optimizer.lr=0.3",
            "lab.corrections.delay_compensation=0.5",
            "lab.corrections.error_feedback_topk=0.5",
        ]
    elif name != "reversion":
        raise SystemExit(f"unknown scenario {name!r}: leftover, async-state or reversion")
    return out


def _variants(name: str, args: argparse.Namespace) -> list[str]:
    if name == "leftover":
        return args.relearn_samples.split(",")
    if name == "async-state":
        return args.slowdown.split(",")
    return ["-"]


def plan(args: argparse.Namespace) -> list[Run]:
    """Every run the benchmark needs, retraining first (it is each comparison's reference)."""
    arms = args.arms.split(",")
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"unknown arm {a!r}: one of {', '.join(ARMS)}")
    base = [
        f"data.benchmark={args.benchmark}",
        *BENCHMARKS[args.benchmark],
        "lab.speed.profile=stragglers",
        "lab.speed.straggler_fraction=0.25",
        "server.eval_every=5",
        "server.checkpoint_every=0",
        "server.evaluate_silos=false",
        "server.max_staleness=null",
        "lab.compare_sync=false",
        "run.progress=false",
        "lab.backdoor.enabled=true",
        "lab.backdoor.watch=true",
        "lab.erasure.relearn_versions=100000",  # watched to the end, verified at the end
        "unlearning.steps=20",  # a strong erasure: 5 steps left ASR 0.74 at the boundary
        "lab.erasure.watch_every=5",
    ]
    runs: list[Run] = []
    for scen in args.scenarios.split(","):
        budget = args.erase_at_s + (args.reversion_s if scen == "reversion" else args.after_s)
        for variant in _variants(scen, args):
            for seed in range(args.seed0, args.seed0 + args.seeds):
                sc = _scenario(scen, variant, args, seed)
                common = base + [f"run.seed={seed}", f"run.budget_s={budget}"]
                silo = next(o for o in sc if o.startswith("lab.backdoor.silo=")).split("=")[1]
                for arm in ["retrain", *arms]:
                    if arm == "retrain":
                        extra = [o for o in sc if not o.startswith("erasures=")]
                        extra += [f"lab.exclude=[{silo}]"]
                    else:
                        extra = sc + ARMS[arm]
                    folder = Path(args.out) / args.benchmark / scen / variant / f"s{seed}"
                    over = common + extra + [f"run.out_dir={folder}", f"run.name={arm}"]
                    runs.append(Run(scen, arm, seed, variant, over, folder / arm))
    return runs


def execute(run: Run, fresh: bool) -> float:
    """Run ``run`` as ``fedasync simulate`` (unless its summary exists); wall seconds."""
    if (run.folder / "summary.json").exists() and not fresh:
        return 0.0
    run.folder.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "simulations.cli", "simulate", *run.overrides]
    with open(run.folder.parent / f"{run.arm}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{run.folder} failed (rc {rc}): see {run.folder.parent / run.arm}.log")
    return time.monotonic() - t0


def read(run: Run) -> dict[str, Any]:
    """The run's evaluations (t, score and the backdoor metrics), the erasure's boundary time
    and request time, and its last reversion ratio."""
    evals, rho = [], None
    with open(run.folder / "metrics.jsonl") as f:
        for line in f:
            e = json.loads(line)
            if e["event"] == "eval" and "bd_asr" in e:
                evals.append(e)
            elif e["event"] == "erasure_watch" and e.get("reversion_ratio") is not None:
                rho = e["reversion_ratio"]
    summary = json.loads((run.folder / "summary.json").read_text())
    out: dict[str, Any] = {"evals": evals, "rho": rho}
    applied = summary.get("erasures", {}).get("applied", [])
    if applied:
        a = applied[0]
        out["request_t"] = a["submitted_t"]
        out["boundary_t"] = a["submitted_t"] + a["erasure_latency_s"]
        out["asr_at_boundary"] = a.get("at_boundary", {}).get("asr")
    return out


def _series(evals: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    return np.array([e["t"] for e in evals]), np.array([e[key] for e in evals], dtype=float)


def measure(run: Run, ref: Run, floors: dict[str, float]) -> dict[str, Any]:
    """An erased arm's figures against the retraining run ``ref`` on the same seed."""
    r, g = run.result, ref.result
    if "boundary_t" not in r:
        return {"applied": False}
    after = [e for e in r["evals"] if e["t"] >= r["boundary_t"]]
    row: dict[str, Any] = {"applied": True, "rho_end": r["rho"]}
    for key in FORGETTING:
        rt, rv = _series(g["evals"], key)
        at, av = _series(after, key)
        ret = np.interp(at, rt, rv)
        row[f"gap_{key}"] = resurfacing_gap(av.tolist(), ret.tolist())
        row[f"end_{key}"] = float(av[-3:].mean()) if len(av) else math.nan
        row[f"end_{key}_retrain"] = float(rv[-3:].mean())
    if "logits" in r and "logits" in g:  # distances to the retrained model, same seed
        row["js_to_retrain"] = output_divergence(r["logits"], g["logits"])["js"]
        row["l2_to_retrain"] = relative_l2(r["params"], g["params"])
    st, sv = _series(r["evals"], "score")
    row["test_end"] = float(sv[-3:].mean())
    row["test_end_retrain"] = float(_series(g["evals"], "score")[1][-3:].mean())
    pre = sv[st <= r["request_t"]][-5:]
    row["pre_request_accuracy"] = float(pre.mean()) if len(pre) else math.nan
    row["asr_at_request"] = float(_series(r["evals"], "bd_asr")[1][st <= r["request_t"]][-1])
    row["asr_at_boundary"] = r.get("asr_at_boundary")
    # effective: the erasure itself took the backdoor down to retraining's level (+0.1) at the
    # boundary; where it did not, the gap is the erasure's failure, the same in every arm
    rt, rv = _series(g["evals"], "bd_asr")
    at_b = float(np.interp(r["boundary_t"], rt, rv))
    row["effective"] = r.get("asr_at_boundary") is not None and (
        r["asr_at_boundary"] <= at_b + EFFECTIVE_MARGIN
    )
    row["latency_s"] = latency_within_floor(
        r["evals"], g["evals"], floors, r["request_t"], r["boundary_t"], row["pre_request_accuracy"]
    )
    # retraining's: from scratch to the same accuracy (it is within its own noise floor)
    gt, gv = _series(g["evals"], "score")
    hit = gt[gv >= row["pre_request_accuracy"] - LATENCY_GAP]
    row["retrain_latency_s"] = float(hit[0]) if len(hit) else math.nan
    return row


def final_outputs(runs: list[Run]) -> None:
    """Each run's final model (``checkpoint.pt``): its parameters and its logits on the test
    set, into ``run.result`` (``params``, ``logits``), for the distances to retraining."""
    import torch

    from server.benchmark import federation, initial_model
    from server.checkpoint import load_state
    from simulations.config import load_config

    test_images: dict[str, torch.Tensor] = {}
    for run in runs:
        cfg = load_config(None, run.overrides)
        if cfg.data.benchmark not in test_images:
            test_images[cfg.data.benchmark] = torch.as_tensor(federation(cfg).test.images)
        model = initial_model(cfg)
        params = load_state(run.folder / "checkpoint.pt").params
        model.load_state_dict(params)
        model.eval()
        with torch.no_grad():
            run.result["logits"] = model(test_images[cfg.data.benchmark].float())
        run.result["params"] = params


def output_floor(retrains: list[Run]) -> float:
    """Retraining's noise floor in outputs: the mean Jensen–Shannon divergence between the
    test-set predictions of retrained models on different seeds."""
    js = [
        output_divergence(a.result["logits"], b.result["logits"])["js"]
        for i, a in enumerate(retrains)
        for b in retrains[i + 1 :]
    ]
    return float(np.mean(js)) if js else math.nan


def retrain_floors(retrains: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Each forgetting metric's retraining noise floor: retrain vs retrain over seeds (the
    mean of the last 3 evaluations of each retraining run, ``fedasync.erasure_metrics``)."""
    return {
        key: noise_floor([float(_series(ev, key)[1][-3:].mean()) for ev in retrains])
        for key in FORGETTING
    }


def latency_within_floor(
    evals: list[dict[str, Any]],
    retrain: list[dict[str, Any]],
    floors: dict[str, float],
    request_t: float,
    boundary_t: float,
    pre: float,
) -> float:
    """Request → first evaluation after the boundary within retraining's noise floor on every
    forgetting metric (against retraining's value at that time, interpolated; a floor under
    0.01 counts as 0.01) and within 1 point of ``pre``, the pre-request test accuracy (issue
    14 §5). NaN: not within the run."""
    ref = {key: _series(retrain, key) for key in FORGETTING}
    for e in evals:
        if e["t"] < boundary_t or e["score"] < pre - LATENCY_GAP:
            continue
        if all(
            abs(e[k] - float(np.interp(e["t"], *ref[k]))) <= max(floors[k], 0.01)
            for k in FORGETTING
        ):
            return float(e["t"] - request_t)
    return math.nan


def bootstrap_reduction(
    base: list[float], arm: list[float], n: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """1 − mean(arm)/mean(base) over paired seeds, with a 95% percentile bootstrap CI
    (resampling seeds). NaN when the base gap is zero."""
    b, a = np.asarray(base, dtype=float), np.asarray(arm, dtype=float)
    if len(b) == 0 or b.mean() <= 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(b), size=(n, len(b)))
    bm, am = b[idx].mean(axis=1), a[idx].mean(axis=1)
    ok = bm > 0
    boot = 1.0 - am[ok] / bm[ok]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(1.0 - a.mean() / b.mean()), float(lo), float(hi)


def bootstrap_mean_ci(values: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap CI of the mean over seeds."""
    v = np.asarray(values, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(v), size=(n, len(v)))
    lo, hi = np.percentile(v[idx].mean(axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def default_arm() -> str:
    """The arm that is the packaged config's calibration (its target and what it protects)."""
    from simulations.config import load_config

    u = load_config(None, []).lab.erasure
    if u.calibration_target == "reply":
        return "reply"
    return {"both": "applied", "subspace": "applied-subspace", "jump": "applied-jump"}.get(
        str(u.protect), "applied"
    )


def main() -> None:
    """Plan, run (resumable), measure and report."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--benchmark", default="brain-tissue", choices=list(BENCHMARKS))
    ap.add_argument("--scenarios", default="leftover,async-state")
    ap.add_argument("--arms", default="none,reply,applied,applied-jump,drop")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--erase-at-s", type=float, default=200.0)
    ap.add_argument("--after-s", type=float, default=150.0, help="training after the request")
    ap.add_argument("--reversion-s", type=float, default=500.0, help="the same, for reversion")
    ap.add_argument(
        "--relearn-samples", default="32", help="leftover: poisoned samples, e.g. 8,32,128"
    )
    ap.add_argument("--slowdown", default="10", help="async-state: straggler slowdowns, e.g. 10,30")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time")
    ap.add_argument("--fresh", action="store_true", help="run again even where results exist")
    ap.add_argument(
        "--no-distances",
        dest="distances",
        action="store_false",
        help="skip the distances to retraining in outputs and weights (final checkpoints)",
    )
    ap.add_argument("--out", default="runs/bench-resurfacing")
    args = ap.parse_args()
    runs = plan(args)
    print(f"{len(runs)} runs ({args.jobs} at a time) under {args.out}/{args.benchmark}", flush=True)
    t0, done = time.monotonic(), 0

    def one(run: Run) -> None:
        nonlocal done
        wall = execute(run, args.fresh)
        done += 1
        print(
            f"[{done}/{len(runs)}] {run.scenario}/{run.variant} s{run.seed} {run.arm}: "
            f"{wall:.0f}s wall ({time.monotonic() - t0:.0f}s in all)",
            flush=True,
        )

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, runs))
    for run in runs:
        run.result = read(run)
    if args.distances:
        final_outputs(runs)
    report(runs, args)


def report(runs: list[Run], args: argparse.Namespace) -> None:
    """Per-run rows, per-arm summaries over seeds, the plot and the last line."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.scenario, run.variant), []).append(run)
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    pooled: dict[str, dict[tuple[str, str, int], float]] = {}
    for (scen, variant), group in groups.items():
        refs = {r.seed: r for r in group if r.arm == "retrain"}
        floors = retrain_floors([r.result["evals"] for r in refs.values()])
        js_floor = output_floor(list(refs.values())) if args.distances else math.nan
        per_arm: dict[str, dict[int, dict[str, Any]]] = {}
        for run in group:
            if run.arm == "retrain":
                continue
            m = measure(run, refs[run.seed], floors)
            rows.append(
                {"scenario": scen, "variant": variant, "arm": run.arm, "seed": run.seed, **m}
            )
            if m["applied"]:
                per_arm.setdefault(run.arm, {})[run.seed] = m
        none = per_arm.get("none", {})
        for arm, by_seed in per_arm.items():
            ms = list(by_seed.values())
            gaps = [m["gap_bd_asr"] for m in ms]
            for seed, m in by_seed.items():
                pooled.setdefault(arm, {})[(scen, variant, seed)] = m["gap_bd_asr"]
                if m["effective"]:
                    eff_key = f"{arm}@effective"
                    pooled.setdefault(eff_key, {})[(scen, variant, seed)] = m["gap_bd_asr"]
            s: dict[str, Any] = {
                "scenario": scen,
                "variant": variant,
                "arm": arm,
                "seeds": len(ms),
                "asr_at_request": _mean(m["asr_at_request"] for m in ms),
                "gap_asr": _mean(gaps),
                "gap_asr_sd": _sd(gaps),
                "gap_asr_ci": bootstrap_mean_ci(gaps),
                "gap_mia": _mean(m["gap_bd_mia_auc"] for m in ms),
                "rho_end_median": _median(m["rho_end"] for m in ms),
                "test_end": _mean(m["test_end"] for m in ms),
                "test_end_sd": _sd([m["test_end"] for m in ms]),
                "test_end_retrain": _mean(m["test_end_retrain"] for m in ms),
                "forget_end": _mean(m["end_bd_forget_accuracy"] for m in ms),
                "forget_end_retrain": _mean(m["end_bd_forget_accuracy_retrain"] for m in ms),
                "forget_floor": floors["bd_forget_accuracy"],
                "js_to_retrain": _mean(m.get("js_to_retrain") for m in ms),
                "js_floor": js_floor,
                "l2_to_retrain": _mean(m.get("l2_to_retrain") for m in ms),
                "latency_s_median": _median(m["latency_s"] for m in ms),
                "retrain_latency_s_median": _median(m["retrain_latency_s"] for m in ms),
            }
            s["effective"] = sum(bool(m["effective"]) for m in ms)
            paired = sorted(set(by_seed) & set(none))
            if arm != "none" and paired:
                s["reduction"] = bootstrap_reduction(
                    [none[k]["gap_bd_asr"] for k in paired],
                    [by_seed[k]["gap_bd_asr"] for k in paired],
                )
                eff = [k for k in paired if none[k]["effective"]]
                if eff:
                    s["reduction_effective"] = bootstrap_reduction(
                        [none[k]["gap_bd_asr"] for k in eff],
                        [by_seed[k]["gap_bd_asr"] for k in eff],
                    )
            summary.append(s)
    out = Path(args.out) / args.benchmark
    _write(out / "runs.csv", rows)
    _write(out / "summary.csv", summary)
    _print(summary)
    _plot(groups, out / "resurfacing.png", args)
    print(f"results: {out / 'runs.csv'}, {out / 'summary.csv'}, {out / 'resurfacing.png'}")
    default = default_arm()
    none, ours = pooled.get("none", {}), pooled.get(default, {})
    keys = sorted(set(none) & set(ours))
    red = bootstrap_reduction([none[k] for k in keys], [ours[k] for k in keys])
    print(
        f"default calibration: {default}; its reduction of the uncalibrated ASR gap, pooled "
        f"over scenarios: {red[0]:.2f} (95% CI {red[1]:.2f} .. {red[2]:.2f})"
    )
    for arm in sorted(a for a in pooled if "@" not in a and a != "none"):
        mine = pooled[arm]
        k = sorted(set(none) & set(mine))
        r = bootstrap_reduction([none[x] for x in k], [mine[x] for x in k])
        ke = sorted(set(pooled.get("none@effective", {})) & set(mine))
        re_ = bootstrap_reduction([none[x] for x in ke], [mine[x] for x in ke])
        print(
            f"  {arm:16s} reduction of the uncalibrated gap, pooled: {_fmt(r)} over {len(k)} "
            f"runs; where the erasure was effective: {_fmt(re_)} over {len(ke)}"
        )
    print(f"resurfacing_gap_reduction={red[0]:.3f}")


def _mean(values: Any) -> float:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else math.nan


def _median(values: Any) -> float:
    v = [x for x in values if x is not None and not math.isnan(x)]
    return float(np.median(v)) if v else math.nan


def _sd(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted(
        {k for r in rows for k in r},
        key=lambda k: (k not in ("scenario", "variant", "arm", "seed"), k),
    )
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        return "(" + " .. ".join(_fmt(x) for x in v) + ")"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def _print(summary: list[dict[str, Any]]) -> None:
    cols = [
        "seeds",
        "effective",
        "asr_at_request",
        "gap_asr",
        "gap_asr_sd",
        "gap_asr_ci",
        "reduction",
        "reduction_effective",
        "gap_mia",
        "rho_end_median",
        "test_end",
        "test_end_retrain",
        "forget_end",
        "forget_end_retrain",
        "forget_floor",
        "js_to_retrain",
        "js_floor",
        "l2_to_retrain",
        "latency_s_median",
        "retrain_latency_s_median",
    ]
    for s in summary:
        head = f"{s['scenario']}/{s['variant']} {s['arm']}"
        print(f"{head:28s} " + "  ".join(f"{c}={_fmt(s.get(c, '-'))}" for c in cols))


def _plot(groups: dict[tuple[str, str], list[Run]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 3.8), squeeze=False)
    colours = {
        "retrain": "black",
        "none": "tab:red",
        "reply": "tab:orange",
        "applied": "tab:blue",
        "drop": "tab:green",
    }
    for ax, ((scen, variant), group) in zip(axes[0], groups.items()):
        arms = sorted({r.arm for r in group}, key=lambda a: a != "retrain")
        grid = np.linspace(0.0, max(r.result["evals"][-1]["t"] for r in group), 60)
        for arm in arms:
            ys = []
            for r in group:
                if r.arm == arm:
                    t, v = _series(r.result["evals"], "bd_asr")
                    ys.append(np.interp(grid, t, v))
            m = np.mean(ys, axis=0)
            ax.plot(grid, m, label=f"{arm} (n={len(ys)})", color=colours.get(arm))
            if len(ys) > 1:
                sd = np.std(ys, axis=0, ddof=1)
                ax.fill_between(grid, m - sd, m + sd, alpha=0.12, color=colours.get(arm))
        ax.axvline(args.erase_at_s, color="grey", ls="--", lw=1)
        ax.set_title(f"{scen} ({variant})")
        ax.set_xlabel("virtual seconds (request: dashed)")
        ax.set_ylabel("backdoor ASR, mean ± sd over seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Resurfacing of an erased backdoor on {args.benchmark}: arms vs retraining")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
