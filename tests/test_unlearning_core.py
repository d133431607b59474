import math

import pytest
import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.unlearning import (
    ContributionLedger,
    GradientSignature,
    UpdateHistory,
    federaser_step,
    l2_distance,
    outside_span,
    params_to_vector,
    project_to_ball,
    vector_to_params,
)


def _p(**kw):
    return {k: torch.tensor(v) for k, v in kw.items()}


def test_params_to_vector_round_trip_mixed_dtypes():
    # Prepare
    p = {
        "w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "b": torch.tensor([5.0], dtype=torch.float16),
        "num_batches_tracked": torch.tensor(7),
        "a": torch.tensor([6.0], dtype=torch.float64),
    }

    # Execute
    vec = params_to_vector(p)
    vec_named = params_to_vector(p, ["w", "b"])
    back = vector_to_params(vec * 2, p)

    # Assert
    assert vec.dtype == torch.float64  # widest floating dtype present
    assert vec.tolist() == [6.0, 5.0, 1.0, 2.0, 3.0, 4.0]  # sorted names: a, b, w
    assert vec_named.dtype == torch.float32 and vec_named.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert list(back) == list(p)
    assert back["w"].tolist() == [[2.0, 4.0], [6.0, 8.0]] and back["w"].dtype == torch.float32
    assert back["b"].tolist() == [10.0] and back["b"].dtype == torch.float16
    assert back["a"].tolist() == [12.0] and back["a"].dtype == torch.float64
    assert back["num_batches_tracked"].item() == 7
    assert vector_to_params(params_to_vector(p, ["w"]), p, ["w"])["a"].tolist() == [
        6.0
    ]  # left out: copied
    with pytest.raises(TypeError):
        params_to_vector(p, ["num_batches_tracked"])
    with pytest.raises(ValueError):
        vector_to_params(torch.zeros(3), p)


def test_project_to_ball_by_hand():
    # Prepare
    center = _p(x=[0.0, 0.0], n=0)
    outside = _p(x=[3.0, 4.0], n=5)
    inside = _p(x=[0.3, 0.4], n=5)

    # Execute
    pulled = project_to_ball(outside, center, 1.0)
    kept = project_to_ball(inside, center, 1.0)
    shifted = project_to_ball(_p(x=[1.0, 5.0]), _p(x=[1.0, 1.0]), 2.0)

    # Assert
    assert l2_distance(outside, center) == pytest.approx(5.0)
    assert pulled["x"].tolist() == pytest.approx([0.6, 0.8])
    assert pulled["n"].item() == 5
    assert kept["x"].tolist() == pytest.approx([0.3, 0.4])
    assert shifted["x"].tolist() == pytest.approx([1.0, 3.0])
    assert outside["x"].tolist() == [3.0, 4.0]  # input untouched


def test_signature_from_gradients_in_e1_e2_plane():
    # Prepare: gradients in R^3 all in span(e1, e2)
    grads = [_p(g=[1.0, 0.0, 0.0]), _p(g=[0.0, 2.0, 0.0]), _p(g=[1.0, 1.0, 0.0])]

    # Execute
    sig = GradientSignature.from_gradients(grads, rank=3, energy=1.0)
    projected = sig.project_out(_p(g=[1.0, 2.0, 3.0]))
    half = sig.project_out(_p(g=[1.0, 2.0, 3.0]), strength=0.5)

    # Assert
    assert sig.rank == 2 and sig.names == ["g"] and sig.basis.shape == (3, 2)
    assert torch.allclose(sig.basis.T @ sig.basis, torch.eye(2), atol=1e-6)
    assert sig.basis[2].abs().max() < 1e-6  # no component along e3
    assert projected["g"].tolist() == pytest.approx([0.0, 0.0, 3.0], abs=1e-6)
    assert half["g"].tolist() == pytest.approx([0.5, 1.0, 3.0], abs=1e-6)
    assert sig.overlap(_p(g=[1.0, 2.0, 3.0])) == pytest.approx(math.sqrt(5 / 14), abs=1e-6)
    assert sig.overlap(_p(g=[0.0, 0.0, 0.0])) == 0.0
    assert sig.overlap(_p(g=[0.0, 0.0, 2.0])) == pytest.approx(0.0, abs=1e-6)
    assert sig.nbytes == 3 * 2 * 4


def test_energy_cut_off_and_rank_cap():
    # Prepare: G = [[3,0,0],[0,1,0],[0,0,0]] -> singular values 3, 1, 0; energy 9/10 then 10/10
    grads = [_p(g=[3.0, 0.0, 0.0]), _p(g=[0.0, 1.0, 0.0]), _p(g=[0.0, 0.0, 0.0])]

    # Execute
    r_90 = GradientSignature.from_gradients(grads, rank=3, energy=0.9).rank
    r_95 = GradientSignature.from_gradients(grads, rank=3, energy=0.95).rank
    r_all = GradientSignature.from_gradients(grads, rank=3, energy=1.0).rank
    r_cap = GradientSignature.from_gradients(grads, rank=1, energy=0.99).rank
    zero = GradientSignature.from_gradients([_p(g=[0.0, 0.0])], rank=2)

    # Assert
    assert (r_90, r_95, r_all, r_cap) == (1, 2, 2, 1)
    assert zero.rank == 0 and zero.project_out(_p(g=[1.0, 2.0]))["g"].tolist() == [1.0, 2.0]


def test_signature_names_order_and_other_tensors_untouched():
    # Prepare
    grads = [{"a": torch.tensor([1.0]), "b": torch.tensor([0.0, 0.0])}]
    update = {"a": torch.tensor([2.0]), "b": torch.tensor([3.0, 4.0]), "c": torch.tensor([9.0])}

    # Execute
    sig = GradientSignature.from_gradients(grads, rank=4, names=["b", "a"])
    out = sig.project_out(update)

    # Assert
    assert sig.names == ["b", "a"] and sig.basis.shape == (3, 1)
    assert out["a"].tolist() == pytest.approx([0.0])
    assert out["b"].tolist() == [3.0, 4.0] and out["c"].tolist() == [9.0]


def test_merge_two_rank_one_signatures():
    # Prepare
    s1 = GradientSignature.from_gradients([_p(g=[2.0, 0.0, 0.0])], rank=1)
    s2 = GradientSignature.from_gradients([_p(g=[1.0, 1.0, 0.0])], rank=1)

    # Execute
    merged = s1.merge(s2)
    same = s1.merge(s1)

    # Assert
    assert merged.rank == 2
    assert torch.allclose(merged.basis.T @ merged.basis, torch.eye(2), atol=1e-6)
    assert merged.project_out(_p(g=[1.0, 2.0, 3.0]))["g"].tolist() == pytest.approx(
        [0.0, 0.0, 3.0], abs=1e-6
    )
    assert same.rank == 1


def test_calibration_leaves_no_overlap():
    # Prepare: a rank-4 signature in R^50 and random updates
    gen = torch.Generator().manual_seed(0)
    grads = [{"w": torch.randn(10, 5, generator=gen)} for _ in range(4)]
    sig = GradientSignature.from_gradients(grads, rank=4, energy=1.0)
    updates = [{"w": torch.randn(10, 5, generator=gen) + 3 * grads[0]["w"]} for _ in range(5)]

    # Execute
    before = [sig.overlap(u) for u in updates]
    after = [sig.overlap(sig.project_out(u)) for u in updates]

    # Assert
    assert sig.rank == 4
    assert min(before) > 0.5
    assert max(after) < 1e-5


def test_signature_state_round_trip(tmp_path):
    # Prepare
    sig = GradientSignature.from_gradients([_p(g=[1.0, 2.0]), _p(g=[0.0, 1.0])], rank=2)

    # Execute
    save_checkpoint(tmp_path / "sig.pt", sig.state_dict())
    back = GradientSignature.from_state_dict(load_checkpoint(tmp_path / "sig.pt"))

    # Assert
    assert back.names == ["g"] and torch.equal(back.basis, sig.basis)


def test_ledger_running_sums_by_hand_and_state_round_trip(tmp_path):
    # Prepare
    ledger = ContributionLedger()
    steps = torch.tensor(3)

    # Execute
    ledger.record("a", {"w": torch.tensor([1.0, 2.0]), "n": steps}, version=1)
    ledger.record("b", {"w": torch.tensor([10.0, 10.0]), "n": steps}, version=2)
    ledger.record("a", {"w": torch.tensor([0.5, -1.0]), "n": steps}, version=3)
    save_checkpoint(tmp_path / "ledger.pt", ledger.state_dict())
    back = ContributionLedger()
    back.load_state_dict(load_checkpoint(tmp_path / "ledger.pt"))
    removed = back.without({"w": torch.tensor([5.0, 5.0]), "n": torch.tensor(0)}, "a")
    back.forget("a")

    # Assert
    assert ledger.total("a")["w"].tolist() == [1.5, 1.0]
    assert ledger.count("a") == 2 and ledger.last_version("a") == 3
    assert ledger.total("b")["w"].tolist() == [10.0, 10.0] and ledger.count("b") == 1
    assert ledger.total("c") is None and ledger.count("c") == 0
    assert removed["w"].tolist() == [3.5, 4.0]
    assert back.total("a") is None and back.count("a") == 0 and back.silos() == ["b"]
    assert back.total("b")["w"].tolist() == [10.0, 10.0] and back.last_version("b") == 2
    assert ledger.silos() == ["a", "b"]  # the original is independent of the loaded copy


def test_outside_span_keeps_what_the_others_updates_do_not_move_along():
    # Prepare: the silo's sum (3, 4, 12) over tensors w (2) and b (1); the others' updates span
    # the first axis (two parallel ones, different lengths: one direction)
    total = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0]), "n": torch.tensor(7)}
    names = ["b", "w"]  # params_to_vector order: b, then w -> coordinates (12, 3, 4)
    others = [torch.tensor([0.0, 2.0, 0.0]), torch.tensor([0.0, -0.5, 0.0])]

    # Execute
    kept, share = outside_span(total, others, names)
    untouched, share_none = outside_span(total, [], names)
    everything, share_all = outside_span(total, [torch.eye(3)[i] for i in range(3)], names)

    # Assert: the component along w[0] goes; |(12, 0, 4)|^2 / |(12, 3, 4)|^2 = 160 / 169
    assert kept["w"].tolist() == pytest.approx([0.0, 4.0]) and kept["b"].tolist() == [12.0]
    assert share == pytest.approx(160 / 169) and kept["n"].item() == 7
    assert kept["w"].dtype == torch.float32
    assert untouched["w"].tolist() == [3.0, 4.0] and share_none == 1.0
    assert params_to_vector(everything, names).abs().max() < 1e-9 and share_all < 1e-12
    assert total["w"].tolist() == [3.0, 4.0]  # the input is not changed


def test_federaser_step_by_hand():
    # old magnitudes, new directions: silo a's calibration (3, 4) has norm 5 and its retained
    # update had norm 10 -> (6, 8); silo b's (0, 2) -> norm 1 -> (0, 1); equal weights average
    base = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(7)}
    cal = {
        "a": {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(0)},
        "b": {"w": torch.tensor([0.0, 2.0]), "n": torch.tensor(0)},
    }
    out = federaser_step(base, cal, {"a": 10.0, "b": 1.0})
    assert torch.allclose(out["w"], torch.tensor([1.0 + 3.0, 1.0 + 4.5]))
    assert out["n"].item() == 7 and base["w"].tolist() == [1.0, 1.0]  # nothing mutated
    # weights (3:1) and a server learning rate; a silo without a retained norm is left out
    cal["c"] = {"w": torch.tensor([100.0, 0.0]), "n": torch.tensor(0)}
    out = federaser_step(
        base, cal, {"a": 10.0, "b": 1.0}, weights={"a": 3.0, "b": 1.0, "c": 1.0}, lr=0.5
    )
    assert torch.allclose(
        out["w"], torch.tensor([1.0 + 0.5 * 0.75 * 6.0, 1.0 + 0.5 * (0.75 * 8.0 + 0.25 * 1.0)])
    )
    # a zero calibration update carries no direction: left out, the others renormalised
    out = federaser_step(
        base,
        {"a": cal["a"], "z": {"w": torch.zeros(2), "n": torch.tensor(0)}},
        {"a": 10.0, "z": 4.0},
    )
    assert torch.allclose(out["w"], torch.tensor([7.0, 9.0]))


def test_update_history_keeps_every_interval_th_round(tmp_path):
    h = UpdateHistory(interval=2)
    h.start({"w": torch.tensor([1.0, 2.0])})
    h.start({"w": torch.tensor([9.0, 9.0])})  # only the first model is kept
    for r in range(5):
        h.record(r, "0", float(r))
        h.record(r, "1", 10.0 + r)
    assert h.rounds() == [0, 2, 4]
    assert h.norms(2) == {"0": 2.0, "1": 12.0} and h.norms(3) == {}
    with pytest.raises(ValueError):
        h.record(6, "0", float("nan"))
    with pytest.raises(ValueError):
        UpdateHistory(interval=0)
    save_checkpoint(tmp_path / "h.pt", h.state_dict())
    h2 = UpdateHistory()
    h2.load_state_dict(load_checkpoint(tmp_path / "h.pt"))
    assert h2.interval == 2 and h2.rounds() == [0, 2, 4] and h2.norms(4) == {"0": 4.0, "1": 14.0}
    assert h2.initial is not None and h2.initial["w"].tolist() == [1.0, 2.0]


def test_received_basis_is_reorthonormalised():
    # A basis that arrives far from orthonormal (columns mixed by a known triangular M, then
    # sent in float16) comes back orthonormal and spanning the same subspace. The departure
    # is made by construction (|M^T M - I| = 0.3), not left to float16 rounding, whose size
    # depends on the machine's BLAS/LAPACK kernels.
    gen = torch.Generator().manual_seed(0)
    grads = [{"w": torch.randn(5000, generator=gen)} for _ in range(3)]
    sig = GradientSignature.from_gradients(grads, rank=3)
    mix = torch.tensor([[1.0, 0.3, 0.0], [0.0, 1.0, 0.2], [0.0, 0.0, 0.8]])
    half = (sig.basis @ mix).half()
    gram = half.float().T @ half.float()
    assert float((gram - torch.eye(3)).abs().max()) > 0.1  # 0.3 by construction
    got = GradientSignature.from_basis(half, sig.names)
    assert got.rank == 3 and got.basis.dtype == torch.float32
    assert torch.allclose(got.basis.T @ got.basis, torch.eye(3), atol=1e-4)
    update = {"w": grads[0]["w"] + 0.1 * torch.randn(5000, generator=gen)}
    assert sig.overlap(update) > 0.9
    assert got.overlap(got.project_out(update)) < 1e-3
    # the same subspace as the float32 original, to float16 precision (about 1e-3)
    assert sig.overlap(got.project_out(update)) < 3e-2
    with pytest.raises(ValueError):
        GradientSignature.from_basis(torch.zeros(4), ["w"])
