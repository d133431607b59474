"""The bounded sketch of the silos' updates' span (fedasync.unlearning.sketch): what the server's
unique removal and signature_unique project out of, in a fixed number of model-sized rows."""

from __future__ import annotations

import pytest
import torch

from fedasync.flat import flatten
from fedasync.unlearning import (
    GradientSignature,
    SpanSketch,
    outside,
    outside_span,
    params_to_vector,
)

NAMES = ["a", "b"]


def _params(vec: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"a": vec[:6].reshape(2, 3).clone(), "b": vec[6:].clone(), "n": torch.tensor(3)}


def _stream(seed: int, silos: int, per_silo: int, d: int = 10):
    g = torch.Generator().manual_seed(seed)
    return [
        (s, _params(torch.randn(d, generator=g) * (1 + 10 * t)))
        for t in range(per_silo)
        for s in range(silos)
    ]


@pytest.mark.parametrize("flat", [False, True])
def test_with_a_row_per_update_the_others_span_is_exact(flat):
    # Prepare: 3 silos x 2 updates, 6 rows: every update has its own row
    stream = _stream(0, silos=3, per_silo=2)
    sketch = SpanSketch(rows=6, silos=3)
    for s, p in stream:
        assert sketch.add(s, flatten(p) if flat else p)
    g = torch.Generator().manual_seed(1)
    total = _params(torch.randn(10, generator=g))
    # Execute
    got, kept = outside(total, sketch.span(NAMES, without=1), NAMES)
    others = [params_to_vector(p, NAMES) for s, p in stream if s != 1]
    want, want_kept = outside_span(total, others, NAMES)
    # Assert: the same as the exact span of the other silos' updates; silo 1's left out
    assert sketch.others(1) == [0, 2, 3, 5]
    assert kept == pytest.approx(want_kept, abs=1e-5)
    for k in NAMES:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4)
    assert torch.equal(got["n"], total["n"])


def test_the_erasing_silos_own_directions_stay_outside_and_the_shared_ones_inside():
    # Prepare: every silo moves along e0 and its own direction (silo 2: e9), by varying
    # amounts; two rows per silo: each row a signed sum of the silo's updates
    e = torch.eye(10)
    sketch = SpanSketch(rows=8, silos=4)
    for t in range(40):
        for s in range(4):
            own = e[9] if s == 2 else e[1 + s]
            sketch.add(s, _params(e[0] + 0.3 * (t % 3 + 1) * own))
    total = _params(3 * e[0] + 2 * e[9])
    # Execute
    removed, kept = outside(total, sketch.span(NAMES, without=2), NAMES)
    # Assert: the e0 part is the others' (it stays in the model); silo 2's e9 part is removed
    vec = params_to_vector(removed, NAMES)
    assert abs(float(vec[0])) < 1e-4 and float(vec[9]) == pytest.approx(2.0, abs=1e-4)
    assert kept == pytest.approx(4 / 13, abs=1e-4)


def test_memory_stays_at_its_rows_whatever_the_run_length_and_a_checkpoint_restores_it():
    # Prepare: 500 updates of 5 silos into 8 rows
    sketch = SpanSketch(rows=8, silos=5)
    for s, p in _stream(2, silos=5, per_silo=100):
        sketch.add(s, p)
    # Assert: 8 float32 rows of the 10 floating numbers, nothing per update
    assert sketch.nbytes == 8 * 10 * 4 and sketch.added == 500
    # Execute: a checkpoint and a fresh sketch
    again = SpanSketch(rows=8, silos=5)
    again.load_state_dict(sketch.state_dict())
    x = _params(torch.arange(10.0))
    a, ka = outside(x, sketch.span(NAMES, without=3), NAMES)
    b, kb = outside(x, again.span(NAMES, without=3), NAMES)
    # Assert: the same span, and the same rows in the checkpoint as in memory
    assert ka == pytest.approx(kb, abs=1e-6)
    torch.testing.assert_close(params_to_vector(a, NAMES), params_to_vector(b, NAMES))
    with pytest.raises(ValueError, match="8 rows"):
        SpanSketch(rows=9, silos=5).load_state_dict(sketch.state_dict())


def test_more_silos_than_rows_leave_out_the_silos_sharing_the_erasing_silos_rows():
    sketch = SpanSketch(rows=2, silos=4)
    for s, p in _stream(3, silos=4, per_silo=3):
        sketch.add(s, p)
    # silos 0 and 2 write row 0, 1 and 3 row 1
    assert sketch.others(0) == [1] and sketch.silos_in(sketch.others(0)) == {1, 3}


def test_a_zero_non_finite_or_misshapen_update_adds_nothing():
    sketch = SpanSketch(rows=2, silos=2)
    assert sketch.add(0, _params(torch.ones(10)))
    before = sketch.buffer.clone()
    assert not sketch.add(1, _params(torch.zeros(10)))
    assert not sketch.add(1, _params(torch.full((10,), float("nan"))))
    assert not sketch.add(1, {"a": torch.ones(2, 3)})  # "b" missing
    assert not sketch.add(1, {"a": torch.ones(2, 3), "b": torch.ones(5)}, norm=1.0)
    assert torch.equal(sketch.buffer, before) and sketch.added == 1
    with pytest.raises(ValueError, match="at least one row"):
        SpanSketch(rows=0, silos=2)


def test_a_signature_loses_the_sketched_span_as_it_loses_the_exact_one():
    # Prepare
    stream = _stream(4, silos=2, per_silo=2)
    sketch = SpanSketch(rows=4, silos=2)
    for s, p in stream:
        sketch.add(s, p)
    g = torch.Generator().manual_seed(5)
    basis = torch.linalg.qr(torch.randn(10, 3, generator=g))[0]
    sig = GradientSignature.from_basis(basis, NAMES)
    others = [params_to_vector(p, NAMES) for s, p in stream if s != 0]
    # Execute
    span = sketch.span(NAMES, without=0)
    # Assert
    assert sig.share_in(span) == pytest.approx(sig.span_share(others), abs=1e-5)
    got, want = sig.without(span), sig.without_span(others)
    assert got is not None and want is not None and got.rank == want.rank
    torch.testing.assert_close(
        got.basis @ got.basis.T, want.basis @ want.basis.T, atol=1e-5, rtol=0
    )


def test_a_row_untouched_for_thousands_of_updates_is_rescaled_not_lost():
    # Prepare: silo 0's row gets one update, then 5,000 of silo 1 go by (its content has
    # faded by 2^-78, below the rescaling threshold), then one more of silo 0
    e = torch.eye(10)
    sketch = SpanSketch(rows=2, silos=2)
    sketch.add(0, _params(e[3]))
    for _ in range(5000):
        sketch.add(1, _params(e[5]))
    sketch.add(0, _params(e[7]))
    # Assert: silo 0's row is finite and points along its latest update; the old one faded
    row = params_to_vector(sketch.row(0), NAMES)
    assert bool(torch.isfinite(sketch.buffer).all())
    assert abs(float(row[7])) / float(row.norm()) == pytest.approx(1.0, abs=1e-6)
    kept = outside(_params(e[7] + e[5]), sketch.span(NAMES, without=1), NAMES)[1]
    assert kept == pytest.approx(0.5, abs=1e-6)  # e7 in silo 0's span, e5 outside it
