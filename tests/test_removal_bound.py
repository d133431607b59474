"""The server's removal bounded by its held-out score (``lab.erasure.server_removal_max_drop``).

A removal that lowers the server's held-out score by more than the bound is halved until it
does not (at most four times, then withheld). The unit tests drive `server.removal.bounded`
with a score that falls with the distance moved; the run drives it with the server's own
evaluation on its test set.
"""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync.events import EventLog, read_events
from server.app import run_server
from server.erasure.states import REMOVAL_NOTE, SILO_PART_NOTE, State
from server.erasure.store import ErasureStore
from server.removal import HALVINGS, Remainder, bounded
from server.unlearning import ErasureCoordinator, ErasureRun
from server.unlearning.requests import Erasure

W0 = torch.tensor([1.0, -2.0, 0.5])
REMOVAL = {"w": torch.tensor([0.1, 0.0, -0.1])}  # an L1 length of 0.2


def _params():
    return {"w": W0.clone(), "steps": torch.tensor(7)}


def falls(per_unit: float):
    """A score of 0.9 that falls by ``per_unit`` per unit of L1 distance from W0."""
    return lambda p: 0.9 - per_unit * float((p["w"] - W0).abs().sum())


def test_a_removal_within_the_bound_is_applied_whole():
    new, m = bounded(_params(), REMOVAL, falls(0.05), max_drop=0.02)  # costs 0.01
    assert m["removal_applied"] == 1.0
    torch.testing.assert_close(new["w"], W0 + REMOVAL["w"])
    assert m["removal_score_before"] - m["removal_score_after"] == pytest.approx(0.01)
    assert torch.equal(new["steps"], torch.tensor(7))  # (not a floating tensor: untouched)


def test_a_removal_that_costs_too_much_is_halved_until_it_does_not():
    # the whole costs 0.1; a half 0.05; a quarter 0.025; an eighth 0.0125 <= 0.02
    new, m = bounded(_params(), REMOVAL, falls(0.5), max_drop=0.02)
    assert m["removal_applied"] == 0.125
    torch.testing.assert_close(new["w"], W0 + 0.125 * REMOVAL["w"])
    assert m["removal_score_before"] - m["removal_score_after"] <= 0.02


def test_a_removal_that_costs_too_much_even_at_its_smallest_share_is_withheld():
    new, m = bounded(_params(), REMOVAL, falls(100.0), max_drop=0.02)
    assert 100.0 * 0.2 * 2.0**-HALVINGS > 0.02  # (even the smallest share costs more)
    assert m["removal_applied"] == 0.0
    assert torch.equal(new["w"], W0)
    assert m["removal_score_after"] == m["removal_score_before"]


def test_no_bound_at_one_and_none_without_a_measured_score():
    whole = W0 + REMOVAL["w"]
    new, m = bounded(_params(), REMOVAL, falls(100.0), max_drop=1.0)
    assert m["removal_applied"] == 1.0 and torch.allclose(new["w"], whole)
    new, m = bounded(_params(), REMOVAL, lambda p: math.nan, max_drop=0.02)
    assert m["removal_applied"] == 1.0 and torch.allclose(new["w"], whole)


def test_a_removal_that_raises_the_score_is_applied_whole():
    new, m = bounded(_params(), REMOVAL, falls(-1.0), max_drop=0.0)
    assert m["removal_applied"] == 1.0
    assert m["removal_score_after"] > m["removal_score_before"]


def test_in_a_run_the_removal_costs_the_held_out_score_at_most_the_bound(small_cfg):
    # Prepare: a whole-silo erasure with the unique removal, bounded at no fall at all
    cfg = small_cfg(
        "run.max_versions=12",
        "lab.erasure.server_removal=true",
        "lab.erasure.server_removal_max_drop=0",
        "erasures=[{silo: 1, at_s: 4}]",
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    # Assert: the 'removed' event's share is one of the halvings, and the score it measured
    # on the server's test set fell by no more than the bound unless the removal was withheld
    events = read_events(run_dir / "metrics.jsonl")
    (ev,) = [e for e in events if e.get("event") == "erasure" and e["state"] == "removed"]
    shares = [1.0] + [2.0**-k for k in range(1, HALVINGS + 1)] + [0.0]
    assert ev["applied"] in shares
    assert ev["score_before"] - ev["score_after"] <= 0.0 or ev["applied"] == 0.0
    # and the audit note says what was applied
    store = ErasureStore(run_dir / "erasures.sqlite")
    try:
        (req,) = store.list()
        notes = [a.detail for a in store.audit(req.id) if a.detail.startswith(REMOVAL_NOTE)]
    finally:
        store.close()
    if ev["applied"] == 0.0:
        assert "withheld" in notes[0]
    elif ev["applied"] < 1.0:
        assert f", {ev['applied']:g} of it" in notes[0]
    else:
        assert "in force at version" in notes[0] and " of it" not in notes[0]
    # the rest, if any, came in steps at later evaluations, each once the score was back to
    # its level before the request and within the bound, each with its note (and one more if
    # some was never applied)
    more = [e for e in events if e.get("event") == "erasure" and e["state"] == "removed_more"]
    assert all(e["score_before"] - e["score_after"] <= 0.0 for e in more)
    assert all(e["score_before"] >= ev["score_before"] for e in more)
    assert all(0.0 < e["applied"] <= 1.0 - ev["applied"] for e in more)
    assert sum(e["applied"] for e in more) <= 1.0 - ev["applied"] + 1e-9
    assert [n for n in notes[1:] if "a further" in n] == notes[1 : 1 + len(more)]
    assert len(notes) - 1 - len(more) in (0, 1)


# ------------------------------------------------------------------ the withheld rest, in steps
def test_a_remainder_is_what_the_bound_withheld_and_each_step_takes_a_share_of_it():
    assert Remainder.of(REMOVAL, 1.0, 0.9) is None  # applied whole: nothing left
    rest = Remainder.of(REMOVAL, 0.25, 0.9)
    assert rest is not None and rest.left == 0.75
    torch.testing.assert_close(rest.removal["w"], 0.75 * REMOVAL["w"])
    # a score that falls 0.5 per unit of L1 distance: the rest (L1 0.15) costs 0.075, a quarter
    # of it 0.019 <= 0.02, so a quarter of the rest (3/16 of the whole) is applied
    params = _params()
    new, m = rest.step(params, falls(0.5), max_drop=0.02)
    assert m["removal_applied"] == 0.25 and m["removal_step"] == pytest.approx(0.1875)
    assert rest.left == pytest.approx(0.5625) == m["removal_left"]
    torch.testing.assert_close(new["w"], W0 + 0.1875 * REMOVAL["w"])
    torch.testing.assert_close(rest.removal["w"], 0.5625 * REMOVAL["w"])
    # a score that does not fall: the rest whole, then nothing is left
    new, m = rest.step(new, falls(0.0), max_drop=0.02, before=0.9)
    assert m["removal_step"] == pytest.approx(0.5625) and rest.left == 0.0
    torch.testing.assert_close(new["w"], W0 + 0.75 * REMOVAL["w"])  # all the rest, in two steps
    # a step the bound allows none of changes nothing
    again = Remainder.of(REMOVAL, 0.0, 0.9)
    assert again is not None
    same, m = again.step(params, falls(100.0), max_drop=0.02)
    assert m["removal_step"] == 0.0 and again.left == 1.0 and torch.equal(same["w"], W0)
    back = Remainder.from_state(again.state_dict())
    assert back.left == 1.0 and back.reference == 0.9
    assert torch.equal(back.removal["w"], REMOVAL["w"])


def test_a_step_waits_until_the_score_is_back_to_its_level_before_the_request():
    # the score was 0.9 before the request and is 0.885 now: no step, however small
    rest = Remainder(dict(REMOVAL), 1.0, reference=0.9)
    same, m = rest.step(_params(), lambda p: falls(0.5)(p) - 0.015, max_drop=0.02)
    assert m["removal_step"] == 0.0 and rest.left == 1.0 and torch.equal(same["w"], W0)
    # back to 0.9: the largest share within the bound (a quarter costs 0.025, an eighth 0.0125)
    _, m = rest.step(_params(), falls(0.5), max_drop=0.02)
    assert m["removal_step"] == 0.125 and rest.left == 0.875
    # a score above the level before the request: measured from the score now
    _, m = Remainder(dict(REMOVAL), 1.0, reference=0.8).step(
        _params(), lambda p: falls(0.5)(p) - 0.015, max_drop=0.02
    )
    assert m["removal_applied"] == 0.125


class _Host:
    """The model an erasure coordinator changes (``ServedModel``): one whose held-out
    score falls 0.5 per unit of L1 distance from ``anchor``, where the other silos' training
    would bring it back (the test moves it); a version made by ``apply_erasure`` is seen by
    the coordinator as the loop would show it (``on_version``, evaluated)."""

    def __init__(self, cfg, run_dir: Path):
        self.cfg, self.version, self.params = cfg, 0, _params()
        self.anchor = W0.clone()
        self.clock = SimpleNamespace(now=0.0, kind="virtual", realtime=False)
        self.roster, self.num_samples = {0: 0, 1: 1}, {0: 10, 1: 10}
        self.events = EventLog(run_dir / "metrics.jsonl")
        self.checkpoints = 0
        self.coordinator = None

    def evaluate_fn(self, params):
        return {"score": 0.9 - 0.5 * float((params["w"] - self.anchor).abs().sum())}

    def apply_erasure(self, params):
        self.params, self.version = params, self.version + 1
        self.coordinator.on_version(self.evaluate_fn(params)["score"])  # (a nested version)

    def checkpoint(self):
        self.checkpoints += 1

    def coordinate(self, store: ErasureStore) -> ErasureCoordinator:
        """An erasure coordinator of this model (no silo jobs: none is sent)."""
        run = ErasureRun(
            self.cfg,
            self.clock,  # type: ignore[arg-type]
            self.events,
            self.roster,
            self.num_samples,
            score=lambda params: self.evaluate_fn(params)["score"],
        )
        return ErasureCoordinator(self, None, run, store, verify_fn=lambda *a: {})  # type: ignore[arg-type]


@pytest.fixture
def erasing(small_cfg, tmp_path):
    """A coordinator over ``_Host`` with a whole-silo request of silo 1 in progress, whose
    removal (L1 0.2) costs 0.1 of the held-out score, bounded at 0.02: (host, store,
    coordinator, request id, erasure)."""
    cfg = small_cfg("lab.erasure.server_removal_max_drop=0.02")
    host = _Host(cfg, tmp_path)
    store = ErasureStore(tmp_path / "erasures.sqlite")
    coord = host.coordinate(store)
    host.coordinator = coord
    req, _ = store.submit(1, None, "test", 0)
    e = Erasure(req.id, 1, [], 0.0, removal=dict(REMOVAL))
    coord.active[req.id] = e
    try:
        yield host, store, coord, req.id, e
    finally:
        store.close()


def test_the_withheld_rest_of_a_removal_is_applied_in_steps_as_the_score_comes_back(
    erasing, tmp_path
):
    # Prepare: the request above
    host, store, coord, rid, e = erasing
    # Execute: the removal at the request, then evaluations with no recovery
    coord._remove_now(e)
    assert coord.remainders[rid].left == pytest.approx(0.875)  # an eighth in force
    steps: list[int] = []

    def evaluation() -> None:
        before = host.version
        coord.on_version(host.evaluate_fn(host.params)["score"])
        steps.extend([host.version] if host.version > before else [])

    for _ in range(3):
        evaluation()
    # Assert: without recovery (the score below 0.9, its level before the request) no
    # step is taken
    assert coord.remainders[rid].left == pytest.approx(0.875)
    assert steps == []
    # Execute: the others' training brings the score back (the anchor moves to the model)
    # at each evaluation, until the rest is in force
    for _ in range(8):
        host.anchor = host.params["w"].clone()
        evaluation()
        if rid not in coord.remainders:
            break
    # Assert: each step is a version of its own, bounded, and the whole removal is in force
    assert rid not in coord.remainders and len(steps) >= 3
    torch.testing.assert_close(host.params["w"], W0 + REMOVAL["w"])
    events = read_events(tmp_path / "metrics.jsonl")
    more = [ev for ev in events if ev.get("state") == "removed_more"]
    assert [ev["version"] for ev in more] == steps
    assert all(ev["score_before"] - ev["score_after"] <= 0.02 + 1e-9 for ev in more)
    totals = [ev["applied_total"] for ev in more]
    assert totals == sorted(totals) and totals[-1] == pytest.approx(1.0)
    notes = [a.detail for a in store.audit(rid) if a.detail.startswith(REMOVAL_NOTE)]
    assert len(notes) == 1 + len(steps)
    assert "the rest is applied in steps" in notes[0] and "all of it is in force" in notes[-1]
    assert all("back to its level before the request" in n for n in notes[1:])
    assert host.checkpoints == 1 + len(steps)  # each step durable before its note


def test_a_remainder_survives_a_checkpoint_and_a_failed_request_says_what_was_never_applied(
    erasing,
):
    host, store, coord, rid, e = erasing
    coord._remove_now(e)
    again = host.coordinate(store)
    again.load_state_dict(coord.state_dict())
    (rest,) = again.remainders.values()
    assert rest.left == pytest.approx(0.875)
    torch.testing.assert_close(rest.removal["w"], 0.875 * REMOVAL["w"])
    store.transition(rid, State.ERASING, actor="server", model_version=1)
    coord.failed(e, "a test's reason")
    assert coord.remainders == {}
    notes = [a.detail for a in store.audit(rid) if a.detail.startswith(REMOVAL_NOTE)]
    assert "0.125 of it in force when the request was failed" in notes[-1]
    assert "the rest (0.875) was never applied" in notes[-1]


# ------------------------------------------------- the silo's own part, held to the same bound
def test_the_silo_s_own_part_is_held_to_the_removal_s_bound_and_its_rest_follows_in_steps(
    erasing, tmp_path
):
    # Prepare: the silo's reply (its ascent) costs 0.1 of the held-out score, bounded at 0.02
    host, store, coord, rid, e = erasing
    e.removal = None  # (the server's removal is not the subject here)
    # Execute: the part at the boundary, then evaluations as the others' training recovers
    new, held = coord._bounded_silo_part(e, dict(REMOVAL))
    host.params = new
    assert held == {"silo_part_applied": 0.125}  # an eighth costs 0.0125 <= 0.02
    torch.testing.assert_close(new["w"], W0 + 0.125 * REMOVAL["w"])
    assert set(coord.remainders) == {f"{rid}:silo"}
    for _ in range(8):
        host.anchor = host.params["w"].clone()
        coord.on_version(host.evaluate_fn(host.params)["score"])
        if not coord.remainders:
            break
    # Assert: all of the part in force, each step within the bound and said to be the silo's
    assert coord.remainders == {}
    torch.testing.assert_close(host.params["w"], W0 + REMOVAL["w"])
    more = [
        ev for ev in read_events(tmp_path / "metrics.jsonl") if ev.get("state") == "removed_more"
    ]
    assert more and all(ev["part"] == "silo" for ev in more)
    assert all(ev["score_before"] - ev["score_after"] <= 0.02 + 1e-9 for ev in more)
    assert more[-1]["applied_total"] == pytest.approx(1.0)
    notes = [a.detail for a in store.audit(rid) if a.detail.startswith(SILO_PART_NOTE)]
    assert "0.125 of it at the boundary" in notes[0] and "all of it is in force" in notes[-1]
    assert not [a for a in store.audit(rid) if a.detail.startswith(REMOVAL_NOTE)]


def test_a_failed_request_says_what_of_the_silo_s_part_was_never_applied(erasing):
    host, store, coord, rid, e = erasing
    e.removal = None
    coord._bounded_silo_part(e, dict(REMOVAL))
    store.transition(rid, State.ERASING, actor="server", model_version=1)
    coord.failed(e, "a test's reason")
    assert coord.remainders == {}
    notes = [a.detail for a in store.audit(rid) if a.detail.startswith(SILO_PART_NOTE)]
    assert "0.125 of it in force when the request was failed" in notes[-1]


def test_in_a_run_the_silo_s_part_costs_the_held_out_score_at_most_the_bound(small_cfg):
    cfg = small_cfg(
        "run.max_versions=14",
        "lab.erasure.silo_part_bounded=true",
        "unlearning.server_removal_max_drop=0",
        "erasures=[{silo: 1, at_s: 4}]",
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    events = [e for e in read_events(run_dir / "metrics.jsonl") if e.get("event") == "erasure"]
    (removed,) = [e for e in events if e["state"] == "removed"]
    (boundary,) = [e for e in events if e["state"] == "calibrating"]
    shares = [1.0] + [2.0**-k for k in range(1, HALVINGS + 1)] + [0.0]
    assert boundary["silo_part_applied"] in shares
    # the boundary's model is no lower than the score before the request, unless none of the
    # silo's part was applied (and then only the removal's own bounded cost)
    if boundary["silo_part_applied"] > 0.0:
        assert boundary["score_after"] >= removed["score_before"] - 1e-9
    silo_steps = [e for e in events if e["state"] == "removed_more" and e.get("part") == "silo"]
    assert all(e["score_before"] - e["score_after"] <= 0.0 for e in silo_steps)
