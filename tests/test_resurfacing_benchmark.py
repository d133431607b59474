"""The pure pieces of benchmarks/unlearning_resurfacing.py: the plan of runs, the latency under
the retraining noise floor, the paired bootstrap of the gap reduction."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "unlearning_resurfacing.py"
_spec = importlib.util.spec_from_file_location("unlearning_resurfacing", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["unlearning_resurfacing"] = bench
_spec.loader.exec_module(bench)


def _args(**kw):
    base = dict(
        benchmark="brain-tissue",
        scenarios="leftover,async-state",
        arms="none,applied,drop",
        seeds=2,
        seed0=0,
        erase_at_s=100.0,
        after_s=50.0,
        reversion_s=300.0,
        relearn_samples="8,32",
        slowdown="10",
        out="/tmp/x",
    )
    return argparse.Namespace(**{**base, **kw})


def _value(overrides, key):
    hits = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    assert len(hits) <= 1, (key, hits)
    return hits[0] if hits else None


def test_plan_pairs_every_arm_with_retraining_on_the_same_seed_and_exposure():
    runs = bench.plan(_args())
    # (2 leftover variants + 1 async variant) x 2 seeds x (retrain + 3 arms)
    assert len(runs) == 3 * 2 * 4
    for run in runs:
        o = run.overrides
        silo = int(_value(o, "lab.backdoor.silo"))
        assert _value(o, "run.seed") == str(run.seed)
        assert _value(o, "lab.backdoor.watch") == "true"
        if run.arm == "retrain":
            assert _value(o, "erasures") is None and _value(o, "lab.exclude") == f"[{silo}]"
        else:
            assert f"silo: {silo}" in _value(o, "erasures") and _value(o, "lab.exclude") is None
        if run.scenario == "leftover":  # retraining gets the same relearning exposure
            assert _value(o, "lab.backdoor.relearn_samples") == run.variant
            assert int(_value(o, "lab.backdoor.relearn_silo")) != silo
        else:
            assert _value(o, "server.mode") == "fedbuff"
    # the backdoored silo is never the straggler (its backdoor would never be learnt)
    for run in runs:
        silo = int(_value(run.overrides, "lab.backdoor.silo"))
        assert silo in bench._fast_silos(4, 0.25, 10.0, run.seed)
    drop = next(r for r in runs if r.arm == "drop")
    assert _value(drop.overrides, "lab.erasure.pre_boundary") == "drop"
    with pytest.raises(SystemExit, match="unknown arm"):
        bench.plan(_args(arms="none,bogus"))


def _ev(t, score, asr, mia=0.5, forget=0.5):
    return {"t": t, "score": score, "bd_asr": asr, "bd_mia_auc": mia, "bd_forget_accuracy": forget}


def test_latency_waits_for_every_metric_and_the_accuracy():
    retrain = [_ev(t, 0.6, 0.1) for t in (0.0, 50.0, 100.0, 150.0)]
    floors = {"bd_asr": 0.05, "bd_mia_auc": 0.02, "bd_forget_accuracy": 0.02}
    erased = [
        _ev(90.0, 0.62, 0.9),  # before the boundary: never counts
        _ev(110.0, 0.62, 0.3),  # ASR outside the floor
        _ev(120.0, 0.55, 0.12),  # ASR within, accuracy more than 1 point below 0.6
        _ev(130.0, 0.595, 0.12),  # both within
    ]
    got = bench.latency_within_floor(erased, retrain, floors, 100.0, 105.0, 0.60)
    assert got == pytest.approx(30.0)
    assert math.isnan(bench.latency_within_floor(erased[:3], retrain, floors, 100.0, 105.0, 0.6))


def test_gap_reduction_is_paired_and_its_interval_brackets_it():
    base, arm = [0.4, 0.2, 0.3, 0.5, 0.1], [0.1, 0.1, 0.1, 0.2, 0.0]
    point, lo, hi = bench.bootstrap_reduction(base, arm)
    assert point == pytest.approx(1 - 0.1 / 0.3)
    assert lo <= point <= hi and hi <= 1.0
    assert math.isnan(bench.bootstrap_reduction([0.0, 0.0], [0.1, 0.0])[0])
    worse = bench.bootstrap_reduction(base, [b * 2 for b in base])
    assert worse[0] == pytest.approx(-1.0) and worse[2] < 0
