"""CA2FL (server/strategies/ca2fl.py): cached update calibration, ICLR 2024, Algorithm 1.

The server caches each silo's latest update h_i and steps along v = h̄ + (1/M) Σ (Δ_i − h_i)
over a buffer of M updates, h̄ the mean of all n silos' caches at the round's start. The
unit tests check the step on hand-made updates; the runs check it through the server loop.
"""

from pathlib import Path

import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync import ServerOptimizer, Update
from fedasync.errors import ConfigError
from fedasync.events import read_events
from server.app import run_server
from server.strategies import CA2FL, strategy_for
from server.strategies.ca2fl import CA2FLAggregator


def _x() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(2), "steps": torch.tensor(3)}


def _u(silo: str, *w: float) -> Update:
    return Update(
        silo=silo,
        tensors={"w": torch.tensor(w), "steps": torch.tensor(9)},
        num_samples=10,
        base_version=0,
        kind="delta",
    )


def _fold_all(agg, x, updates):
    """Fold ``updates`` in turn; the model after each step, and the last result."""
    res = None
    for u in updates:
        res = agg.fold(x, u, tau=0)
        if res.params is not None:
            x = res.params
    return x, res


def test_a_step_is_the_mean_cache_plus_the_buffered_calibrations():
    agg = CA2FLAggregator(buffer_size=2, silos=3)
    x = _x()
    # round 1: no cache yet, so the step is the plain mean of the two updates
    x, res = _fold_all(agg, x, [_u("a", 1.0, 0.0), _u("b", 2.0, 0.0)])
    assert res.flushed == 2
    torch.testing.assert_close(x["w"], torch.tensor([1.5, 0.0]))
    assert torch.equal(x["steps"], torch.tensor(3))  # (not a floating tensor: untouched)
    # round 2: a sends 3 (calibration 3 - 1), c sends 6 (no cache: 6); h̄ = (1 + 2 + 0) / 3
    x, res = _fold_all(agg, x, [_u("a", 3.0, 0.0), _u("c", 6.0, 0.0)])
    torch.testing.assert_close(x["w"], torch.tensor([1.5 + 1.0 + (2.0 + 6.0) / 2, 0.0]))
    assert sorted(agg.caches) == ["a", "b", "c"]
    torch.testing.assert_close(agg.caches["a"]["w"], torch.tensor([3.0, 0.0]))


def test_a_silo_twice_in_a_round_is_calibrated_by_its_first_update():
    agg = CA2FLAggregator(buffer_size=2, silos=2)
    x, _ = _fold_all(agg, _x(), [_u("a", 1.0, 1.0), _u("a", 4.0, 1.0)])
    # calibrations 1 - 0 and 4 - 1, h̄ = 0 at the round's start
    torch.testing.assert_close(x["w"], torch.tensor([2.0, 0.5]))


def test_the_buffer_waits_for_m_updates_and_flush_applies_what_it_holds():
    agg = CA2FLAggregator(buffer_size=3, silos=3)
    res = agg.fold(_x(), _u("a", 3.0, 0.0), tau=5)
    assert res.params is None and agg.pending == 1
    res = agg.flush(_x())
    assert res.flushed == 1 and agg.pending == 0
    torch.testing.assert_close(res.params["w"], torch.tensor([3.0, 0.0]))
    assert agg.flush(_x()).params is None  # nothing held


@pytest.mark.parametrize("kind", ["sgd", "momentum"])
def test_the_split_per_silo_sums_to_the_step(kind):
    opt = ServerOptimizer(kind=kind, lr=0.5, momentum=0.9)
    agg = CA2FLAggregator(buffer_size=2, silos=3, optimizer=opt)
    x = _x()
    ups = [_u("a", 1.0, 2.0), _u("b", -1.0, 0.5), _u("a", 0.0, 3.0), _u("c", 2.0, 2.0)]
    ups += [_u("b", 1.0, 1.0), _u("c", -3.0, 1.0)]
    for u in ups:
        res = agg.fold(x, u, tau=0)
        if res.params is None:
            continue
        parts = sum(c["w"] for c in res.contributions.values())
        rest = 0.0 if res.unattributed is None else res.unattributed["w"]
        torch.testing.assert_close(parts + rest, res.applied["w"])
        x = res.params
    assert sorted(res.contributions) == ["a", "b", "c"]  # (a's cache still counts)


def test_an_erased_silo_loses_its_cache_and_its_buffered_updates():
    agg = CA2FLAggregator(buffer_size=2, silos=2)
    x, _ = _fold_all(agg, _x(), [_u("a", 2.0, 0.0), _u("b", 4.0, 0.0)])  # caches a=2, b=4
    agg.fold(x, _u("b", 8.0, 0.0), tau=0)  # buffered
    assert agg.drop("b") == 1
    assert sorted(agg.caches) == ["a"] and agg.pending == 0
    # the next step's h̄ holds a's cache alone: (2 + 0) / 2, plus a's calibration (6 - 2) / 2
    before = x["w"].clone()
    x, _ = _fold_all(agg, x, [_u("a", 6.0, 0.0), _u("a", 6.0, 0.0)])
    torch.testing.assert_close(x["w"] - before, torch.tensor([1.0 + (4.0 + 0.0) / 2, 0.0]))


def test_map_state_reaches_the_caches_and_a_checkpoint_gives_the_same_next_step():
    agg = CA2FLAggregator(buffer_size=2, silos=2)
    x, _ = _fold_all(agg, _x(), [_u("a", 2.0, 1.0), _u("b", 4.0, 1.0)])
    agg.fold(x, _u("a", 1.0, 1.0), tau=0)
    again = CA2FLAggregator(buffer_size=1, silos=1)
    again.load_state_dict(agg.state_dict())
    one, _ = _fold_all(agg, x, [_u("b", 0.0, 2.0)])
    two, _ = _fold_all(again, x, [_u("b", 0.0, 2.0)])
    torch.testing.assert_close(one["w"], two["w"])
    # a projection that keeps only the first coordinate reaches every cache
    again.map_state(lambda p: {"w": p["w"] * torch.tensor([1.0, 0.0])})
    assert all(float(h["w"][1]) == 0.0 for h in again.caches.values())


def test_a_run_of_ca2fl_folds_through_the_server_loop(small_cfg):
    cfg = small_cfg("server.mode=ca2fl", "server.buffer_size=2", "run.max_versions=4")
    assert isinstance(strategy_for(cfg), CA2FL)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    assert summary["versions"] == 4 and summary["mode"] == "ca2fl"
    updates = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"]
    assert len(updates) >= 8  # two updates a step
    assert summary["final_score"] == summary["final_score"]  # (a number, not NaN)


def test_central_dp_is_refused_with_ca2fl_in_one_line(small_cfg):
    with pytest.raises(ConfigError) as e:
        small_cfg("server.mode=ca2fl", "server.clip_norm=1.0", "server.dp.noise_multiplier=1.0")
    assert "ca2fl" in str(e.value) and "\n" not in str(e.value)
