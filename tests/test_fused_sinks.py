"""What a run that can erase keeps of each update, added in the fold's own pass.

A FedAsync fold adds the update into the span sketch's row and its change into the silo's
ledger sum while each chunk is in cache (`fedasync.flat.axpy_sunk`, `server/unlearning/sinks.py`).
It must keep what the unfused path keeps (the sketch's `add` after the fold, exactly; the
ledger's `record` of the fold's contributions, to the new model's rounding: the fused pass
adds a·x, the unfused one new − old), take back what it added when the model it makes is not
finite, and leave to the unfused path what it cannot fuse.
"""

from pathlib import Path

import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync import FedAsyncAggregator, Update, flat, make_weight_fn
from fedasync.flat import Sink, axpy_sunk, flatten
from fedasync.unlearning import ContributionLedger, SpanSketch
from server.app import run_server
from server.corrections import CorrectionPipeline
from server.unlearning.sinks import UpdateSinks


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 elements, so that every buffer below takes several."""
    monkeypatch.setattr(flat, "CHUNK", 64)


def _params(seed: int, scale: float = 1.0) -> flat.FlatParams:
    g = torch.Generator().manual_seed(seed)
    return flatten(
        {
            "a": torch.randn(300, generator=g) * scale,  # float32: one buffer
            "b": (torch.randn(7, 19, generator=g) * scale).double(),  # float64: another
            "steps": torch.tensor(seed),  # an integer: loose, never folded
        }
    )


def _aggregator() -> FedAsyncAggregator:
    return FedAsyncAggregator(0.6, make_weight_fn("polynomial", 0.5, 4.0), attribute=True)


def test_a_fused_fold_keeps_what_the_unfused_one_keeps(small_chunks):
    # Prepare: the same model and three updates of two silos, on two servers' parts
    unfused = (SpanSketch(4, 2), ContributionLedger())
    fused = (SpanSketch(4, 2), ContributionLedger())
    params_u = params_f = _params(0)
    agg = _aggregator()
    for i, silo in enumerate([0, 1, 0]):
        x = _params(10 + i, scale=1e-2)
        norm = flat.global_norm(x)
        # Execute: the fold, then the sketch's add and the ledger's record (unfused)...
        res = agg.fold(params_u, Update(str(silo), 0, x), tau=i)
        unfused[0].add(silo, x, norm)
        unfused[1].record(str(silo), res.contributions[str(silo)], i)
        params_u = res.params
        # ... and the fold that adds into both in its own pass
        sunk = agg.fold_sunk(
            params_f, Update(str(silo), 0, x), i, UpdateSinks(*fused, silo, i), norm
        )
        assert sunk is not None and sunk.sunk and not sunk.contributions
        params_f = sunk.params
    # Assert: the same model and rows, bitwise; the same sums to the new models' rounding
    # (half an ulp of the model per fold apart); the same counts and versions
    for k in params_u:
        assert torch.equal(params_u[k], params_f[k]), k
    assert torch.equal(unfused[0].buffer, fused[0].buffer)
    assert unfused[0].added == fused[0].added == 3
    ulp = 2.0**-23 * max(float(b.abs().max()) for b in params_u.buffers)
    for s in ("0", "1"):
        tu, tf = unfused[1].total(s), fused[1].total(s)
        for k in tu:
            torch.testing.assert_close(tu[k], tf[k], rtol=0, atol=3 * ulp)
        assert unfused[1].count(s) == fused[1].count(s)
        assert unfused[1].last_version(s) == fused[1].last_version(s)


def test_a_fold_whose_model_is_not_finite_takes_back_what_it_added(small_chunks):
    # Prepare: a model whose 200th element overflows with the update (in the fourth chunk)
    y = flatten({"a": torch.full((300,), 1.0)})
    y.buffers[0][200] = 3.0e38
    x = flatten({"a": torch.full((300,), 0.5)})
    x.buffers[0][200] = 3.0e38
    row, total = torch.randn(300), torch.randn(300)
    before = (row.clone(), total.clone())
    sinks = [Sink((row,), 0.25, "update"), Sink((total,), 1.0, "change")]
    # Execute
    out = axpy_sunk(1.0, x, y, sinks, loose_from=y)
    # Assert: the model knows it is not finite; the sums are back where they were
    assert out is not None and out.finite is False
    torch.testing.assert_close(row, before[0])
    torch.testing.assert_close(total, before[1])


def test_what_cannot_be_fused_is_kept_after_the_fold(small_chunks):
    # Prepare: a pipeline that folds with FedAsync, a sketch and a ledger
    from simulations.config import load_config

    cfg = load_config(None, ["erasures=[{silo: 0, at_s: 1.0e9}]"])
    pipe = CorrectionPipeline(cfg)
    sketch, ledger = SpanSketch(4, 2), ContributionLedger()
    x = _params(3, scale=1e-2)
    plain = {k: v.clone() for k, v in x.items()}  # not flat buffers: no fused pass
    # Execute
    res = pipe.fold(
        dict(_params(0)),
        Update("1", 0, plain),
        staleness=0,
        factor=1.0,
        norm=flat.global_norm(x),
        w_base=None,
        sink=UpdateSinks(sketch, ledger, 1, 0),
    )
    # Assert: not sunk; the sketch took the update all the same, the change is in the
    # contributions (the loop records them)
    assert not isinstance(res, Exception) and not res.sunk
    assert sketch.added == 1 and "1" in res.contributions
    assert ledger.silos() == []


def test_in_a_run_every_fold_is_fused_and_the_ledger_adds_up(small_cfg, monkeypatch):
    # Prepare: a run that can erase (the erasure after its end), counting the fused folds
    cfg = small_cfg("run.max_versions=6", "erasures=[{silo: 1, at_s: 100000}]")
    calls = {"sunk": 0, "folds": 0}
    fold_sunk, fold = FedAsyncAggregator.fold_sunk, FedAsyncAggregator.fold

    def counting_sunk(self, *args, **kwargs):
        res = fold_sunk(self, *args, **kwargs)
        calls["sunk"] += res is not None
        return res

    def counting(self, *args, **kwargs):
        calls["folds"] += 1
        return fold(self, *args, **kwargs)

    seen = {}
    from server.loop import AsyncServer

    connect = AsyncServer.connect

    def spy(self):
        seen["srv"], seen["initial"] = self, {k: v.clone() for k, v in self.params.items()}
        connect(self)

    monkeypatch.setattr(FedAsyncAggregator, "fold_sunk", counting_sunk)
    monkeypatch.setattr(FedAsyncAggregator, "fold", counting)
    monkeypatch.setattr(AsyncServer, "connect", spy)
    # Execute
    run_server(InProcessGrid(client_app, 3), cfg, Path(cfg.run.out_dir) / cfg.run.name)
    # Assert: every accepted update was folded in the fused pass (none by the unfused
    # fold), and the silos' sums add up to what the run changed
    srv = seen["srv"]
    assert calls["sunk"] == srv.stats.updates_applied >= 6 and calls["folds"] == 0
    assert srv.erasure.calibration.sketch.added == calls["sunk"]
    ledger = srv.erasure.ledger
    totals = [ledger.total(s) for s in ledger.silos()]
    for name, start in seen["initial"].items():
        if start.is_floating_point():
            recorded = sum(t[name] for t in totals)
            torch.testing.assert_close(recorded, srv.params[name] - start, rtol=1e-4, atol=1e-6)


def test_a_fold_learns_a_bound_and_a_bounded_model_is_proven_finite_without_reading(
    small_chunks, monkeypatch
):
    # Prepare: a model of unknown bound, an update of known norm, a sketch and a ledger
    y, x = _params(0), _params(1, scale=1e-2)
    sink = UpdateSinks(SpanSketch(4, 2), ContributionLedger(), 0, 0)
    norm = flat.global_norm(x)
    # Execute: the first fold reads each chunk's extremes; the second may prove instead
    first = flat.axpy_sunk(0.5, x, y, sink.sinks(x, norm, True), loose_from=y, norm=norm)
    reads = {"n": 0}
    aminmax = torch.aminmax

    def counting(t):
        reads["n"] += 1
        return aminmax(t)

    monkeypatch.setattr(torch, "aminmax", counting)
    second = flat.axpy_sunk(0.5, x, first, sink.sinks(x, norm, True), loose_from=y, norm=norm)
    assert reads["n"] == 0
    unknown = flat.axpy_sunk(0.5, x, first, sink.sinks(x, None, True), loose_from=y, norm=None)
    # Assert: the first learnt its true bound; the second proved itself finite without a
    # read, its bound the first's plus 0.5·norm, above its true largest element; without
    # the norm nothing is proven and the chunks are read
    top = max(float(b.abs().max()) for b in first.buffers)
    assert first.finite is True and first.bound == pytest.approx(top, rel=1e-6)
    assert second.finite is True and second.bound == pytest.approx(first.bound + 0.5 * norm)
    assert second.bound >= max(float(b.abs().max()) for b in second.buffers)
    assert unknown.finite is True and reads["n"] > 0
