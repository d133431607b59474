"""Calibrating what is applied (issue 14 §1-§2): the four paths past a reply-level projection.

A projection of each reply as it arrives leaves erased directions in what the server carries
past the erasure boundary: FedBuff's buffer, the server optimiser's momentum, error-feedback
residuals, and delay compensation's w_now − w_base. With
``lab.erasure.calibration_target=applied`` the change each fold makes is projected after every
correction and the optimiser, and at the boundary the carried state is projected (the erased
silo's buffered deltas and residual dropped). Each test below fails without the piece it names:
the reply-level arm is run beside it and shows the leak.
"""

from pathlib import Path

import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync import ErasureJump, Update
from fedasync.unlearning import GradientSignature
from server.app import run_server
from server.corrections import CorrectionPipeline
from server.loop import AsyncServer

E1 = GradientSignature.from_basis(torch.tensor([[1.0], [0.0], [0.0], [0.0]]), ["w"])
"""The erased subspace: the first coordinate of the one tensor ``w``."""


def _project(change):
    return E1.project_out(change)


def _along_e1(change) -> float:
    return abs(float(change["w"][0]))


def _pipeline(small_cfg, *overrides) -> CorrectionPipeline:
    return CorrectionPipeline(small_cfg("server.mode=fedbuff", *overrides))


def _update(silo: str, values) -> Update:
    return Update(silo, 0, {"w": torch.tensor(values)}, num_samples=1, kind="delta")


def _fold(pipe, params, silo, values, *, project=None, calibrate=None):
    return pipe.fold(
        params,
        _update(silo, values),
        staleness=0,
        factor=1.0,
        norm=1.0,
        w_base=None,
        calibrate=calibrate,
        project=project,
    )


@pytest.mark.parametrize("target", ["reply", "applied"])
def test_momentum_carried_past_the_boundary_is_projected_only_when_applied_is(small_cfg, target):
    # Prepare: server momentum 0.9 built up along e1 before the erasure
    pipe = _pipeline(
        small_cfg, "server.buffer_size=1", "server.optimizer.kind=momentum",
        "server.optimizer.momentum=0.9", "server.optimizer.lr=1.0",
    )  # fmt: skip
    params = {"w": torch.zeros(4)}
    params = _fold(pipe, params, "0", [1.0, 1.0, 0.0, 0.0]).params

    # Execute: the erasure takes effect; a later update with no e1 component at all
    if target == "applied":
        pipe.at_boundary("1", _project)
        res = _fold(pipe, params, "0", [0.0, 1.0, 1.0, 0.0], project=_project)
    else:
        res = _fold(pipe, params, "0", [0.0, 1.0, 1.0, 0.0], calibrate=_project)
    change = {"w": res.params["w"] - params["w"]}

    # Assert: the reply-level arm applies the old velocity along e1 (0.9); applied does not
    if target == "applied":
        assert _along_e1(change) < 1e-6
        assert _along_e1(pipe.aggregator.optimizer.state_dict()["m"]) < 1e-6
    else:
        assert _along_e1(change) == pytest.approx(0.9)


@pytest.mark.parametrize("target", ["reply", "applied"])
def test_the_erased_silos_buffered_delta_is_dropped_at_the_boundary(small_cfg, target):
    # Prepare: FedBuff K=2 holds the erased silo 1's delta, accepted before the boundary
    pipe = _pipeline(small_cfg, "server.buffer_size=2", "server.optimizer.lr=1.0")
    params = {"w": torch.zeros(4)}
    assert _fold(pipe, params, "1", [0.0, 0.0, 5.0, 0.0]).params is None

    # Execute: the boundary; then silo 0's update (nothing along e1) fills the buffer
    if target == "applied":
        assert pipe.at_boundary("1", _project) == 1
    res = _fold(pipe, params, "0", [0.0, 2.0, 0.0, 0.0], project=_project)
    if target == "applied":
        assert res.params is None  # silo 0's delta waits for a second one
        res = _fold(pipe, params, "0", [0.0, 2.0, 0.0, 0.0], project=_project)

    # Assert: silo 1's erased work (coordinate 2) reaches the model only without the drop
    assert res.params is not None
    assert float(res.params["w"][2]) == (0.0 if target == "applied" else 2.5)


def test_error_feedback_residuals_are_projected_and_the_erased_silos_dropped(small_cfg):
    # Prepare: top-1 of 4 leaves residuals along e1 for silos 0 and 1
    pipe = _pipeline(small_cfg, "server.buffer_size=1", "lab.corrections.error_feedback_topk=0.25")
    params = {"w": torch.zeros(4)}
    for silo in ("0", "1"):
        params = _fold(pipe, params, silo, [1.0, 3.0, 0.0, 0.0]).params
    assert _along_e1(pipe.ef.residual("0")) == pytest.approx(1.0)

    # Execute
    pipe.at_boundary("1", _project)

    # Assert
    assert pipe.ef.residual("1") is None
    assert _along_e1(pipe.ef.residual("0")) < 1e-6
    assert float(pipe.ef.residual("0")["w"][1]) == pytest.approx(0.0)  # was sent: no residual


def test_applied_contributions_are_the_projected_change(small_cfg):
    # With the ledger on (server_removal), the projected fold's shares still sum to its change
    pipe = CorrectionPipeline(
        small_cfg(
            "server.mode=fedbuff",
            "server.buffer_size=2",
            "lab.erasure.server_removal=true",
            "erasures=[{silo: 1, at_s: 100000}]",  # (a run that can erase records shares)
        )
    )
    params = {"w": torch.zeros(4)}
    _fold(pipe, params, "0", [1.0, 1.0, 0.0, 0.0], project=_project)
    res = _fold(pipe, params, "1", [3.0, 0.0, 1.0, 0.0], project=_project)
    total = sum(c["w"] for c in res.contributions.values())
    torch.testing.assert_close(total, res.params["w"] - params["w"])
    assert _along_e1({"w": total}) < 1e-6


def test_the_jump_blocks_only_moving_back_along_it():
    # jump from 0 to (3, 4, 0): unit direction (0.6, 0.8, 0); the int buffer is not a direction
    before = {"w": torch.zeros(3), "n": torch.tensor(5)}
    jump = ErasureJump.between(before, {"w": torch.tensor([3.0, 4.0, 0.0]), "n": torch.tensor(6)})
    assert jump is not None
    torch.testing.assert_close(jump.direction, torch.tensor([0.6, 0.8, 0.0]))
    back = {"w": torch.tensor([-3.0, 1.0, 2.0]), "n": torch.tensor(7)}  # <., j> = -1.8 + 0.8
    assert jump.along(back) == pytest.approx(-1.0)
    kept = jump.block_reversal(back)
    torch.testing.assert_close(kept["w"], torch.tensor([-2.4, 1.8, 2.0]))
    assert int(kept["n"]) == 7 and jump.along(kept) == pytest.approx(0.0, abs=1e-6)
    onward = {"w": torch.tensor([1.0, 1.0, 0.0]), "n": torch.tensor(7)}  # <., j> = 1.4 > 0
    assert jump.block_reversal(onward) is onward
    again = ErasureJump.from_state(jump.state_dict())
    torch.testing.assert_close(again.direction, jump.direction)
    assert ErasureJump.between(before, before) is None


def test_the_default_protects_the_applied_change_against_the_jump_and_reply_still_loads(small_cfg):
    # the resurfacing benchmark's choice (docs/measured.md); reply projects every reply out of
    # the signature whatever protect says, so it loads with the default protect
    cfg = small_cfg()
    lab = cfg.lab.erasure
    assert (lab.calibration, lab.calibration_target, lab.protect) == (
        True,
        "applied",
        "jump",
    )
    assert small_cfg("lab.erasure.calibration_target=reply").lab.erasure.protect == "jump"


# ---------------------------------------------------------------- the whole run
def _run(small_cfg, monkeypatch, target, protect="subspace"):
    cfg = small_cfg(
        "run.max_versions=24",
        "lab.speed.profile=stragglers",
        "lab.speed.straggler_fraction=0.34",
        "lab.speed.straggler_slowdown=10",
        "server.mode=fedbuff",
        "server.buffer_size=2",
        "server.optimizer.kind=momentum",
        "server.optimizer.momentum=0.9",
        "server.optimizer.lr=1.0",
        "lab.corrections.delay_compensation=0.5",
        "lab.corrections.error_feedback_topk=0.5",
        "erasures=[{silo: 0, at_s: 6}]",  # silo 1 is the straggler
        "lab.erasure.relearn_versions=4",
        "unlearning.steps=5",
        f"lab.erasure.calibration_target={target}",
        f"lab.erasure.protect={protect}",
    )
    seen: dict = {"versions": []}
    new_version = AsyncServer._new_version

    def spy(self, params):
        seen["srv"] = self
        seen["versions"].append(
            (
                self.version + 1,
                {k: v.clone() for k, v in params.items()},
                self.erasure.calibration.boundary,
            )
        )
        new_version(self, params)

    monkeypatch.setattr(AsyncServer, "_new_version", spy)
    run_server(InProcessGrid(client_app, 3), cfg, Path(cfg.run.out_dir) / cfg.run.name)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("target", ["reply", "applied"])
def test_after_the_boundary_no_version_moves_along_the_erased_signature(
    small_cfg, monkeypatch, target
):
    # Execute: FedBuff with momentum, delay compensation, error feedback and a straggler
    seen = _run(small_cfg, monkeypatch, target)

    # Assert: every step after the boundary, measured against the signature in force
    sig = seen["srv"].erasure.calibration.signature
    assert sig is not None
    boundary = seen["srv"].erasure.calibration.boundary
    versions = seen["versions"]
    overlaps = []
    for (v0, p0, _), (_v1, p1, _) in zip(versions, versions[1:]):
        if v0 >= boundary:
            change = {k: p1[k] - p0[k] for k in p0 if p0[k].is_floating_point()}
            overlaps.append(sig.overlap(change))
    assert overlaps, "no version after the boundary"
    if target == "applied":
        assert max(overlaps) < 1e-4, overlaps
    else:  # what the server carried past the boundary still moves along it
        assert max(overlaps) > 1e-3, overlaps


@pytest.mark.slow
def test_with_the_jump_protected_the_model_never_reverts_toward_the_pre_erasure_model(
    small_cfg, monkeypatch
):
    # Execute
    seen = _run(small_cfg, monkeypatch, "applied", protect="jump")

    # Assert: for each of the erasure's jumps j (the server's removal at the request, the
    # silo's part at the boundary B), rho_j(t) = <w_t - w_B, -j> / |j|^2 <= 0 after B: no
    # version moves back along either
    srv = seen["srv"]
    boundary = srv.erasure.calibration.boundary
    (row,) = srv.erasure.report
    params = {v: p for v, p, _ in seen["versions"]}
    names = [k for k, t in params[boundary].items() if t.is_floating_point()]

    def flat(p):
        return torch.cat([p[k].reshape(-1).double() for k in names])

    w_b = flat(params[boundary])
    moments = [boundary] + ([row["removed_version"]] if row["removed_version"] else [])
    jumps = [flat(params[v]) - flat(params[v - 1]) for v in moments]
    jumps = [j for j in jumps if float(j.norm()) > 0]  # (a silo's test may stop at 0 steps)
    assert jumps, "the erasure moved the model"
    rhos = [
        float((flat(p) - w_b) @ -j / (j @ j))
        for j in jumps
        for v, p in params.items()
        if v > boundary
    ]
    assert rhos, "no version after the boundary"
    assert max(rhos) < 1e-4, rhos
