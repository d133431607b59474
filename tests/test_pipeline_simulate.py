"""The pipeline schedule simulator: GPipe's bubble on equal stages, the flushed against the
unflushed steady time per batch, no stage runs two operations at once, every message is
waited for (and no longer), latency and a slow stage cost what they should; measured costs
come back from events; the timeline and loss plots write PNGs."""

import math

import pytest

from trainers.pipeline.plots import plot_loss, plot_timeline
from trainers.pipeline.schedule import SCHEDULES, run_order
from trainers.pipeline.simulate import (
    StageCosts,
    Timeline,
    estimate_comm,
    from_measurements,
    ideal_bubble,
    simulate,
)

P, M = 4, 8
UNIT = StageCosts.uniform(P, 1, 1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_flushed_batch_has_gpipes_bubble(schedule):
    t = simulate(schedule, P, M, 1, UNIT)
    assert t.makespan == (M + P - 1) * 2
    assert t.busy == [M * 2] * P
    assert t.bubble_fraction == pytest.approx(ideal_bubble(P, M))
    assert t.idle_fractions == pytest.approx([ideal_bubble(P, M)] * P)
    assert t.steady_step_time == t.makespan == t.step_time


def test_ideal_bubble():
    assert ideal_bubble(4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble(1, 5) == 0
    with pytest.raises(ValueError):
        ideal_bubble(0, 4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_steady_step_time_flush_against_no_flush(schedule):
    t = simulate(schedule, P, M, 20, UNIT)
    if schedule in ("2bw", "paci"):
        assert t.steady_step_time == M * 2
        assert t.makespan == (M + P - 1) * 2 + 19 * M * 2  # one fill, then no bubble
    else:
        assert t.steady_step_time == (M + P - 1) * 2
        assert t.makespan == 20 * (M + P - 1) * 2
    assert t.step_time == t.makespan / 20


CASES = [
    ("equal", UNIT),
    ("comm", StageCosts.uniform(P, 1, 2, step=0.5, comm=0.25)),
    ("slow", StageCosts([1, 3, 1, 2], [2, 5, 1, 3], [0.5, 0, 1, 0], comm=0.5)),
]


def _by_stage(t: Timeline) -> list[list[dict]]:
    out: list[list[dict]] = [[] for _ in range(t.stages)]
    for e in t.events:
        out[e["stage"]].append(e)
    return [sorted(es, key=lambda e: (e["start"], e["end"])) for es in out]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name,costs", CASES)
def test_stages_run_their_order_one_op_at_a_time(schedule, name, costs):
    t = simulate(schedule, P, 3, 4, costs)
    for s, (es, order) in enumerate(zip(_by_stage(t), run_order(schedule, P, 3, 4))):
        for a, b in zip(es, es[1:]):
            assert b["start"] >= a["end"]
        expect = []
        for kind, j in order:
            expect.append((kind, j))
            if kind == "B" and j % 3 == 2:
                expect.append(("S", j))
        assert [(e["kind"], e["micro"]) for e in es] == expect
        durations = {"F": costs.forward[s], "B": costs.backward[s], "S": costs.step[s]}
        for e in es:
            assert e["end"] - e["start"] == pytest.approx(durations[e["kind"]])
        assert t.busy[s] == pytest.approx(sum(e["end"] - e["start"] for e in es))
    assert t.makespan == max(e["end"] for e in t.events)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name,costs", CASES)
def test_every_dependency_is_respected_and_ops_start_as_early_as_allowed(schedule, name, costs):
    t = simulate(schedule, P, 3, 4, costs)
    end = {(e["kind"], e["stage"], e["micro"]): e["end"] for e in t.events}
    for es in _by_stage(t):
        free = 0.0
        for e in es:
            kind, s, j = e["kind"], e["stage"], e["micro"]
            ready = 0.0
            if kind == "F" and s > 0:
                ready = end[("F", s - 1, j)] + costs.comm
            elif kind == "B" and s < P - 1:
                ready = end[("B", s + 1, j)] + costs.comm
            elif kind == "B":
                ready = end[("F", s, j)]
            elif kind == "S":
                ready = end[("B", s, j)]
            assert e["start"] >= ready - 1e-12
            assert e["start"] == pytest.approx(max(free, ready))  # list scheduling: no slack
            free = e["end"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_comm_latency_increases_the_makespan(schedule):
    base = simulate(schedule, P, M, 3, UNIT).makespan
    late = simulate(schedule, P, M, 3, StageCosts.uniform(P, 1, 1, comm=0.5)).makespan
    assert late > base


def test_gpipe_pays_latency_once_per_batch_1f1b_without_flush_per_micro_batch():
    # GPipe: the fill and the drain each cross P − 1 links once per batch.
    t = simulate("gpipe", P, M, 1, StageCosts.uniform(P, 1, 1, comm=0.5))
    assert t.makespan == (M + P - 1) * 2 + 2 * (P - 1) * 0.5
    # Unflushed 1F1B keeps P − s − 1 warm-up forwards, sized for no latency: the P
    # micro-batches in flight at stage 0 make a round trip of P·(f + b) + 2(P − 1)·c, so the
    # steady time per micro-batch grows by 2(P − 1)·c / P.
    for c in (0.25, 0.5, 1.0, 3.0):
        t = simulate("paci", P, M, 12, StageCosts.uniform(P, 1, 1, comm=c))
        assert t.steady_step_time == pytest.approx(M * (2 + 2 * (P - 1) * c / P))
        g = simulate("gpipe", P, M, 12, StageCosts.uniform(P, 1, 1, comm=c))
        assert g.steady_step_time == pytest.approx((M + P - 1) * 2 + 2 * (P - 1) * c)
    # Past c = (f + b)·P / (2(M − P)) = 1 here, the flushed GPipe is the faster.
    assert g.steady_step_time < t.steady_step_time


@pytest.mark.parametrize(
    "forward,backward",
    [
        ([1, 1, 1, 3], [1, 1, 1, 5]),
        ([1, 1, 3, 1], [1, 1, 5, 1]),
        ([3, 1, 1, 1], [5, 1, 1, 1]),
        ([1, 2, 3, 4], [2, 4, 6, 8]),
        ([4, 3, 2, 1], [8, 6, 4, 2]),
    ],
)
def test_slow_stage_sets_the_unflushed_steady_step_time(forward, backward):
    t = simulate("paci", P, M, 20, StageCosts(forward, backward, [0] * P))
    assert t.steady_step_time == M * (max(forward) + max(backward))
    flushed = simulate("1f1b", P, M, 20, StageCosts(forward, backward, [0] * P))
    assert flushed.steady_step_time >= t.steady_step_time


def test_optimiser_step_occupies_the_stage():
    for step in (1, 3):
        t = simulate("paci", P, M, 20, StageCosts.uniform(P, 1, 1, step=step))
        assert t.steady_step_time == M * 2 + step
    t = simulate("gpipe", P, M, 2, StageCosts.uniform(P, 1, 1, step=2))
    assert [e["kind"] for e in t.events].count("S") == 2 * P
    assert t.makespan == 2 * ((M + P - 1) * 2 + 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(forward=[1, 1], backward=[1], step=[0, 0]),
        dict(forward=[], backward=[], step=[]),
        dict(forward=[1, -1], backward=[1, 1], step=[0, 0]),
        dict(forward=[1, 1], backward=[1, math.nan], step=[0, 0]),
        dict(forward=[1, 1], backward=[1, 1], step=[0, math.inf]),
        dict(forward=[1, 1], backward=[1, 1], step=[0, 0], comm=-0.1),
        dict(forward=[1, 1], backward=[1, 1], step=[0, 0], comm=math.nan),
        dict(forward=[1, "1"], backward=[1, 1], step=[0, 0]),
    ],
)
def test_invalid_costs_raise(kwargs):
    with pytest.raises(ValueError):
        StageCosts(**kwargs)


def test_invalid_simulation_arguments_raise():
    with pytest.raises(ValueError, match="stages"):
        simulate("paci", 3, M, 2, UNIT)
    with pytest.raises(ValueError, match="batches"):
        simulate("paci", P, M, 0, UNIT)
    with pytest.raises(ValueError, match="schedule"):
        simulate("zb", P, M, 1, UNIT)


def test_one_stage_has_no_bubble():
    t = simulate("1f1b", 1, 4, 3, StageCosts([1], [2], [1]))
    assert t.bubble_fraction == 0
    assert t.makespan == 3 * (4 * 3 + 1)


def test_costs_come_back_from_events():
    costs = StageCosts([1, 3, 1, 2], [2, 5, 1, 3], [0.5, 0, 1, 0], comm=0.5)
    t = simulate("paci", P, 4, 5, costs)
    assert from_measurements(t.events) == StageCosts(costs.forward, costs.backward, costs.step)
    assert estimate_comm(t.events) == 0.5
    assert from_measurements(t.events, comm=None) == costs
    assert from_measurements(t.events, comm=0.1).comm == 0.1
    # Medians ignore a slow outlier (a first call that compiles).
    events = [dict(e) for e in t.events]
    first_f0 = next(e for e in events if e["kind"] == "F" and e["stage"] == 0)
    first_f0["end"] += 100
    assert from_measurements(events).forward[0] == 1
    # A measured timeline (shifted clock) gives the simulated bubble.
    shifted = [{**e, "start": e["start"] + 1e3, "end": e["end"] + 1e3} for e in t.events]
    m = Timeline.from_events("paci", P, 4, 5, shifted)
    assert m.makespan == pytest.approx(t.makespan)
    assert m.bubble_fraction == pytest.approx(t.bubble_fraction)
    assert m.steady_step_time == pytest.approx(t.steady_step_time)
    with pytest.raises(ValueError, match="no 'B'"):
        from_measurements([e for e in t.events if not (e["kind"] == "B" and e["stage"] == 2)])
    with pytest.raises(ValueError):
        from_measurements([])


def test_plots_write_pngs(tmp_path):
    t = simulate("1f1b", P, M, 2, StageCosts.uniform(P, 1, 2, step=0.5, comm=0.1))
    out = plot_timeline(t.events, tmp_path / "sub" / "timeline.png", "1F1B, P=4, m=8")
    assert out == tmp_path / "sub" / "timeline.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000
    assert plot_timeline([], tmp_path / "empty.png", "nothing").stat().st_size > 0
    curves = {"sync": [(0, 3.0), (1, 2.5), (2, 2.2)], "paci": [(0, 3.0), (1, 2.4)], "none": []}
    out = plot_loss(curves, tmp_path / "loss.png", "step", "loss")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
