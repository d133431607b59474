"""The aggregation of benchmarks/unlearning_vs_retrain.py on synthetic rows (no simulation): the
headline ratios (smallest over the benchmarks, the last two lines), the over/under-erasure
classification at the boundary, and a benchmark where a method never got within the floor."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "unlearning_vs_retrain.py"
_spec = importlib.util.spec_from_file_location("unlearning_vs_retrain", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["unlearning_vs_retrain"] = bench  # (dataclasses look their module up)
_spec.loader.exec_module(bench)

NAN = math.nan
FLOORS = {"bd_asr": 0.05, "bd_forget_accuracy": 0.04, "bd_mia_auc": 0.005}


def _seeds(**verified: list[float]) -> dict[int, dict[str, dict]]:
    """Rows per seed from each method's ``verified_s`` per seed (NaN: never within the floor);
    erased methods' window 300 s, retraining's 500 s."""
    n = len(next(iter(verified.values())))
    return {
        seed: {
            m: {"verified_s": v[seed], "window_s": 500.0 if m == "retrain" else 300.0}
            for m, v in verified.items()
        }
        for seed in range(n)
    }


def _ratios(rows, ours="fedasync-membership"):
    return bench.benchmark_ratios(bench.aggregate(rows), ours)


def test_headline_is_the_smallest_per_benchmark_median_ratio_and_the_last_two_lines():
    ratios = {
        # medians: retrain 40, sync-halt 120, ours 10 -> 4.0 and 12.0
        "a": _ratios(
            _seeds(
                retrain=[30.0, 40.0, 50.0],
                **{"sync-halt": [100.0, 120.0, 200.0], "fedasync-membership": [5.0, 10.0, 20.0]},
            )
        ),
        # medians: retrain 20, sync-halt 150, ours 25 -> 0.8 and 6.0
        "b": _ratios(
            _seeds(
                retrain=[20.0, 10.0, 60.0],
                **{"sync-halt": [150.0, 90.0, 160.0], "fedasync-membership": [25.0, 30.0, 15.0]},
            )
        ),
    }
    assert ratios["a"] == {
        "speedup_vs_halting_federaser": 12.0,
        "erasure_speedup_vs_retrain": 4.0,
    }
    assert ratios["b"]["erasure_speedup_vs_retrain"] == pytest.approx(0.8)
    lines = bench.headline_lines(ratios)
    assert lines[-2:] == ["speedup_vs_halting_federaser=6.00", "erasure_speedup_vs_retrain=0.80"]
    # the per-benchmark values come above, named
    assert lines[:2] == [
        "[a] speedup_vs_halting_federaser=12.00 erasure_speedup_vs_retrain=4.00",
        "[b] speedup_vs_halting_federaser=6.00 erasure_speedup_vs_retrain=0.80",
    ]


def test_the_ours_arm_is_the_one_named():
    rows = _seeds(
        retrain=[40.0],
        **{"fedasync-fixed": [4.0], "fedasync-membership": [20.0], "sync-halt": [80.0]},
    )
    assert _ratios(rows, "fedasync-fixed")["erasure_speedup_vs_retrain"] == 10.0
    assert _ratios(rows, "fedasync-membership")["erasure_speedup_vs_retrain"] == 2.0


def test_median_of_an_even_number_of_seeds_is_the_mean_of_the_middle_two():
    med, bound, k = bench.verified_median(
        [{"verified_s": v, "window_s": 300.0} for v in (10.0, 40.0, 20.0, 30.0)],
        unverified="never",
    )
    assert (med, bound, k) == (25.0, False, 4)


def test_a_benchmark_where_ours_never_verified_makes_the_headline_zero():
    ok = _ratios(
        _seeds(
            retrain=[30.0, 30.0, 30.0],
            **{"sync-halt": [90.0] * 3, "fedasync-membership": [10.0] * 3},
        )
    )
    # ours within the floor on one seed of three: its median is never -> ratios 0
    never = _seeds(
        retrain=[30.0, 30.0, 30.0],
        **{"sync-halt": [90.0] * 3, "fedasync-membership": [NAN, 10.0, NAN]},
    )
    agg = bench.aggregate(never)
    med, bound, k, n = agg["fedasync-membership"]["verified@never"]
    assert math.isinf(med) and (k, n) == (1, 3)
    bad = bench.benchmark_ratios(agg, "fedasync-membership")
    assert bad == {"speedup_vs_halting_federaser": 0.0, "erasure_speedup_vs_retrain": 0.0}
    assert bench.headline_lines({"ok": ok, "never": bad})[-2:] == [
        "speedup_vs_halting_federaser=0.00",
        "erasure_speedup_vs_retrain=0.00",
    ]
    text = bench._verified_text(agg["fedasync-membership"], ours=True)
    assert text.startswith("never [10.0 .. never] (1/3 verified)")


def test_a_comparison_method_never_verified_counts_as_its_window_a_lower_bound():
    rows = _seeds(
        retrain=[30.0, 30.0, 30.0],
        **{"sync-halt": [NAN, NAN, 100.0], "fedasync-membership": [10.0, 20.0, 30.0]},
    )
    agg = bench.aggregate(rows)
    med, bound, k, n = agg["sync-halt"]["verified@window"]
    assert (med, bound, k, n) == (300.0, True, 1, 3)  # > 300 s: a lower bound
    assert bench._verified_text(agg["sync-halt"], ours=False).startswith(
        ">300.0 [100.0 .. >window]"
    )
    # ratio 300 / 20: at least 15x
    assert (
        bench.benchmark_ratios(agg, "fedasync-membership")["speedup_vs_halting_federaser"] == 15.0
    )


def test_a_benchmark_without_a_method_gives_nan_and_so_does_the_headline():
    full = _ratios(_seeds(retrain=[30.0], **{"sync-halt": [90.0], "fedasync-membership": [10.0]}))
    no_halt = _ratios(_seeds(retrain=[30.0], **{"fedasync-membership": [10.0]}))
    assert math.isnan(no_halt["speedup_vs_halting_federaser"])
    assert no_halt["erasure_speedup_vs_retrain"] == 3.0
    assert bench.headline_lines({"full": full, "no-halt": no_halt})[-2:] == [
        "speedup_vs_halting_federaser=nan",
        "erasure_speedup_vs_retrain=3.00",
    ]
    assert bench.headline_lines({})[-2:] == [
        "speedup_vs_halting_federaser=nan",
        "erasure_speedup_vs_retrain=nan",
    ]


REF = {"bd_asr": 0.10, "bd_forget_accuracy": 0.50, "bd_mia_auc": 0.30}


@pytest.mark.parametrize(
    ("values", "kind"),
    [
        ({"asr": 0.12, "forget_accuracy": 0.52, "mia_auc": 0.305}, "within"),
        # forget accuracy below retraining's band: over-erased
        ({"asr": 0.10, "forget_accuracy": 0.40, "mia_auc": 0.30}, "over"),
        # MIA under its floor (0.005) counts the 0.01 minimum: 0.292 is inside, 0.285 below
        ({"asr": 0.10, "forget_accuracy": 0.50, "mia_auc": 0.292}, "within"),
        ({"asr": 0.10, "forget_accuracy": 0.50, "mia_auc": 0.285}, "over"),
        # the backdoor left: ASR above the band
        ({"asr": 0.90, "forget_accuracy": 0.50, "mia_auc": 0.30}, "under"),
        ({"asr": 0.90, "forget_accuracy": 0.30, "mia_auc": 0.30}, "over+under"),
        ({"asr": None, "forget_accuracy": 0.50, "mia_auc": 0.30}, None),
    ],
)
def test_boundary_classification_against_retrainings_band(values, kind):
    assert bench.classify(values, REF, FLOORS) == kind


def test_classification_counts_per_method():
    rows = {
        s: {"fedasync-fixed": {"erasure": k, "verified_s": 10.0, "window_s": 300.0}}
        for s, k in enumerate(["over", "over", "within", "under", None])
    }
    e = bench.aggregate(rows)["fedasync-fixed"]["erasure"]
    assert e == {"within": 1, "over": 2, "under": 1, "over+under": 0, "judged": 4, "on_the_silo": 0}


def test_retrainings_time_to_plateau():
    evals = [{"t": t, "score": s} for t, s in [(0, 0.2), (10, 0.6), (20, 0.695), (30, 0.7)]]
    evals += [{"t": 40 + t, "score": 0.7} for t in range(5)]
    p = bench.plateau(evals)
    assert p["plateau"] == pytest.approx(0.7) and p["time_to_plateau_s"] == 20.0


def _args(**kw):
    base = dict(
        request="silo",
        methods=None,
        silos=None,
        silo=None,
        target_label=None,
        fraction=None,
        trigger_size=None,
        budget_s=None,
        erase_at_s=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_methods_by_request_and_the_two_stopping_arms():
    assert bench.method_names(_args()) == [
        "retrain",
        "sync-halt",
        "fedasync-fixed",
        "fedasync-membership",
        "fedasync-unique-membership",
    ]
    assert bench.method_names(_args(request="samples")) == [
        "retrain",
        "fedasync-fixed",
        "fedasync-membership",
        "fedasync-unique-membership",
    ]
    with pytest.raises(SystemExit, match="FedEraser erases whole"):
        bench.method_names(_args(request="samples", methods="sync-halt,fedasync-fixed"))
    with pytest.raises(SystemExit, match="unknown method"):
        bench.method_names(_args(methods="fedasync"))
    m = bench._methods(2, 200.0, 0.1)
    assert "unlearning.stop=fixed" in bench.PINNED and "unlearning.steps=5" in bench.PINNED
    assert "lab.erasure.server_removal=false" in bench.PINNED
    assert "unlearning.stop=fixed" in m["fedasync-fixed"]
    assert "unlearning.stop=membership" in m["fedasync-membership"]
    for arm in ("fedasync-fixed", "fedasync-membership"):
        assert "lab.erasure.calibration=true" in m[arm]
        assert "erasures=[{silo: 2, at_s: 200.0, fraction: 0.1}]" in m[arm]
    assert "erasures=[{silo: 2, at_s: 200.0}]" in bench._methods(2, 200.0)["sync-halt"]
    # ...retraining leaves out the same seeded share (or the whole silo)
    assert "lab.exclude_samples=[{silo: 2, fraction: 0.1}]" in m["retrain"]
    assert "lab.exclude=[2]" in bench._methods(2, 200.0)["retrain"]
    assert "lab.erasure.server_removal_scale=0.5" in m["fedasync-removal"]
    for arm in ("fedasync-unique", "fedasync-unique-membership"):
        assert "lab.erasure.server_removal_part=unique" in m[arm]
        assert f"lab.erasure.sketch_rank={bench.SKETCH_RANK}" in m[arm]


def test_every_benchmark_has_its_settings_and_the_command_line_replaces_them():
    for name in bench.BENCHMARKS:
        b = bench.settings(name, _args())
        assert b == bench.BENCHMARKS[name] and b.why and 0 <= b.silo < b.silos
        assert 0 < b.erase_at_s < b.budget_s
    # only benchmarks that learn run by default, and not those opt-in for their cost
    assert bench.DEFAULT_BENCHMARKS.split(",") == [
        n for n, b in bench.BENCHMARKS.items() if b.learns and b.default
    ]
    assert "radiomics-lesion" not in bench.DEFAULT_BENCHMARKS.split(",")
    assert "brain-tissue-3d" not in bench.DEFAULT_BENCHMARKS.split(",")
    assert bench.BENCHMARKS["brain-tissue-3d"].learns
    b = bench.settings("nuclei", _args(budget_s=60.0, erase_at_s=25.0))
    assert (b.budget_s, b.erase_at_s, b.silos) == (60.0, 25.0, bench.BENCHMARKS["nuclei"].silos)
    with pytest.raises(SystemExit, match="unknown benchmark"):
        bench.settings("mnist", _args())


def test_the_speedup_limit_is_retrainings_verified_time_over_our_latency():
    rows = _seeds(retrain=[30.0, 40.0, 50.0], **{"fedasync-membership": [20.0, NAN, 30.0]})
    for seed, lat in zip(range(3), (8.0, 10.0, 12.0)):
        rows[seed]["fedasync-membership"]["latency_s"] = lat
    agg = bench.aggregate(rows)
    assert bench.speedup_limit(agg, "fedasync-membership") == pytest.approx(40.0 / 10.0)
    assert bench.speedup_limit(agg, "fedasync-fixed") is None


def test_a_run_folder_is_run_by_one_process_at_a_time(tmp_path):
    import threading

    order: list[str] = []
    inside = threading.Event()

    def first():
        with bench._run_lock(tmp_path / "run"):
            order.append("first in")
            inside.set()
            threading.Event().wait(0.3)
            order.append("first out")

    def second():
        inside.wait(5.0)
        with bench._run_lock(tmp_path / "run"):  # (a new open file: flock excludes it)
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert order == ["first in", "first out", "second in"]


def test_a_finished_run_is_read_back_under_new_defaults_but_not_after_a_real_change(tmp_path):
    # Prepare: a finished run whose saved config predates a key (as runs made before
    # lab.erasure.server_removal_part existed); the benchmark's methods start from PINNED
    import json

    from omegaconf import OmegaConf

    from simulations.config import load_config, to_yaml

    cfg = load_config(None, [*bench.PINNED, "run.seed=3"])
    saved = OmegaConf.create(to_yaml(cfg))
    del saved.lab.erasure["server_removal_part"]
    (tmp_path / bench.REUSE_CONFIG).write_text(OmegaConf.to_yaml(saved))
    (tmp_path / "summary.json").write_text(json.dumps({"evals": [], "versions": 4}))
    # Execute
    same = bench._reused(cfg, tmp_path)
    other = bench._reused(load_config(None, [*bench.PINNED, "run.seed=4"]), tmp_path)
    unpinned = bench._reused(load_config(None, ["run.seed=3"]), tmp_path)
    # Assert: the absent key reads as its pinned value; a different seed, or today's package
    # defaults instead of the pinned ones, is another run
    assert same == {"evals": [], "versions": 4}
    assert other is None and unpinned is None


def test_a_run_saved_under_the_keys_before_the_lab_section_is_read_back(tmp_path):
    # Prepare: a finished retraining run whose config names its instruments as they were
    # named before the lab section (silos.exclude, backdoor.*, unlearning.<ablation>,
    # unlearning.halt/federaser)
    import json

    from omegaconf import OmegaConf

    from simulations.config import load_config, to_yaml

    overrides = [*bench.PINNED, "run.seed=3", "lab.exclude=[1]", "lab.backdoor.enabled=true"]
    cfg = load_config(None, overrides)
    saved = OmegaConf.create(to_yaml(cfg))
    saved.silos["exclude"] = list(saved.lab.exclude)
    saved["backdoor"] = saved.lab.backdoor
    saved.unlearning["server_removal_part"] = saved.lab.erasure.server_removal_part
    saved.unlearning["halt"], saved.unlearning["federaser"] = False, False
    for k in ("server_removal_max_drop", "sketch_rank", "relearn_versions"):
        saved.unlearning[k] = saved.lab.erasure[k]
    saved.silos["straggler_fraction"] = saved.lab.speed.straggler_fraction
    del saved["lab"]
    (tmp_path / bench.REUSE_CONFIG).write_text(OmegaConf.to_yaml(saved))
    (tmp_path / "summary.json").write_text(json.dumps({"evals": [], "versions": 4}))
    # Execute
    got = bench._reused(cfg, tmp_path)
    moved_elsewhere = bench._reused(
        load_config(None, [*overrides[:-2], "lab.exclude=[2]"]), tmp_path
    )
    # Assert: read back under today's names, and still compared value by value
    assert got == {"evals": [], "versions": 4}
    assert moved_elsewhere is None


@pytest.mark.parametrize("unique", [False, True])
def test_a_run_saved_with_the_window_the_sketch_replaced_is_read_back_only_if_it_never_used_it(
    tmp_path, unique
):
    # Prepare: a finished run saved with unlearning.unique_window (before the sketch)
    import json

    from omegaconf import OmegaConf

    from simulations.config import load_config, to_yaml

    removal = ["lab.erasure.server_removal=true", "lab.erasure.server_removal_part=unique"]
    cfg = load_config(None, [*bench.PINNED, "run.seed=3", *(removal if unique else [])])
    saved = OmegaConf.create(to_yaml(cfg))
    del saved.lab.erasure["sketch_rank"]
    saved.unlearning["unique_window"] = 8
    (tmp_path / bench.REUSE_CONFIG).write_text(OmegaConf.to_yaml(saved))
    (tmp_path / "summary.json").write_text(json.dumps({"evals": [], "versions": 4}))
    # Execute
    got = bench._reused(cfg, tmp_path)
    # Assert: a run whose removal used the window is another run; one that never did is read
    assert (got is None) is unique


@pytest.mark.parametrize(("drop", "reused"), [(0.01, True), (0.05, False)])
def test_a_run_saved_before_the_removal_was_bounded_is_read_back_only_if_its_removal_was_within(
    tmp_path, drop, reused
):
    # Prepare: a finished run saved before lab.erasure.server_removal_max_drop, whose removal
    # lowered the held-out score by `drop` (its 'removed' event; a torn last line after it)
    import json

    from omegaconf import OmegaConf

    from simulations.config import load_config, to_yaml

    cfg = load_config(None, [*bench.PINNED, "run.seed=3", "lab.erasure.server_removal=true"])
    saved = OmegaConf.create(to_yaml(cfg))
    del saved.lab.erasure["server_removal_max_drop"]
    (tmp_path / bench.REUSE_CONFIG).write_text(OmegaConf.to_yaml(saved))
    (tmp_path / "summary.json").write_text(json.dumps({"evals": [], "versions": 4}))
    removed = {"event": "erasure", "state": "removed", "score_before": 0.9}
    lines = [json.dumps({**removed, "score_after": 0.9 - drop}), '{"event": "ev']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    # Execute
    got = bench._reused(cfg, tmp_path)
    # Assert: a removal within today's bound (0.02) ran as today's would; a larger one is
    # another run
    assert cfg.lab.erasure.server_removal_max_drop == 0.02
    assert (got is not None) is reused


def test_the_timeline_plot_draws_each_runs_evaluations_and_marks_its_verification(tmp_path):
    b = bench.BENCHMARKS["breast-fna"]
    evals = {
        method: [{"t": t, "bd_asr": a, "score": 0.9} for t, a in zip((100.0, 200.0, 300.0), asr)]
        for method, asr in (("retrain", [0.1, 0.05, 0.04]), ("ours", [0.9, 0.9, 0.05]))
    }
    rows = {"retrain": {}, "ours": {"request_t": 150.0, "verified_s": 150.0}}
    path = bench._plot_timeline(rows, evals, tmp_path, "breast-fna", b)
    assert path == tmp_path / "unlearning_timeline.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # verified 150 s after its request at 150 s: the evaluation at 300 s, not the one before
    assert bench._verified_at([100.0, 200.0, 300.0], 150.0, 150.0) == 2
    assert bench._verified_at([100.0, 200.0, 300.0], 150.0, 60.0) == 2
    assert bench._verified_at([100.0, 200.0, 300.0], 150.0, 40.0) == 1
    assert bench._verified_at([100.0, 200.0], 150.0, math.nan) is None
    assert bench._verified_at([100.0, 200.0], 150.0, 500.0) is None
    assert bench._plot_timeline({"x": {}}, {"x": []}, tmp_path / "none", "breast-fna", b) is None


@pytest.mark.parametrize(
    ("asr", "base", "within"),
    [
        # below retraining's 0.149 by more than the band; same lift (0.012 vs 0.014): the lean
        (0.104, 0.092, True),
        # below, and the trigger now lowers the ASR (lift -0.08 vs 0.014): erased past
        (0.02, 0.10, False),
    ],
)
def test_an_asr_below_retrainings_band_is_read_by_the_triggers_lift(asr, base, within):
    row = {
        "asr@boundary": asr,
        "asr_without_trigger@boundary": base,
        "asr@retrain": 0.149,
        "asr_without_trigger@retrain": 0.135,
    }
    got = bench.trigger_lift(row, band=0.043)
    assert got["trigger_lift_within"] is within
    assert got["trigger_lift@boundary"] == pytest.approx(asr - base)
    assert got["trigger_lift@retrain"] == pytest.approx(0.014)
    # an ASR within the band, or a run without the untriggered reading, is not read
    assert bench.trigger_lift({**row, "asr@boundary": 0.12}, band=0.043) == {}
    assert bench.trigger_lift({**row, "asr_without_trigger@retrain": None}, band=0.043) == {}


@pytest.mark.parametrize(
    ("forget", "test", "within"),
    [
        # below retraining's 0.367 by more than the band, the test score as far below: a
        # model behind retraining on every sample (3D seed 7's shape)
        (0.315, 0.55, True),
        # below, with the test score where retraining's is: the silo's data erased past it
        (0.315, 0.60, False),
    ],
)
def test_a_forget_score_below_retrainings_band_is_read_by_its_gap_to_the_test_score(
    forget, test, within
):
    row = {
        "forget_accuracy@boundary": forget,
        "test_accuracy@boundary": test,
        "forget_accuracy@retrain": 0.367,
        "test_accuracy@retrain": 0.60,
    }
    got = bench.forget_gap(row, band=0.032)
    assert got["forget_gap_within"] is within
    assert got["forget_gap@boundary"] == pytest.approx(test - forget)
    assert got["forget_gap@retrain"] == pytest.approx(0.233)
    # within the band, or without retraining's test score, it is not read
    assert bench.forget_gap({**row, "forget_accuracy@boundary": 0.35}, band=0.032) == {}
    assert bench.forget_gap({**row, "test_accuracy@retrain": None}, band=0.032) == {}
    # and the report names the seed with its reading
    row.update(got)
    agg = bench.aggregate({7: {"ours": {"erasure": "over", **row}}})
    text = bench.report("nuclei", bench.BENCHMARKS["nuclei"], agg, {}, {}, "ours", [7])
    line = next(x for x in text.splitlines() if "s7:" in x)
    assert ("behind retraining on every sample" in line) is within


def test_a_boundary_judged_over_counts_on_the_silo_only_where_no_reading_explains_it():
    ref = {"bd_asr": 0.149, "bd_forget_accuracy": 0.367, "bd_mia_auc": 0.5}
    floors = {"bd_asr": 0.043, "bd_forget_accuracy": 0.032, "bd_mia_auc": 0.05}
    over = {
        "erasure": "over",
        "asr@boundary": 0.15,
        "forget_accuracy@boundary": 0.315,  # below the band
        "mia_auc@boundary": 0.5,
    }
    # the forget score's gap to the test score is retraining's: explained
    assert bench.over_on_the_silo({**over, "forget_gap_within": True}, ref, floors) is False
    # it is not: over on the silo's data
    assert bench.over_on_the_silo({**over, "forget_gap_within": False}, ref, floors) is True
    # the MIA AUC below has no reading of its own: over whatever the others say
    mia = {**over, "forget_gap_within": True, "mia_auc@boundary": 0.3}
    assert bench.over_on_the_silo(mia, ref, floors) is True
    # not judged over: not counted
    assert bench.over_on_the_silo({**over, "erasure": "within"}, ref, floors) is None
    # and the report's count
    rows = {7: {"ours": {**over, "forget_gap_within": False, "over_on_the_silo": True}}}
    agg = bench.aggregate(rows)
    assert agg["ours"]["erasure"]["on_the_silo"] == 1


def test_the_report_names_each_seed_whose_asr_was_below_and_why():
    row = {
        "erasure": "over",
        "verified_s": 10.0,
        "window_s": 300.0,
        "asr@boundary": 0.104,
        "asr_without_trigger@boundary": 0.092,
        "asr@retrain": 0.149,
        "asr_without_trigger@retrain": 0.135,
    }
    row.update(bench.trigger_lift(row, band=0.043))
    agg = bench.aggregate(
        {6: {"fedasync-fixed": row}, 7: {"fedasync-fixed": {"erasure": "within"}}}
    )
    assert [s for s, _ in agg["fedasync-fixed"]["asr_below"]] == [6]
    b = bench.BENCHMARKS["nuclei"]
    text = bench.report("nuclei", b, agg, {}, {}, "fedasync-fixed", [6, 7])
    line = next(x for x in text.splitlines() if "s6:" in x)
    assert "lean to the target label" in line and "0.092" in line
