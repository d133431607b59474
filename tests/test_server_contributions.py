"""What the erasure ledger records is exactly what the folds applied, for every aggregator.

With ``lab.erasure.server_removal`` the coordinator subtracts a silo's recorded contributions
from the model, so they must add up to what the silos' updates did to it: over a whole run,
the silos' summed contributions equal the final model minus the initial one (no central DP,
so nothing is unattributed). Before issue 13 the loop recorded a first-order share that was,
by its own comment, exact only for FedAsync and for FedBuff with server SGD.
"""

from pathlib import Path

import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from server.app import run_server
from server.loop import AsyncServer
from server.unlearning import Calibration, ErasureCoordinator

MODES = {
    "fedasync": ("server.mode=fedasync",),
    "fedbuff-sgd": ("server.mode=fedbuff", "server.buffer_size=2"),
    "fedbuff-momentum": (
        "server.mode=fedbuff",
        "server.buffer_size=2",
        "server.optimizer.kind=momentum",
        "server.optimizer.momentum=0.9",
    ),
    "fedbuff-adam": (
        "server.mode=fedbuff",
        "server.buffer_size=2",
        "server.optimizer.kind=adam",
        "server.optimizer.lr=0.01",
    ),
    "sync": ("server.mode=sync",),
    "ca2fl": ("server.mode=ca2fl", "server.buffer_size=2"),
    "ca2fl-momentum": (
        "server.mode=ca2fl",
        "server.buffer_size=2",
        "server.optimizer.kind=momentum",
        "server.optimizer.momentum=0.9",
    ),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_recorded_contributions_sum_to_what_the_run_changed(mode, small_cfg, monkeypatch):
    # Prepare: a run with the ledger on and an erasure scheduled after its end (the
    # coordinator exists and records, nothing is erased)
    cfg = small_cfg(
        "run.max_versions=6",
        "lab.erasure.server_removal=true",
        "erasures=[{silo: 1, at_s: 100000}]",
        *MODES[mode],
    )
    seen: dict[str, AsyncServer] = {}
    connect = AsyncServer.connect

    def spy(self):
        seen["srv"], seen["initial"] = self, {k: v.clone() for k, v in self.params.items()}
        connect(self)

    monkeypatch.setattr(AsyncServer, "connect", spy)

    # Execute
    run_server(InProcessGrid(client_app, 3), cfg, Path(cfg.run.out_dir) / cfg.run.name)

    # Assert
    srv, initial = seen["srv"], seen["initial"]
    ledger = srv.erasure.ledger
    assert ledger.silos() == ["0", "1", "2"]
    totals = [ledger.total(s) for s in ledger.silos()]
    for name, start in initial.items():
        if not start.is_floating_point():
            continue
        changed = srv.params[name] - start
        recorded = sum(t[name] for t in totals)
        assert float(changed.abs().max()) > 0, name
        torch.testing.assert_close(recorded, changed, rtol=1e-4, atol=1e-6)


def _spies(monkeypatch, rows: bool = False):
    """What the server's removal saw (the model before and after it, the silo's recorded
    total, the erasure, the version before it; with ``rows``, the sketch's rows of the other
    silos instead of the version), the versions it made, and where the silo's erasure
    started."""
    seen: list[tuple] = []
    removed: list[int] = []
    starts: list[dict] = []
    on_removal, dispatch = Calibration.removed, AsyncServer.dispatch_unlearn

    def removal_spy(self, e, old, new):
        srv = spied["srv"]
        total = srv.erasure.ledger.total(str(e.silo))
        last: object = srv.version
        if rows:
            sk = self.sketch
            last = [{k: v.clone() for k, v in sk.row(j).items()} for j in sk.others(e.silo)]
        seen.append(({k: v.clone() for k, v in old.items()}, dict(new), total, e, last))
        return on_removal(self, e, old, new)

    def dispatch_spy(self, silo, start, e):
        spied["srv"] = self
        starts.append(dict(start))
        removed.extend([] if e.removed_version is None else [e.removed_version])
        return dispatch(self, silo, start, e)

    spied: dict = {}
    real_start = ErasureCoordinator._start

    def start_spy(self, req, resumed=False):
        spied["srv"] = self.model  # (the server loop)
        return real_start(self, req, resumed)

    monkeypatch.setattr(Calibration, "removed", removal_spy)
    monkeypatch.setattr(AsyncServer, "dispatch_unlearn", dispatch_spy)
    monkeypatch.setattr(ErasureCoordinator, "_start", start_spy)
    return seen, removed, starts


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_the_removal_at_request_time_subtracts_its_share_of_the_silos_contributions(
    scale, small_cfg, monkeypatch
):
    # Prepare: silo 1 is erased after a few versions, the server removing `scale` of what
    # the ledger recorded for it at once, before the silo's own ascent starts
    cfg = small_cfg(
        "run.max_versions=12",
        "lab.erasure.server_removal=true",
        f"lab.erasure.server_removal_scale={scale}",
        "lab.erasure.server_removal_part=total",
        "lab.erasure.server_removal_max_drop=1",  # (the held-out bound: test_removal_bound.py)
        "erasures=[{silo: 1, at_s: 4}]",
    )
    seen, removed, starts = _spies(monkeypatch)
    # Execute
    run_server(InProcessGrid(client_app, 3), cfg, Path(cfg.run.out_dir) / cfg.run.name)
    # Assert: the model moved by minus that share, exactly, at once (the next version), and
    # the silo's erasure started from that model
    (params, start, total, _e, version), *_ = seen
    assert removed == [version + 1]
    assert all(torch.equal(starts[0][k], v) for k, v in start.items())
    moved = 0.0
    for name, p in params.items():
        if name not in total:
            continue
        torch.testing.assert_close(start[name], p - scale * total[name], rtol=1e-5, atol=1e-7)
        moved += float(total[name].abs().sum())
    assert moved > 0, "the silo had contributions to remove"


def test_the_unique_removal_subtracts_only_what_the_others_updates_do_not_span(
    small_cfg, monkeypatch
):
    # Prepare: as above, with server_removal_part=unique and a sketch of 6 rows (2 per silo)
    cfg = small_cfg(
        "run.max_versions=12",
        "lab.erasure.server_removal=true",
        "lab.erasure.server_removal_part=unique",
        "lab.erasure.sketch_rank=6",
        "lab.erasure.server_removal_max_drop=1",
        "erasures=[{silo: 1, at_s: 4}]",
    )
    seen, _removed, _starts = _spies(monkeypatch, rows=True)
    # Execute
    run_server(InProcessGrid(client_app, 3), cfg, Path(cfg.run.out_dir) / cfg.run.name)
    # Assert: what was subtracted is orthogonal to every row of the others in the sketch,
    # smaller than the whole sum, and its share is reported
    (params, start, total, e, others), *_ = seen
    names = sorted(k for k, v in total.items() if v.is_floating_point())
    removed = torch.cat([(params[k] - start[k]).reshape(-1).double() for k in names])
    whole = torch.cat([total[k].reshape(-1).double() for k in names])
    assert others, "the other silos' updates were kept"
    for p in others:
        u = torch.cat([p[k].reshape(-1).double() for k in names])
        assert abs(float(removed @ u)) <= 1e-4 * float(removed.norm() * u.norm())
    kept = float(removed.pow(2).sum() / whole.pow(2).sum())
    assert 0.0 < kept < 1.0
    assert e.start_report["removal_kept"] == pytest.approx(kept, rel=1e-3)
    assert e.start_report["removal_span_rank"] == len(others)  # (independent rows)


def test_a_sample_level_erasure_gets_no_removal(small_cfg, monkeypatch):
    # Prepare: the defaults (unique removal on), a request for 30% of silo 1's samples
    cfg = small_cfg("run.max_versions=12", "erasures=[{silo: 1, at_s: 4, fraction: 0.3}]")
    seen: list[tuple[dict, dict, object]] = []
    dispatch = AsyncServer.dispatch_unlearn

    def spy(self, silo, start, e):
        seen.append(({k: v.clone() for k, v in self.params.items()}, dict(start), e))
        return dispatch(self, silo, start, e)

    monkeypatch.setattr(AsyncServer, "dispatch_unlearn", spy)
    # Execute
    run_server(InProcessGrid(client_app, 3), cfg, Path(cfg.run.out_dir) / cfg.run.name)
    # Assert: the silo starts from the global model itself, and the report says why
    (params, start, e), *_ = seen
    assert cfg.lab.erasure.server_removal and e.sample_ids
    assert all(torch.equal(start[k], v) for k, v in params.items())
    assert e.removal is None and e.start_report["removal"] == "none: a sample-level erasure"
