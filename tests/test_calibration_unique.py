"""What the calibration protects (issue 14 §2): the part of the erased data's signature unique
to it, and the erased data's forget loss, one-sidedly.

``lab.erasure.signature_unique``: at the boundary the signature loses the span of the other
silos' latest accepted updates (SFU-style, Li et al. 2023), so the calibration does not stop
what everyone's data moves the model along. ``lab.erasure.protect=gradient``/``onesided``: the
erasing silo sends its forget set's mean loss gradient g_f and a later change loses only its
component lowering the forget loss (PCGrad/FedOSD's one-sided projection), with the jump too
for ``onesided``.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from inprocess import CHECKED, InProcessGrid, set_task_identity

import clients.app
import clients.unlearn
from clients.app import app as client_app
from fedasync.events import read_events
from fedasync.unlearning import (
    ErasureJump,
    ForgetGradient,
    GradientSignature,
    block_one_sided,
    params_to_vector,
)
from protocol import keys as P
from protocol import wire
from protocol.config import ClientConfig, DataConfig, Setup, SiloErasure
from protocol.erasure_messages import UnlearnReply, UnlearnRequest
from protocol.reading import Malformed
from server.app import run_server
from server.loop import AsyncServer
from server.unlearning import Calibration, ErasureCoordinator, ErasureRun

E = torch.eye(4)


def _w(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values), "n": torch.tensor(3)}


# ---------------------------------------------------------------- the core
def test_a_signature_direction_in_the_others_span_is_removed_and_an_orthogonal_one_kept():
    # Prepare: the signature spans e1 and e2; the others' updates span e1 and e3
    sig = GradientSignature.from_basis(E[:, :2], ["w"])
    others = [torch.tensor([2.0, 0.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, -3.0, 0.0])]

    # Execute
    unique = sig.without_span(others)

    # Assert: e1 (shared) is gone, e2 (unique) is what is left, orthonormal
    assert unique is not None and unique.rank == 1 and unique.names == ["w"]
    torch.testing.assert_close(unique.basis[:, 0].abs(), E[:, 1])
    assert sig.span_share(others) == pytest.approx(0.5)  # one of two directions was shared


def test_a_partly_shared_direction_keeps_its_unique_part_and_a_fully_shared_one_is_none():
    sig = GradientSignature.from_basis(torch.tensor([[1.0], [1.0], [0.0], [0.0]]), ["w"])
    unique = sig.without_span([torch.tensor([5.0, 0.0, 0.0, 0.0])])
    assert unique is not None and unique.rank == 1
    torch.testing.assert_close(unique.basis[:, 0].abs(), E[:, 1])
    assert sig.span_share([E[0]]) == pytest.approx(0.5)
    assert sig.without_span([E[0], E[1]]) is None  # all of it is the others' too
    kept = sig.without_span([torch.zeros(4)])  # nothing to remove: the signature as it was
    assert kept is not None and torch.equal(kept.basis, sig.basis)
    with pytest.raises(ValueError, match="expected"):
        sig.without_span([torch.zeros(3)])


def test_block_descent_removes_exactly_the_descending_component():
    # g_f = (0, 3, 4, 0): unit (0, .6, .8, 0); a change with <change, g_f> < 0 lowers the loss
    grad = ForgetGradient.unit(torch.tensor([0.0, 3.0, 4.0, 0.0]), ["w"])
    assert grad is not None
    down = _w(1.0, -1.0, -1.0, 2.0)  # <., g> = -1.4
    kept = grad.block_descent(down)
    torch.testing.assert_close(kept["w"], torch.tensor([1.0, -0.16, 0.12, 2.0]))
    assert int(kept["n"]) == 3 and grad.along(kept) == pytest.approx(0.0, abs=1e-6)
    up = _w(0.0, 1.0, -0.5, 7.0)  # <., g> = 0.2: raises the forget loss, left as it is
    assert grad.block_descent(up) is up
    again = ForgetGradient.from_state(grad.state_dict())
    assert isinstance(again, ForgetGradient) and torch.equal(again.direction, grad.direction)
    assert ForgetGradient.unit(torch.zeros(4), ["w"]) is None


def test_jump_and_gradient_together_go_against_neither():
    # Prepare: directions at an obtuse angle, where blocking one after the other fails
    jump = ErasureJump.between({"w": torch.zeros(2)}, {"w": torch.tensor([1.0, 0.0])})
    grad = ForgetGradient.unit(torch.tensor([-0.6, 0.8]), ["w"])
    assert jump is not None and grad is not None
    change = {"w": torch.tensor([-1.0, -1.0])}
    in_turn = grad.block_descent(jump.block_reversal(change))
    assert jump.along(in_turn) < -0.1  # the second projection undid the first

    # Execute
    both = block_one_sided(change, [jump, grad])

    # Assert: the nearest change against neither (here none at all: -change is in their cone)
    torch.testing.assert_close(both["w"], torch.zeros(2), atol=1e-6, rtol=0)
    assert (
        block_one_sided(change, [jump])["w"].tolist() == jump.block_reversal(change)["w"].tolist()
    )
    onward = {"w": torch.tensor([1.0, 1.0])}
    assert block_one_sided(onward, [jump, grad]) is onward


# ---------------------------------------------------------------- the protocol
def _reply(gradient=None):
    set_task_identity()
    setup = Setup(ClientConfig(), DataConfig(), num_silos=3, seed=5).to_json()
    params = {"w": torch.randn(3, 2), "n": torch.tensor(4)}
    req = UnlearnRequest(setup, 7, 3, 11, params, SiloErasure()).to_message(9)
    req.metadata.__dict__["_message_id"] = "m-1"
    basis = torch.linalg.qr(torch.randn(6, 2))[0]
    reply = UnlearnReply(1, 7, 3, 2, params, basis, ("w",), {"signature_rank": 2.0}, gradient)
    return reply.to_message(reply_to=req)


def test_the_forget_gradient_travels_in_the_reply_and_an_old_reply_still_parses():
    g = torch.randn(6).half()
    back = UnlearnReply.from_message(_reply(g))
    assert back.gradient is not None and back.gradient.dtype == torch.float16
    assert torch.equal(back.gradient, g)
    old = _reply()  # as a silo without the gradient sends it
    assert P.FORGET_GRADIENT not in old.content
    assert UnlearnReply.from_message(old).gradient is None


@pytest.mark.parametrize(
    "arrays",
    [
        {"gradient": torch.randn(5)},
        {"gradient": torch.full((6,), float("nan"))},
        {"gradient": torch.ones(6, dtype=torch.int64)},
        {"other": torch.randn(6)},
    ],
)
def test_a_bad_forget_gradient_is_malformed(arrays):
    msg = _reply()
    msg.content[P.FORGET_GRADIENT] = wire.encode(arrays)
    with pytest.raises(Malformed, match="forget.gradient"):
        UnlearnReply.from_message(msg)


# ---------------------------------------------------------------- the config
def test_defaults_and_the_new_choices_load(small_cfg):
    cfg = small_cfg()
    lab = cfg.lab.erasure
    assert (lab.signature_unique, lab.sketch_rank, lab.protect) == (False, 16, "jump")
    for protect in ("gradient", "onesided"):
        assert small_cfg(f"lab.erasure.protect={protect}").lab.erasure.protect == protect
    with pytest.raises(ValueError, match="sketch_rank"):
        small_cfg("lab.erasure.sketch_rank=0")


# ---------------------------------------------------------------- the server's sketch
def _coordinator(small_cfg, *overrides) -> ErasureCoordinator:
    # 3 silos, 6 rows: two rows per silo, so each of a silo's first two updates has its own
    cfg = small_cfg("lab.erasure.signature_unique=true", "lab.erasure.sketch_rank=6", *overrides)
    return _bare(cfg)


def _bare(cfg) -> ErasureCoordinator:
    """A coordinator of an empty model, with no silos, store or verification."""
    run = ErasureRun(cfg, None, None, {}, {}, score=lambda params: 0.0)  # type: ignore[arg-type]
    return ErasureCoordinator(SimpleNamespace(params={}, version=0), None, run, None, None)  # type: ignore[arg-type]


def _job(silo: int) -> SimpleNamespace:
    return SimpleNamespace(silo=silo, base_version=0)


def test_the_sketch_spans_the_others_updates_leaves_out_the_erased_silo_and_is_checkpointed(
    small_cfg,
):
    # Prepare: four accepted updates; silo 0 will erase
    coord = _coordinator(small_cfg)
    for silo, values in [(1, (0.0, 0.0, 0.0, 9.0)), (1, (1.0, 0.0, 0.0, 0.0)),
                         (0, (0.0, 1.0, 0.0, 0.0)), (2, (0.0, 0.0, 1.0, 0.0))]:  # fmt: skip
        assert coord.calibration.calibrate(_job(silo), _w(*values))[0] is not None
        coord.fold_sink(silo, 0).unfused(_w(*values), None)  # (as folded: not a flat update)
    sketch = coord.calibration.sketch
    assert sketch is not None and sketch.names == ["w"] and sketch.added == 4
    assert sketch.others(0) == [1, 2, 4]  # silo 1's two rows and silo 2's first

    # Execute: a restart in between (the sketch is in the coordinator's state)
    again = _coordinator(small_cfg)
    again.load_state_dict(coord.state_dict())
    erasure = SimpleNamespace(silo=0, request_id="r")
    unique, report = again.calibration._unique(
        erasure, GradientSignature.from_basis(E[:, :3], ["w"])
    )

    # Assert: e1 and e3 (silos 1 and 2) removed; e2 (the erasing silo's own update) kept;
    # the others' span is e1, e3 and e4 (silo 1's first update)
    assert unique is not None and unique.rank == 1
    torch.testing.assert_close(unique.basis[:, 0].abs(), E[:, 1])
    assert report == {
        "signature_shared": pytest.approx(2 / 3),
        "signature_rank_sent": 3.0,
        "signature_rank_unique": 1.0,
        "unique_span_rank": 3.0,
    }


def test_without_signature_unique_no_sketch_is_kept(small_cfg):
    cfg = small_cfg("lab.erasure.server_removal_part=total")  # (the unique removal keeps one)
    coord = _bare(cfg)
    coord.calibration.calibrate(_job(1), _w(1.0, 0.0, 0.0, 0.0))
    coord.fold_sink(1, 0).unfused(_w(1.0, 0.0, 0.0, 0.0), None)
    assert coord.calibration.sketch is None and coord.state_dict()["sketch"] is None


# ---------------------------------------------------------------- the whole run
@pytest.fixture
def gradient_glue(monkeypatch):
    """Records the mean forget gradient the silo computes and sends (``last``: the gradient
    and its tensor names), for the arm whose server does not keep it."""
    sent: dict = {}
    with_gradient = clients.unlearn.forget_signature_with_gradient

    def recording(*args, **kwargs):
        sig, grad = with_gradient(*args, **kwargs)
        sent["last"] = (grad, sig.names)
        return sig, grad

    monkeypatch.setattr(clients.unlearn, "forget_signature_with_gradient", recording)
    return sent


def _run(small_cfg, monkeypatch, *overrides):
    cfg = small_cfg(
        "run.max_versions=16",
        "server.mode=fedbuff",
        "server.buffer_size=2",
        "server.optimizer.kind=momentum",
        "server.optimizer.momentum=0.9",
        "server.eval_every=5",
        "erasures=[{silo: 0, at_s: 6}]",
        "lab.erasure.relearn_versions=4",
        "unlearning.steps=5",
        *overrides,
    )
    seen: dict = {"versions": []}
    new_version = AsyncServer._new_version

    def spy(self, params):
        seen["srv"] = self
        seen["versions"].append((self.version + 1, {k: v.clone() for k, v in params.items()}))
        new_version(self, params)

    monkeypatch.setattr(AsyncServer, "_new_version", spy)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED  # the window ended; what the calibration did is tested below
    events = read_events(run_dir / "metrics.jsonl")
    (seen["calibrating"],) = [
        e for e in events if e["event"] == "erasure" and e["state"] == "calibrating"
    ]
    return seen


def test_a_run_with_the_unique_signature_is_checked_and_says_what_it_removed(
    small_cfg, monkeypatch
):
    # Prepare: catch the signature as sent and the sketch's rows of the other silos it met
    caught: dict = {}
    unique = Calibration._unique

    def catch(self, erasure, sig):
        caught["sent"] = sig
        rows = [self.sketch.row(j) for j in self.sketch.others(erasure.silo)]
        caught["window"] = [params_to_vector(p, sig.names) for p in rows]
        return unique(self, erasure, sig)

    monkeypatch.setattr(Calibration, "_unique", catch)

    # Execute
    seen = _run(small_cfg, monkeypatch, "lab.erasure.signature_unique=true")

    # Assert: the event says how much of the signature the others' span held
    ev = seen["calibrating"]
    assert 0.0 < ev["signature_shared"] <= 1.0
    assert 1 <= ev["unique_span_rank"] <= len(caught["window"])
    assert ev["signature_rank_unique"] <= ev["signature_rank_sent"] == caught["sent"].rank
    # the signature in force has nothing along the others' updates; the one sent had
    updates = [{"u": w} for w in caught["window"]]
    sent = GradientSignature(caught["sent"].basis, ["u"])
    assert max(sent.overlap(u) for u in updates) > 1e-3
    sig = seen["srv"].erasure.calibration.signature
    if sig is not None:  # (None: all of it lay in their span)
        in_force = GradientSignature(sig.basis, ["u"])
        assert max(in_force.overlap(u) for u in updates) < 1e-4


RELEARN = (
    "lab.backdoor.enabled=true",
    "lab.backdoor.silo=0",
    "lab.backdoor.target_label=0",
    "lab.backdoor.relearn_silo=1",
    "lab.backdoor.relearn_after_s=0",
    "lab.backdoor.relearn_samples=8",
)
"""Silo 0's data carries a backdoor; silo 1 relearns it from 8 poisoned samples throughout."""


def _along_after_boundary(seen, direction) -> list[float]:
    srv = seen["srv"]
    versions = seen["versions"]
    out = []
    for (v0, p0), (_v1, p1) in zip(versions, versions[1:]):
        if v0 >= srv.erasure.calibration.boundary:
            out.append(direction.along({k: p1[k] - p0[k] for k in direction.names}))
    assert out, "no version after the boundary"
    return out


@pytest.mark.parametrize("protect", ["jump", "onesided"])
def test_with_the_forget_gradient_protected_no_version_lowers_the_forget_loss(
    small_cfg, monkeypatch, gradient_glue, protect
):
    # Execute: the jump alone, and the jump with the forget gradient (both one-sided); the
    # erasure waits for silo 0's job in flight, as when this scenario was made: with that job
    # cancelled the boundary comes earlier, and in the jump-alone arm no later version of this
    # short run happened to descend along the forget gradient (min 0.0011, not < -1e-3)
    seen = _run(
        small_cfg, monkeypatch, "lab.erasure.calibration_target=applied",
        f"lab.erasure.protect={protect}", "lab.erasure.cancel_inflight=false", *RELEARN,
    )  # fmt: skip

    # Assert: the silo's gradient came; with it no step after the boundary descends along it
    erasure = seen["srv"].erasure
    (jump,) = erasure.calibration.jumps
    assert min(_along_after_boundary(seen, jump)) > -1e-4  # the jump is held in both arms
    if protect == "onesided":
        assert seen["calibrating"]["forget_gradient"] == 1.0
        (grad,) = erasure.calibration.gradients
        assert min(_along_after_boundary(seen, grad)) > -1e-4
        again = ErasureCoordinator(erasure.model, erasure.silos, erasure.run, None, None)
        again.load_state_dict(erasure.state_dict())
        assert torch.equal(again.calibration.gradients[0].direction, grad.direction)
    else:  # the jump alone lets the others' training lower the erased data's loss
        assert not erasure.calibration.gradients and "forget_gradient" not in seen["calibrating"]
        grad = ForgetGradient.unit(*gradient_glue["last"])
        assert grad is not None and min(_along_after_boundary(seen, grad)) < -1e-3


def test_onesided_without_a_gradient_from_the_silo_is_checked_and_says_so(small_cfg, monkeypatch):
    # a silo that sends no forget gradient (older): only the jump is protected
    def older(*args, **kwargs):
        return UnlearnReply(*args, **{**kwargs, "gradient": None})

    monkeypatch.setattr(clients.app, "UnlearnReply", older)
    seen = _run(
        small_cfg, monkeypatch, "lab.erasure.calibration_target=applied",
        "lab.erasure.protect=onesided",
    )  # fmt: skip
    assert seen["calibrating"]["forget_gradient"] == 0.0
    assert not seen["srv"].erasure.calibration.gradients
    assert len(seen["srv"].erasure.calibration.jumps) == 1
