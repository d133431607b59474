"""The server's removal bounded by its held-out score (``unlearning.server_removal_max_drop``).

A removal that lowers the server's held-out score by more than the bound is halved until it
does not (at most four times, then withheld). The unit tests drive `server.removal.bounded`
with a score that falls with the distance moved; the run drives it with the server's own
evaluation on its test set.
"""

import math
from pathlib import Path

import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync.events import read_events
from server.app import run_server
from server.erasure.states import REMOVAL_NOTE
from server.erasure.store import ErasureStore
from server.removal import HALVINGS, bounded

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
        "unlearning.server_removal=true",
        "unlearning.server_removal_max_drop=0",
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
    assert len(notes) == 1
    if ev["applied"] == 0.0:
        assert "withheld" in notes[0]
    elif ev["applied"] < 1.0:
        assert f", {ev['applied']:g} of it" in notes[0]
    else:
        assert "in force at version" in notes[0] and " of it" not in notes[0]
