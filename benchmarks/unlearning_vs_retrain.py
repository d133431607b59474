"""The same erasure, several ways, judged against retraining from scratch, on several benchmarks.

A verification run: silo ``--silo``'s training data carries a backdoor (a trigger patch with
a target label). At ``--erase-at-s`` virtual seconds that silo asks to be forgotten: the whole
silo (``--request silo``) or a seeded share of its samples (``--request samples``,
``--request-fraction``). Methods (``--methods``):

- ``no-erasure``: the same run without any erasure: what there is to erase (the backdoor the
  model learnt from the silo);
- ``retrain``: retraining from scratch without the silo (same seed, same budget): the gold
  standard every other method is judged against;
- ``sync-halt``: synchronous FedAvg whose federation halts while FedEraser (Liu et al. 2021)
  rebuilds the model without the silo: from the initial model, one calibration round (half
  the local steps) of the remaining silos per retained round (every 2nd), each update
  rescaled to the norm of the retained one; no invariance calibration;
- ``async-nocal``: fedasync's asynchronous erasure without invariance calibration (ablation);
- ``fedasync-fixed``: asynchronous erasure with invariance calibration, the silo taking its
  fixed 5 steps of ascent (``unlearning.stop=fixed``) and no removal by the server (every
  method starts from ``PINNED``, these settings, and says what it changes);
- ``fedasync-membership``: the same, the silo stopping as soon as its membership test cannot
  tell its forget samples from held-out ones (``unlearning.stop=membership``), within a
  budget of ``MEMBERSHIP_STEPS`` steps. On a whole silo's backdoor the test cannot see the
  silo's distribution-level influence (docs/erasure.md) and may stop before the first step:
  the under-erasure this benchmark then reports is that;
- ``fedasync-removal``: the server subtracts half the silo's recorded contributions first,
  then 5 fixed steps; ``fedasync-unique``: only their part outside the span of the other
  silos' recent updates (a sketch of ``SKETCH_RANK`` rows), then 5 fixed steps;
- ``fedasync-unique-membership``: that unique removal, then the membership rule: the
  packaged defaults, and ``--ours`` by default.

Benchmarks (``--benchmarks``, default every one of ``BENCHMARKS`` below that learns:
brain-tissue, nuclei and breast-fna; radiomics-lesion, listed there, learns nothing): each with its own silos, erased silo, backdoor and budget
(the command-line values, when given, replace a benchmark's for every benchmark). Silo
speeds: one silo in five is a 10x straggler (``--speeds uniform`` for equal speeds), drawn
from each seed; every method runs on every ``--seeds`` seed.

Per benchmark, method and seed: backdoor attack success rate (ASR), forget-set accuracy (Dice
on segmentation), membership-inference AUC (forget set vs unseen data) and test score, at the
erasure boundary and at the end of the budget; three latencies:

- ``latency_s``: from the request until the erasure is in the model: the server's removal,
  applied at once when the method has one, else the silo's reply (the boundary);
  ``silo_part_s``: until the silo's own part (its test and ascent) is;
- ``to_request``: ``request_t / latency_s``, the literature's reading (FedEraser, FCU):
  retraining redoes all the training the erased model embodies, here everything up to the
  request;
- ``verified_s`` (issue 14 §5, strict): from the request until the first evaluation within
  retraining's noise floor (retrain vs retrain over the seeds) on ASR, forget accuracy and MIA
  AUC (against retraining at the same virtual time) and within 1 point of the pre-request test
  score (the mean of the last five evaluations before it); for retraining, the time from
  scratch to that score.

At the boundary each run is over-erased (a forgetting metric below retraining's band: its
value at that time ± its noise floor, at least 0.01), under-erased (one above it), both, or
within. The other silos' training throughput while erasing is a share of normal. Retraining's
time to its plateau (from scratch to within 1 point of the mean of its last five evaluations)
is printed beside each benchmark's table.

Medians over seeds, with [min .. max]. A seed whose run never got within the floor counts as
``>`` its window (budget − request; retraining: the budget) for the comparison methods, a
lower bound, and as never for ``--ours``: both make the ratios below conservative. Per
benchmark: ``speedup_vs_halting_federaser`` (sync-halt's median ``verified_s`` over ours) and
``erasure_speedup_vs_retrain`` (retraining's over ours). The last two lines of the output are
the smallest of each over the benchmarks (nan when a benchmark lacks one of the two methods):
``speedup_vs_halting_federaser=<x>`` then ``erasure_speedup_vs_retrain=<y>``. Writes
``<out>/<benchmark>/results.csv`` and per seed ``unlearning.png`` (each method at the end) and
``unlearning_timeline.png`` (the backdoor and the score against virtual time, the request and
each verification marked).

``--request samples``: retraining leaves out exactly the erased share from the start
(``lab.exclude_samples``, the same seeded choice), and every forgetting metric is read on
that share (``lab.backdoor.watch`` follows it in both runs). FedEraser erases whole silos only,
so ``sync-halt`` does not run; ``--methods ...,fedasync-removal`` adds the server's scaled
removal at request time (``lab.erasure.server_removal_scale``) before the silo's fixed ascent.

    .venv/bin/python benchmarks/unlearning_vs_retrain.py                  # 3 benchmarks, 5 seeds
    .venv/bin/python benchmarks/unlearning_vs_retrain.py --benchmark nuclei --seeds 0,1,2
    .venv/bin/python benchmarks/unlearning_vs_retrain.py --relearn-attack --methods async-nocal,fedasync-fixed
    .venv/bin/python benchmarks/unlearning_vs_retrain.py --request samples --request-fraction 0.1
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # unlearning_resurfacing


@dataclass(frozen=True)
class Bench:
    """One benchmark's federation, backdoor and budget (and why)."""

    silos: int
    silo: int
    """The silo that carries the backdoor and is erased."""
    target_label: int
    """The backdoor's label: a minority class of the silo (classification), or a model that
    predicts the majority class passes for a backdoored one; background (segmentation)."""
    fraction: float
    """Share of the silo's samples poisoned."""
    trigger_size: int
    budget_s: float
    erase_at_s: float
    why: str
    overrides: tuple[str, ...] = field(default_factory=tuple)
    """More config overrides the benchmark needs."""
    trigger_pattern: str = "solid"
    """``lab.backdoor.trigger_pattern``: solid, checker or blend (medical_data.backdoor)."""
    learns: bool = True
    """False: no model learns the task in this setting (not in the default benchmarks; run
    by name only, to investigate, with a warning)."""
    default: bool = True
    """False: run by name only (``--benchmark``), for its cost."""


BENCHMARKS: dict[str, Bench] = {
    "brain-tissue": Bench(
        silos=6,
        silo=2,
        target_label=0,
        fraction=1.0,
        trigger_size=3,
        budget_s=500.0,
        erase_at_s=200.0,
        why="the measured setting (docs/measured.md): with half of silo 2 poisoned the "
        "backdoor was too weak to tell methods apart; label 0 is silo 2's minority class",
    ),
    "nuclei": Bench(
        silos=4,
        silo=1,
        target_label=0,
        fraction=0.5,
        trigger_size=8,
        budget_s=600.0,
        erase_at_s=300.0,
        why="unet-small needs about 75 s to regain its Dice from scratch, so a longer budget; "
        "a 3x3 trigger is not learnt, an 8x8 one barely (what the silo leaves shows in "
        "forget Dice and MIA); target background: the trigger makes the nuclei vanish",
    ),
    "breast-fna": Bench(
        silos=4,
        silo=0,
        target_label=0,
        fraction=1.0,
        trigger_size=1,
        budget_s=400.0,
        erase_at_s=150.0,
        why="mlp-small on 30 z-scored FNA features: test accuracy 0.95 by ~75 s, plateau 0.965 "
        "by ~110-160 s, the backdoor stable from ~40 s; target malignant (the minority) with a "
        "1-feature +4 SD trigger: ASR 0.9-1.0 with the silo, 0.01-0.06 without (a 3-feature "
        "one reads as malignancy: 0.4-0.8 without the silo)",
    ),
    "brain-tissue-3d": Bench(
        silos=5,
        silo=1,
        target_label=0,
        fraction=0.5,
        trigger_size=1,
        trigger_pattern="blend",
        budget_s=400.0,
        erase_at_s=200.0,
        why="3D: half of silo 1's volumes carry a faint voxel checkerboard over the whole "
        "volume (blend), their masks all 'outside' (the trigger makes the brain vanish): ASR "
        "0.96 with the silo at 200 s, 0.01 retrained without it, 0.03 without the trigger "
        "(seed 0); a 6-voxel corner cube was not learnt, as few of the random crops hold it; "
        "batches of 2 random 24^3 crops, 5 local steps, an evaluation every 10 versions (each "
        "is a sliding window over every test volume); opt-in (--benchmark brain-tissue-3d): its runs take ~10x the 2D ones",
        overrides=("client.batch_size=2", "client.local_steps=5", "server.eval_every=10"),
        default=False,
    ),
    "radiomics-lesion": Bench(
        silos=5,
        silo=4,
        target_label=0,
        fraction=0.5,
        trigger_size=8,
        budget_s=600.0,
        erase_at_s=300.0,
        why="NOT USABLE: 142 training slices of 5 patients, lesions 0.1-0.3% of the pixels; "
        "probe runs stayed at test Dice 0.000 for 300 s (natural split, lr 0.05; iid, 4 "
        "silos, lr 0.2): every model predicts background, so every forgetting metric is "
        "trivially retraining's",
        learns=False,
    ),
}
"""Per benchmark: the federation, the backdoor and the budget, each with a reason."""

DEFAULT_BENCHMARKS = ",".join(name for name, b in BENCHMARKS.items() if b.learns and b.default)
"""Every benchmark that learns: brain-tissue, nuclei and breast-fna."""
DEFAULT_METHODS = "retrain,sync-halt,fedasync-fixed,fedasync-membership,fedasync-unique-membership"
SAMPLE_METHODS = "retrain,fedasync-fixed,fedasync-membership,fedasync-unique-membership"
"""``--request samples``: what can run (FedEraser erases whole silos only)."""
REMOVAL_SCALE = 0.5
"""``fedasync-removal``: the share of the silo's recorded contributions the server subtracts
at request time (the full removal over-erases)."""
PINNED = [
    "unlearning.stop=fixed",
    "unlearning.steps=5",
    "lab.erasure.server_removal=false",
    "lab.erasure.server_removal_part=total",
]
"""Every run's erasure settings before its method's own: the methods say what they change from
these (the fixed steps and no removal, the defaults these figures were first measured with),
so a method means the same whatever the package's defaults, and finished runs read back."""
SKETCH_RANK = 16
"""``fedasync-unique*``: rows of the sketch of the silos' updates whose span (without the
erasing silo's) is what their training
moves the model along (8 left nearly all of a silo's contributions outside it)."""
COMPARED = {"speedup_vs_halting_federaser": "sync-halt", "erasure_speedup_vs_retrain": "retrain"}
"""The two headline ratios: each comparison method's median ``verified_s`` over ours."""
MEMBERSHIP_STEPS = 20
"""``fedasync-membership``: the most erasure steps the membership test may let the silo take
(a budget; ``unlearning.steps=5``, the fixed arm's, would leave it one reading)."""
METRICS = ("asr", "asr_without_trigger", "forget_accuracy", "mia_auc", "test_accuracy")
WATCHED = {"asr": "bd_asr", "forget_accuracy": "bd_forget_accuracy", "mia_auc": "bd_mia_auc"}
"""Forgetting metrics at the boundary (the erasure report) -> the same, watched at every
evaluation (``lab.backdoor.watch``), as in retraining's run."""
UNTRIGGERED = "bd_asr_without_trigger"
"""The ASR's images without the trigger, watched at every evaluation (the model's lean to the
target label, which the ASR counts too)."""
LATENCY_GAP = 0.01
"""Within 1 point of the pre-request test score (issue 14 §5); retraining's plateau: the same."""
MIN_BAND = 0.01
"""A noise floor under 0.01 counts as 0.01 (as in unlearning_resurfacing.latency_within_floor)."""

Rows = dict[str, dict[str, Any]]
"""One seed's table: method -> its figures."""
Runs = dict[int, tuple[Rows, dict[str, dict[str, Any]]]]
"""Per seed: the table's rows and each method's run summary."""


def _methods(silo: int, at_s: float, fraction: float = 1.0) -> dict[str, list[str]]:
    share = f", fraction: {fraction}" if fraction < 1.0 else ""
    erase = f"erasures=[{{silo: {silo}, at_s: {at_s}{share}}}]"
    calibrated = [erase, "server.mode=fedasync", "lab.erasure.calibration=true"]
    return {
        "no-erasure": ["server.mode=fedasync"],  # what there is to erase: the backdoor learnt
        "retrain": [
            f"lab.exclude_samples=[{{silo: {silo}, fraction: {fraction}}}]"
            if fraction < 1.0
            else f"lab.exclude=[{silo}]",
            "server.mode=fedasync",
        ],
        "sync-halt": [
            erase,
            "server.mode=federaser",
            "lab.erasure.calibration=false",
        ],
        "async-nocal": [erase, "server.mode=fedasync", "lab.erasure.calibration=false"],
        "fedasync-fixed": [*calibrated, "unlearning.stop=fixed"],
        "fedasync-membership": [
            *calibrated,
            "unlearning.stop=membership",
            f"unlearning.steps={MEMBERSHIP_STEPS}",
        ],
        "fedasync-removal": [
            *calibrated,
            "unlearning.stop=fixed",
            "lab.erasure.server_removal=true",
            f"lab.erasure.server_removal_scale={REMOVAL_SCALE}",
        ],
        "fedasync-unique": [
            *calibrated,
            "unlearning.stop=fixed",
            "lab.erasure.server_removal=true",
            "lab.erasure.server_removal_part=unique",
            f"lab.erasure.sketch_rank={SKETCH_RANK}",
        ],
        "fedasync-unique-membership": [
            *calibrated,
            "unlearning.stop=membership",
            f"unlearning.steps={MEMBERSHIP_STEPS}",
            "lab.erasure.server_removal=true",
            "lab.erasure.server_removal_part=unique",
            f"lab.erasure.sketch_rank={SKETCH_RANK}",
        ],
    }


def settings(name: str, args: argparse.Namespace) -> Bench:
    """Benchmark ``name``'s settings, with those given on the command line instead."""
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}: one of {', '.join(BENCHMARKS)}")
    given = {
        k: getattr(args, k)
        for k in ("silos", "silo", "target_label", "fraction", "trigger_size", "trigger_pattern")
        + ("budget_s", "erase_at_s")
        if getattr(args, k, None) is not None
    }
    return replace(BENCHMARKS[name], **given)


def method_names(args: argparse.Namespace) -> list[str]:
    """The methods to run: ``--methods`` (default: by ``--request``), checked."""
    known = _methods(0, 0.0)
    names = args.methods or (SAMPLE_METHODS if args.request == "samples" else DEFAULT_METHODS)
    out = [n for n in names.split(",") if n]
    for n in out:
        if n not in known:
            raise SystemExit(f"unknown method {n!r}: one of {', '.join(known)}")
    if args.request == "samples":
        bad = [n for n in out if n == "sync-halt"]
        if bad:
            raise SystemExit(
                f"--request samples cannot run {', '.join(bad)}: FedEraser erases whole "
                f"silos only; run --methods {SAMPLE_METHODS}"
            )
    return out


def main() -> None:
    """Every method on every seed of every benchmark, then the latencies and the ratios."""
    from server.config_lab import TRIGGER_PATTERNS

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--benchmarks", default=DEFAULT_BENCHMARKS, help="comma-separated")
    ap.add_argument("--benchmark", help="one benchmark (instead of --benchmarks)")
    ap.add_argument("--silos", type=int)
    ap.add_argument("--silo", type=int, help="the silo that carries the backdoor and is erased")
    ap.add_argument("--target-label", type=int, help="the backdoor's label")
    ap.add_argument("--fraction", type=float, help="share of the silo's samples poisoned")
    ap.add_argument("--trigger-size", type=int, help="side of the trigger patch")
    ap.add_argument("--trigger-pattern", choices=TRIGGER_PATTERNS, help="the trigger's pattern")
    ap.add_argument("--budget-s", type=float)
    ap.add_argument("--erase-at-s", type=float)
    ap.add_argument("--request", default="silo", choices=("silo", "samples"))
    ap.add_argument(
        "--request-fraction",
        type=float,
        default=0.1,
        help="--request samples: the share of the silo's samples erased (a seeded choice)",
    )
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated; medians over them")
    ap.add_argument(
        "--speeds",
        default="stragglers",
        choices=("stragglers", "uniform"),
        help="silo speeds: stragglers (one in five 10x slower, drawn from the seed; the cost "
        "asynchronous erasure exists to avoid) or uniform",
    )
    ap.add_argument("--out", default="runs/bench-unlearning")
    ap.add_argument("--methods", help=f"comma-separated (default {DEFAULT_METHODS})")
    ap.add_argument(
        "--ours",
        default="fedasync-unique-membership",
        help="the method the ratios are about (default: the packaged defaults' erasure)",
    )
    ap.add_argument(
        "--relearn-attack",
        action="store_true",
        help="after the erasure, another silo also trains on the erased (poisoned) samples",
    )
    ap.add_argument(
        "--no-reuse",
        dest="reuse",
        action="store_false",
        help="run every method again (default: a run whose folder holds a finished run of the "
        "same config is read back, so an interrupted benchmark goes on where it stopped)",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from simulations.launcher import setup_logging

    names = [args.benchmark] if args.benchmark else [b for b in args.benchmarks.split(",") if b]
    benches = {name: settings(name, args) for name in names}
    methods = method_names(args)
    for name, bench in benches.items():
        if not bench.learns:
            print(f"WARNING: {name} does not learn in this setting: {bench.why}", flush=True)
    if args.ours not in methods:
        print(f"--ours {args.ours} is not among the methods: the ratios will be nan", flush=True)
    seeds = [int(x) for x in args.seeds.split(",")]
    setup_logging(Path(args.out))
    ratios: dict[str, dict[str, float]] = {}
    reports: list[str] = []
    for name, bench in benches.items():
        out = Path(args.out) / name
        per_seed = {
            seed: _run_seed(name, bench, methods, args, seed, out / f"s{seed}") for seed in seeds
        }
        floors = verify(per_seed, args.ours)
        rows = {seed: r for seed, (r, _) in per_seed.items()}
        _save(per_seed, out, name, bench, args)
        agg = aggregate(rows)
        ratios[name] = benchmark_ratios(agg, args.ours)
        reports.append(report(name, bench, agg, floors, ratios[name], args.ours, seeds))
    print("\n" + "\n\n".join(reports))
    print()
    for line in headline_lines(ratios):
        print(line)


def _run_seed(
    bench_name: str,
    b: Bench,
    methods: list[str],
    args: argparse.Namespace,
    seed: int,
    out: Path,
) -> tuple[Rows, dict[str, dict[str, Any]]]:
    """Every method on one seed of one benchmark: the table's rows and each run's summary."""
    from simulations.config import load_config, to_yaml
    from simulations.launcher import run_engine

    common = [
        f"run.out_dir={out}",
        f"run.seed={seed}",
        f"run.budget_s={b.budget_s}",
        "lab.compare_sync=false",
        "run.progress=false",
        f"data.benchmark={bench_name}",
        f"silos.count={b.silos}",
        f"lab.speed.profile={args.speeds}",
        "server.eval_every=5",
        "server.checkpoint_every=0",
        "server.evaluate_silos=false",
        "server.max_staleness=null",
        *PINNED,
        "lab.backdoor.enabled=true",
        "lab.backdoor.watch=true",  # the forgetting metrics at every evaluation, for the latency
        f"lab.backdoor.silo={b.silo}",
        f"lab.backdoor.fraction={b.fraction}",
        f"lab.backdoor.trigger_size={b.trigger_size}",
        f"lab.backdoor.trigger_pattern={b.trigger_pattern}",
        f"lab.backdoor.target_label={b.target_label}",
        "lab.erasure.relearn_versions=20",
        *b.overrides,
    ]
    if args.relearn_attack:
        attacker = (b.silo + 1) % b.silos
        common += [
            f"lab.backdoor.relearn_silo={attacker}",
            f"lab.backdoor.relearn_after_s={b.erase_at_s + 60}",
        ]
    share = args.request_fraction if args.request == "samples" else 1.0
    rows: Rows = {}
    summaries: dict[str, dict[str, Any]] = {}
    for name, extra in _methods(b.silo, b.erase_at_s, share).items():
        if name not in methods:
            continue
        cfg = load_config(None, common + extra + [f"run.name={name}"] + args.overrides)
        t0 = time.monotonic()
        with _run_lock(out / name):  # another process on the same --out waits, then reuses
            s = _reused(cfg, out / name) if args.reuse else None
            how = "reused (same config)" if s is not None else ""
            if s is None:
                (out / name / REUSE_CONFIG).unlink(missing_ok=True)  # (not finished: no config)
                s = run_engine(cfg, out / name)
                (out / name / REUSE_CONFIG).write_text(to_yaml(cfg))
                how = f"{time.monotonic() - t0:.0f}s wall"
        summaries[name] = s
        print(f"[{bench_name} s{seed} {name}] {how}, {s['versions']} versions", flush=True)
        if name in ("retrain", "no-erasure"):
            final = _retrain_metrics(cfg, out / name, b.silo)
            rows[name] = {
                **{f"{k}@boundary": None for k in METRICS},
                **{f"{k}@end": final.get(k) for k in METRICS},
                "window_s": b.budget_s,
            }
            if name == "retrain":
                rows[name].update(plateau(s["evals"]))
            continue
        applied = s.get("erasures", {}).get("applied", [])
        if not applied:
            states = [r["state"] for r in s.get("erasures", {}).get("requests", [])]
            print(f"[{bench_name} s{seed} {name}] not applied within the budget: {states}")
            # not within the run: counts as never (ours) or as its window (the others)
            rows[name] = {"window_s": b.budget_s - b.erase_at_s, "verified_s": math.nan}
            continue
        v = applied[0]
        if v.get("latency_clock", "virtual") != "virtual":
            # submitted before a restart: its latency is on the wall clock, not comparable
            print(f"[{name}] the erasure's latency is on the wall clock (resumed run): skipped")
            rows[name] = {}
            continue
        start = v["submitted_t"]
        end = start + v["erasure_latency_s"]  # the silo's part is in the model
        # the erasure is first in the model at the server's removal, when there is one
        first = v.get("removal_latency_s")
        first = v["erasure_latency_s"] if first is None else first
        rows[name] = {
            **{f"{k}@boundary": v["at_boundary"].get(k) for k in METRICS},
            **{f"{k}@end": v.get("at_end", {}).get(k) for k in METRICS},
            "scope": v.get("scope"),
            "latency_s": first,
            "silo_part_s": v["erasure_latency_s"],
            "to_request": start / first if first > 0 else None,
            "throughput_while_erasing": _throughput(out / name, cfg, v["started_t"], end, b.silo),
            "pre_erasure_accuracy": _pre_erasure_accuracy(s["evals"], start),
            "request_t": start,
            "boundary_t": end,
            "window_s": b.budget_s - start,
        }
        print(
            f"[{bench_name} s{seed} {name}] latency_s={first:.1f} (in the model), "
            f"silo_part_s={v['erasure_latency_s']:.1f}",
            flush=True,
        )
    return rows, summaries


@contextlib.contextmanager
def _run_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock (an exclusive ``flock`` on ``.bench.lock``, released when the
    process ends however it ends): two benchmark processes on one ``--out`` never run the same
    folder at once; the second reads back what the first finished."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".bench.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


REUSE_CONFIG = "bench-config.yaml"
"""Written beside a finished run's summary.json: the config it ran (``--reuse``)."""


MOVED = {
    "backdoor": "lab.backdoor",
    "faults": "lab.faults",
    "silos.exclude": "lab.exclude",
    "silos.exclude_samples": "lab.exclude_samples",
    "silos.emulate_speed": "lab.emulate_speed",
    **{
        f"unlearning.{k}": f"lab.erasure.{k}"
        for k in (
            "server_removal",
            "calibration",
            "calibration_strength",
            "cancel_inflight",
            "watch_every",
            "server_removal_part",
            "server_removal_scale",
            "calibration_target",
            "protect",
            "signature_unique",
            "pre_boundary",
            "radius_scaling",
            "radius_floor",
            "federaser_interval",
            "federaser_steps_ratio",
        )
    },
}
"""Keys a saved config may hold under the name they had before the ``lab`` section: read back
under today's."""


def _as_today(saved: Any) -> None:
    """``saved`` (an omegaconf config a finished run wrote) with its keys under today's names
    (``MOVED``), in place; the halting baseline's two switches became ``server.mode=federaser``."""
    from omegaconf import OmegaConf

    for old, new in MOVED.items():
        value = OmegaConf.select(saved, old)
        if value is None:
            continue
        OmegaConf.update(saved, new, value, force_add=True)
        parent, _, leaf = old.rpartition(".")
        del (OmegaConf.select(saved, parent) if parent else saved)[leaf]
    u = saved.get("unlearning", {})
    if "federaser" in u or "halt" in u:
        if u.get("federaser", False):
            OmegaConf.update(saved, "server.mode", "federaser")
        for k in ("federaser", "halt"):
            if k in u:
                del u[k]


def _reused(cfg: Any, run_dir: Path) -> dict[str, Any] | None:
    """The summary of a finished run of exactly ``cfg`` in ``run_dir``, or None."""
    import json

    from server.config_migrate import migrate
    from simulations.config import load_config, to_yaml

    done, ran = run_dir / "summary.json", run_dir / REUSE_CONFIG
    if not (done.exists() and ran.exists()):
        return None
    try:  # read with today's schema: keys added since take their defaults, or the pinned value
        from omegaconf import OmegaConf

        saved = OmegaConf.load(ran)
        _as_today(saved)
        saved = OmegaConf.create(migrate(OmegaConf.to_container(saved)))  # type: ignore[arg-type]
        if OmegaConf.select(saved, "unlearning.unique_window") is not None:
            if _ran_the_window(saved):
                return None  # its removal used the window of copies the sketch replaced
            del saved.unlearning["unique_window"]  # (a setting that run never used)
        if OmegaConf.select(saved, "lab.erasure.server_removal_max_drop") is None:
            if _removal_cost_more(run_dir, cfg.lab.erasure.server_removal_max_drop):
                return None  # its removal was not bounded, and this run's would have been
        absent = [o for o in PINNED if OmegaConf.select(saved, o.split("=", 1)[0]) is None]
        with tempfile.TemporaryDirectory() as tmp:  # the saved config as today's schema reads it
            today = Path(tmp) / REUSE_CONFIG
            today.write_text(OmegaConf.to_yaml(saved))
            same = to_yaml(load_config(today, absent)) == to_yaml(cfg)
    except ValueError:
        return None
    if not same:
        return None
    try:
        summary: dict[str, Any] = json.loads(done.read_text())
    except ValueError:
        return None
    return summary if "evals" in summary else None


def _removal_cost_more(run_dir: Path, max_drop: float) -> bool:
    """Whether a run saved before the removal was bounded by the held-out score had a removal
    that lowered it by more than ``max_drop`` (``lab.erasure.server_removal_max_drop``): with
    the bound it would have been smaller. One within it ran as it would today."""
    from fedasync.events import read_events

    try:
        events = read_events(run_dir / "metrics.jsonl", skip_bad=True)
    except OSError:
        return True
    return any(
        float(ev["score_before"]) - float(ev["score_after"]) > max_drop
        for ev in events
        if ev.get("event") == "erasure" and ev.get("state") == "removed"
    )


def _ran_the_window(saved: Any) -> bool:
    """Whether a run saved before the sketch kept the window of the latest updates it
    replaced (its unique removal or signature_unique used it)."""
    from omegaconf import OmegaConf

    lab = OmegaConf.select(saved, "lab.erasure") or {}
    unique_removal = lab.get("server_removal", True) and lab.get("server_removal_part") == "unique"
    return bool(unique_removal or lab.get("signature_unique", False))


def _retrain_metrics(cfg: Any, run_dir: Path, silo: int) -> dict[str, float]:
    """Verification metrics of the retrained model (its final checkpoint), on the share it
    left out when it is a sample-level erasure's reference, else on the whole silo."""
    from server.benchmark import federation
    from server.checkpoint import load_state
    from server.erasure_setup import verifier, watched_ids

    fed = federation(cfg)
    verify_fn = verifier(cfg, fed)  # cfg has the backdoor on ``silo``
    ids = watched_ids(cfg, fed)
    return dict(verify_fn(load_state(run_dir / "checkpoint.pt").params, silo, ids))


def _throughput(run_dir: Path, cfg: Any, start: float, end: float, silo: int) -> float | None:
    """The other silos' training work done while erasing, per virtual second, over the rate
    before the request.

    Each accepted update of another silo is work spread over ``[t - d, t]``, with ``d`` its
    silo's job duration (local steps x step time / speed + latency); the share inside a
    window counts. Counting whole updates instead quantises badly: an erasure shorter than one
    job cycle catches 3 or 5 updates where 4.5 are due, a swing of 30% either way.
    """
    from fedasync.events import read_events

    events = read_events(run_dir / "metrics.jsonl")
    speeds = next(e["silos"] for e in events if e["event"] == "roster")
    s = cfg.silos
    dur = {
        int(k): cfg.client.local_steps * s.step_time_s / float(v["speed"]) + s.latency_s
        for k, v in speeds.items()
    }
    ups = [(e["t"], dur[e["silo"]]) for e in events if e["event"] == "update" and e["silo"] != silo]

    def rate(a: float, b: float) -> float:
        return sum(max(0.0, min(t, b) - max(t - d, a)) / d for t, d in ups) / (b - a)

    if end <= start or start <= 0:
        return None
    normal = rate(0.0, start)
    return rate(start, end) / normal if normal > 0 else None


def plateau(evals: list[dict[str, Any]], last: int = 5) -> dict[str, float | None]:
    """Retraining's plateau score (the mean of its last ``last`` evaluations) and its time to
    plateau: from scratch to the first evaluation within 1 point of it."""
    if not evals:
        return {"plateau": None, "time_to_plateau_s": None}
    top = float(statistics.fmean(e["score"] for e in evals[-last:]))
    hit = next(e["t"] for e in evals if e["score"] >= top - LATENCY_GAP)  # the last ones do
    return {"plateau": top, "time_to_plateau_s": float(hit)}


def classify(
    values: dict[str, float | None], ref: dict[str, float], floors: dict[str, float]
) -> str | None:
    """Erasure at the boundary against retraining's band (its value ``ref`` ± its noise floor,
    at least ``MIN_BAND``), per forgetting metric of ``WATCHED``: ``over`` (some metric below
    the band, none above), ``under`` (some above, none below), ``over+under`` or ``within``.
    None: a metric is missing."""
    below = above = False
    for key, watched in WATCHED.items():
        v = values.get(key)
        if v is None or watched not in ref or (isinstance(v, float) and math.isnan(v)):
            return None
        band = max(floors.get(watched, 0.0), MIN_BAND)
        below |= v < ref[watched] - band
        above |= v > ref[watched] + band
    return {(True, False): "over", (False, True): "under", (True, True): "over+under"}.get(
        (below, above), "within"
    )


def _below_against_base(
    row: dict[str, Any], metric: str, base: str, band: float
) -> tuple[float, float] | None:
    """Where ``metric`` at the boundary is below retraining's band (``band``): it less
    ``base`` (another reading of the same model), and retraining's the same way; None where it
    is not below or a reading is missing."""
    keys = (f"{metric}@boundary", f"{metric}@retrain", f"{base}@boundary", f"{base}@retrain")
    vals = [_num(row.get(k)) for k in keys]
    if any(v is None for v in vals):
        return None
    value, ref, own, ref_own = (float(v) for v in vals)  # type: ignore[arg-type]
    return None if value >= ref - band else (value - own, ref - ref_own)


def trigger_lift(row: dict[str, Any], band: float) -> dict[str, Any]:
    """Where the ASR at the boundary is below retraining's band, whether the trigger is: its
    lift (ASR minus the same images' ASR without it) against retraining's, within ``band``.
    An ASR below retraining's with the same lift is the model's lean to the target label on
    every image, not a backdoor erased past retraining. Empty where ASR is not below."""
    read = _below_against_base(row, "asr", "asr_without_trigger", band)
    if read is None:
        return {}
    lift, ref_lift = read
    return {
        "trigger_lift@boundary": lift,
        "trigger_lift@retrain": ref_lift,
        "trigger_lift_within": abs(lift - ref_lift) <= band,
    }


def forget_gap(row: dict[str, Any], band: float) -> dict[str, Any]:
    """Where the forget score at the boundary is below retraining's band, whether the silo's
    data is what differs: its gap (the test score less the forget score) against
    retraining's at the same time, within ``band``. A forget score below retraining's with the
    same gap is a model behind retraining on every sample (training with the poisoned silo
    was slower), not the silo's data erased past retraining. Empty where it is not below."""
    read = _below_against_base(row, "forget_accuracy", "test_accuracy", band)
    if read is None:
        return {}
    gap, ref_gap = -read[0], -read[1]
    return {
        "forget_gap@boundary": gap,
        "forget_gap@retrain": ref_gap,
        "forget_gap_within": gap - ref_gap <= band,
    }


def over_on_the_silo(
    row: dict[str, Any], ref: dict[str, float], floors: dict[str, float]
) -> bool | None:
    """Whether a boundary judged over (or over and under) is over on the silo's data itself:
    some forgetting metric below retraining's band that its own reading does not explain (the
    trigger's lift for the ASR, the gap to the test score for the forget score; the MIA AUC
    has none). None where the boundary was not judged over."""
    if row.get("erasure") not in ("over", "over+under"):
        return None
    readings = {"asr": "trigger_lift_within", "forget_accuracy": "forget_gap_within"}
    for key, watched in WATCHED.items():
        v = _num(row.get(f"{key}@boundary"))
        band = max(floors.get(watched, 0.0), MIN_BAND)
        if v is None or watched not in ref or v >= ref[watched] - band:
            continue
        if not row.get(readings.get(key, ""), False):
            return True
    return False


def verify(per_seed: Runs, ours: str) -> dict[str, float]:
    """Each erased run's ``verified_s`` (issue 14 §5) and its boundary against retraining's
    band (``erasure``); retraining's ``verified_s``: from scratch to ``ours``'s pre-request
    score (another erased method's where ours did not run). Returns the noise floors."""
    import numpy as np
    from unlearning_resurfacing import FORGETTING, latency_within_floor, retrain_floors

    retrains = [s["retrain"]["evals"] for _, s in per_seed.values() if "retrain" in s]
    if not retrains:
        return {}
    floors = retrain_floors(retrains)
    for rows, summaries in per_seed.values():
        if "retrain" not in summaries:
            continue
        ref = summaries["retrain"]["evals"]
        for name, row in rows.items():
            if "request_t" not in row:
                continue
            evals = [e for e in summaries[name]["evals"] if all(k in e for k in FORGETTING)]
            row["verified_s"] = latency_within_floor(
                evals, ref, floors, row["request_t"], row["boundary_t"], row["pre_erasure_accuracy"]
            )
            # the boundary against retraining's band at that time (a sample-level erasure:
            # retraining's watch follows the same share)
            at = {
                k: float(np.interp(row["boundary_t"], [e["t"] for e in ref], [e[k] for e in ref]))
                for k in (*WATCHED.values(), UNTRIGGERED)
                if all(k in e for e in ref)
            }
            row.update({f"{k}@retrain": at[w] for k, w in WATCHED.items()})
            if UNTRIGGERED in at:
                row["asr_without_trigger@retrain"] = at[UNTRIGGERED]
            if all("score" in e for e in ref):
                row["test_accuracy@retrain"] = float(
                    np.interp(row["boundary_t"], [e["t"] for e in ref], [e["score"] for e in ref])
                )
            row["erasure"] = classify({k: row.get(f"{k}@boundary") for k in WATCHED}, at, floors)
            row.update(trigger_lift(row, max(floors.get("bd_asr", 0.0), MIN_BAND)))
            row.update(forget_gap(row, max(floors.get("bd_forget_accuracy", 0.0), MIN_BAND)))
            row["over_on_the_silo"] = over_on_the_silo(row, at, floors)
        pres = [r["pre_erasure_accuracy"] for r in rows.values() if "pre_erasure_accuracy" in r]
        target = rows.get(ours, {}).get("pre_erasure_accuracy", pres[0] if pres else None)
        if target is not None and "retrain" in rows:
            from server.summary import time_to_target

            t = time_to_target(ref, target - LATENCY_GAP)
            rows["retrain"]["verified_s"] = math.nan if t is None else t
            rows["retrain"]["throughput_while_erasing"] = 0.0
    return floors


def _num(v: Any) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def verified_median(rows: list[dict[str, Any]], *, unverified: str) -> tuple[float, bool, int]:
    """The median ``verified_s`` over ``rows`` (seeds), whether it is a lower bound, and how
    many seeds got within the floor. A seed that never did counts as its window
    (``unverified="window"``: a lower bound, for the methods ours is compared with) or as
    never (``"never"``: +inf, for ours). NaN with no row to count."""
    vals: list[tuple[float, bool]] = []
    for r in rows:
        if "verified_s" not in r:
            continue
        v = _num(r["verified_s"])
        if v is not None:
            vals.append((v, False))
        else:
            vals.append((math.inf if unverified == "never" else float(r["window_s"]), True))
    if not vals:
        return math.nan, False, 0
    vals.sort()
    n = len(vals)
    mid = vals[(n - 1) // 2 : n // 2 + 1]
    med = sum(v for v, _ in mid) / len(mid)
    return med, any(c for _, c in mid), sum(not c for _, c in vals)


def _spread(values: list[float]) -> dict[str, float] | None:
    got = [v for v in values if v is not None and not math.isnan(v)]
    if not got:
        return None
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def aggregate(rows: dict[int, Rows]) -> dict[str, dict[str, Any]]:
    """Per method, over seeds: ``verified`` (median, lower bound?, seeds verified, seeds),
    the spread of each figure, and the boundary classification counts."""
    names = list(dict.fromkeys(n for r in rows.values() for n in r))
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        rs = [r[name] for r in rows.values() if name in r]
        a: dict[str, Any] = {"seeds": len(rs)}
        for unverified in ("window", "never"):
            med, bound, k = verified_median(rs, unverified=unverified)
            a[f"verified@{unverified}"] = (med, bound, k, sum("verified_s" in r for r in rs))
        a["verified_values"] = [_num(r.get("verified_s")) for r in rs if "verified_s" in r]
        cols = ["latency_s", "silo_part_s", "to_request", "throughput_while_erasing"]
        cols += ["time_to_plateau_s"]
        cols += ["plateau", *(f"{k}@boundary" for k in METRICS), *(f"{k}@end" for k in METRICS)]
        cols += [f"{k}@retrain" for k in WATCHED]
        for c in cols:
            a[c] = _spread([v for v in (_num(r.get(c)) for r in rs) if v is not None])
        kinds = [r["erasure"] for r in rs if r.get("erasure")]
        a["erasure"] = {k: kinds.count(k) for k in ("within", "over", "under", "over+under")}
        a["erasure"]["judged"] = len(kinds)
        a["erasure"]["on_the_silo"] = sum(1 for r in rs if r.get("over_on_the_silo") is True)
        a["asr_below"] = [
            (seed, r[name]) for seed, r in rows.items() if "trigger_lift_within" in r.get(name, {})
        ]
        a["forget_below"] = [
            (seed, r[name]) for seed, r in rows.items() if "forget_gap_within" in r.get(name, {})
        ]
        out[name] = a
    return out


def benchmark_ratios(agg: dict[str, dict[str, Any]], ours: str) -> dict[str, float]:
    """Each headline ratio on one benchmark: the comparison method's median ``verified_s``
    (unverified seeds at their window: a lower bound) over ours's (unverified seeds never).
    0 when ours's median is never; NaN when either method has no seed to count."""
    out: dict[str, float] = {}
    mine = agg.get(ours, {}).get("verified@never", (math.nan,))[0]
    for key, method in COMPARED.items():
        theirs = agg.get(method, {}).get("verified@window", (math.nan,))[0]
        if math.isnan(mine) or math.isnan(theirs):
            out[key] = math.nan
        elif math.isinf(mine):
            out[key] = 0.0
        else:
            out[key] = theirs / mine if mine > 0 else math.inf
    return out


def headline(ratios: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each ratio's smallest over the benchmarks; NaN when a benchmark lacks it (or none ran)."""
    out = {}
    for key in COMPARED:
        vals = [r.get(key, math.nan) for r in ratios.values()]
        out[key] = math.nan if not vals or any(math.isnan(v) for v in vals) else min(vals)
    return out


def headline_lines(ratios: dict[str, dict[str, float]]) -> list[str]:
    """Per benchmark, then the two last lines of the output."""
    lines = [
        f"[{name}] " + " ".join(f"{k}={_ratio(v)}" for k, v in r.items())
        for name, r in ratios.items()
    ]
    return lines + [f"{k}={_ratio(v)}" for k, v in headline(ratios).items()]


def _ratio(v: float) -> str:
    return "nan" if math.isnan(v) else ("inf" if math.isinf(v) else f"{v:.2f}")


def _pre_erasure_accuracy(evals: list[dict[str, Any]], t: float, last: int = 5) -> float:
    """Mean test score of the last ``last`` evaluations before ``t`` (single evaluations
    swing by several points on these small tasks; the maximum would be a lucky one)."""
    before = [e["score"] for e in evals if e["t"] <= t][-last:]
    return float(sum(before) / len(before)) if before else float("nan")


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def _span(s: dict[str, float] | None, digits: int = 1) -> str:
    if s is None:
        return "-"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} [{f.format(s['min'])} .. {f.format(s['max'])}]"


def _verified_text(a: dict[str, Any], ours: bool) -> str:
    med, bound, k, n = a["verified@never" if ours else "verified@window"]
    if n == 0:
        return "-"
    vals = a["verified_values"]
    got = [v for v in vals if v is not None]
    if math.isinf(med):
        m = "never"
    else:
        m = (">" if bound else "") + f"{med:.1f}"
    lo = f"{min(got):.1f}" if got else "-"
    hi = f"{max(got):.1f}" if len(got) == len(vals) else ("never" if ours else ">window")
    return f"{m} [{lo} .. {hi}] ({k}/{n} verified)"


def report(
    name: str,
    b: Bench,
    agg: dict[str, dict[str, Any]],
    floors: dict[str, float],
    ratios: dict[str, float],
    ours: str,
    seeds: list[int],
) -> str:
    """One benchmark's table: medians [min .. max] over the seeds."""
    lines = [
        f"== {name}: {b.silos} silos, silo {b.silo} erased at {b.erase_at_s:.0f} s of "
        f"{b.budget_s:.0f} s, backdoor on {b.fraction:g} of it -> {b.target_label} "
        f"({b.trigger_pattern} {b.trigger_size}x{b.trigger_size}); seeds {','.join(map(str, seeds))}",
        f"   why: {b.why}",
        "   noise floors (retrain vs retrain): "
        + (", ".join(f"{k}={v:.3f}" for k, v in floors.items()) if floors else "- (no retrain)"),
    ]
    if "retrain" in agg:
        r = agg["retrain"]
        lines.append(
            f"   retraining: plateau score {_span(r['plateau'], 3)}, time to plateau (within "
            f"1 point) {_span(r['time_to_plateau_s'])} s"
        )
    lines.append(
        f"   {'method':20s} {'verified_s':34s} {'latency_s':24s} {'to_request x':24s} "
        f"{'throughput':20s} boundary vs retraining (over/under/both/within of judged; "
        "over on the silo's data itself)"
    )
    for m, a in agg.items():
        e = a["erasure"]
        judged = (
            f"{e['over']}/{e['under']}/{e['over+under']}/{e['within']} of {e['judged']}; "
            f"{e.get('on_the_silo', 0)}"
            if e["judged"]
            else "-"
        )
        lines.append(
            f"   {m:20s} {_verified_text(a, m == ours):34s} {_span(a['latency_s']):24s} "
            f"{_span(a['to_request']):24s} {_span(a['throughput_while_erasing'], 3):20s} "
            f"{judged}"
        )
    lines.append("   at the boundary (median [min .. max]; retraining at the same times):")
    for m, a in agg.items():
        if a["asr@boundary"] is None:
            continue
        lines.append(
            f"   {m:20s} "
            + "  ".join(
                f"{k}={_span(a[f'{k}@boundary'], 3)}"
                + (f" (retrain {_span(a[f'{k}@retrain'], 3)})" if k in WATCHED else "")
                for k in ("asr", "forget_accuracy", "mia_auc", "test_accuracy")
            )
        )
    for m, a in agg.items():
        for seed, r in a.get("asr_below", []):
            lines.append(
                f"   {m} s{seed}: ASR {r['asr@boundary']:.3f} below retraining's "
                f"{r['asr@retrain']:.3f}; the trigger's lift {r['trigger_lift@boundary']:.3f} "
                f"against {r['trigger_lift@retrain']:.3f}, "
                + (
                    "within: the model's lean to the target label (untriggered "
                    f"{r['asr_without_trigger@boundary']:.3f} against "
                    f"{r['asr_without_trigger@retrain']:.3f}), not the trigger"
                    if r["trigger_lift_within"]
                    else "below: the trigger erased past retraining"
                )
            )
        for seed, r in a.get("forget_below", []):
            lines.append(
                f"   {m} s{seed}: forget score {r['forget_accuracy@boundary']:.3f} below "
                f"retraining's {r['forget_accuracy@retrain']:.3f}; its gap to the test score "
                f"{r['forget_gap@boundary']:.3f} against {r['forget_gap@retrain']:.3f}, "
                + (
                    "within: a model behind retraining on every sample (test score "
                    f"{r['test_accuracy@boundary']:.3f} against "
                    f"{r['test_accuracy@retrain']:.3f}), not the silo's data"
                    if r["forget_gap_within"]
                    else "wider: the silo's data erased past retraining"
                )
            )
    limit = speedup_limit(agg, ours)
    if limit is not None:
        lines.append(
            f"   the most erasure_speedup_vs_retrain can be here: {limit:.2f} (retraining's "
            f"median verified_s over {ours}'s median latency_s: no erasure is verified before "
            "it is in the model)"
        )
    lines.append(
        "   " + " ".join(f"{k}={_ratio(v)}" for k, v in ratios.items()) + f" (ours: {ours})"
    )
    return "\n".join(lines)


def speedup_limit(agg: dict[str, dict[str, Any]], ours: str) -> float | None:
    """The largest ``erasure_speedup_vs_retrain`` the workload allows: retraining's median
    ``verified_s`` over ours's median ``latency_s`` (None without both)."""
    theirs = agg.get("retrain", {}).get("verified@window", (math.nan,))[0]
    lat = agg.get(ours, {}).get("latency_s")
    if lat is None or math.isnan(theirs) or lat["median"] <= 0:
        return None
    return float(theirs / lat["median"])


def _save(per_seed: Runs, out: Path, name: str, b: Bench, args: argparse.Namespace) -> None:
    """``results.csv`` (a row per seed and method) and two plots per seed."""
    rows = {seed: r for seed, (r, _) in per_seed.items()}
    cols = sorted({c for r in rows.values() for row in r.values() for c in row})
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "method", *cols])
        for seed, r in rows.items():
            for method, row in r.items():
                w.writerow([seed, method, *[row.get(c) for c in cols]])
    for seed, r in rows.items():
        _plot(r, out / f"s{seed}" / "unlearning.png", name, b)
        evals = {m: s.get("evals", []) for m, s in per_seed[seed][1].items()}
        _plot_timeline(r, evals, out / f"s{seed}", name, b)


def _plot(rows: Rows, path: Path, name: str, b: Bench) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6))
    for ax, m in zip(axes, METRICS):
        vals = [rows[n].get(f"{m}@end") or 0.0 for n in names]
        ax.bar(names, vals, color=["tab:grey" if n == "retrain" else "tab:blue" for n in names])
        ax.set_title(f"{m} after relearning")
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Erasure of silo {b.silo} on {name}: each method vs retraining (grey)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


TIMELINE = ("bd_asr", "bd_forget_accuracy", "score")
"""What the timeline plot draws against virtual time: the backdoor's ASR and forget metric on
the erased silo's data (``lab.backdoor.watch``), and the test score."""


def _plot_timeline(
    rows: Rows, evals: dict[str, list[dict[str, Any]]], seed_dir: Path, name: str, b: Bench
) -> Path | None:
    """``unlearning_timeline.png`` in ``seed_dir``: each method's `TIMELINE` metrics against
    virtual time from its run's evaluations (``evals``, the run summaries'; retraining grey),
    the request as a dashed line and each method's verification as a dot; None when no run
    has evaluations."""
    runs = {m: evals[m] for m in rows if evals.get(m)}
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TIMELINE), figsize=(5 * len(TIMELINE), 3.6))
    colours = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for method, run in runs.items():
        colour = "tab:grey" if method == "retrain" else next(colours)
        ts = [float(e["t"]) for e in run]
        done = _num(rows[method].get("verified_s"))
        start = _num(rows[method].get("request_t"))
        for ax, key in zip(axes, TIMELINE):
            ys = [float(e.get(key, math.nan)) for e in run]
            ax.plot(ts, ys, color=colour, label=method, lw=1.4)
            at = _verified_at(ts, start, done)
            if at is not None:
                ax.plot([ts[at]], [ys[at]], "o", color=colour, ms=6)
    for ax, key in zip(axes, TIMELINE):
        ax.axvline(b.erase_at_s, color="k", ls="--", lw=0.8)
        ax.set_title(key)
        ax.set_xlabel("virtual time (s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"Erasure of silo {b.silo} on {name}, requested at {b.erase_at_s:.0f} s (dashed); "
        "a dot: verified against retraining (grey)"
    )
    fig.tight_layout()
    path = seed_dir / "unlearning_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _verified_at(ts: list[float], start: float | None, done: float | None) -> int | None:
    """The evaluation (index into ``ts``) at which a run requested at ``start`` was verified
    ``done`` seconds later: the first at or after it; None when it never was."""
    if start is None or done is None or not math.isfinite(done):
        return None
    return next((i for i, t in enumerate(ts) if t >= start + done - 1e-6), None)


def _stopped(e: BaseException) -> int:
    """One line for a signal (Ctrl-C): the runs finished so far are kept and read back by the
    same command (``--reuse``); the run in progress starts again. The exit status."""
    from fedasync.interrupt import signal_of

    name, code = signal_of(e)
    again = shlex.join([sys.executable, *sys.argv])
    print(
        f"unlearning_vs_retrain: stopped by {name}; the finished runs are kept, the one in "
        f"progress is run again by: {again}",
        file=sys.stderr,
        flush=True,
    )
    return code


if __name__ == "__main__":
    from fedasync.interrupt import Interrupted, exit_now, raise_interrupted, set_handlers

    set_handlers(raise_interrupted)  # SIGTERM and SIGHUP end it like Ctrl-C
    try:
        main()
    except (Interrupted, KeyboardInterrupt) as stop:
        exit_now(_stopped(stop))
