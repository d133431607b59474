"""Flat parameter buffers (fedasync/flat.py): every fused path against the per-tensor reference.

The reference is the per-tensor arithmetic of fedasync/tensors.py and fedasync/corrections.py,
run on plain dicts; the fused path is the same call on FlatParams. They must agree to within
float rounding on random models mixing dtypes (float32, float64, complex64) with integer and
bool buffers (a BatchNorm's counter), and the fused passes must be right across chunk edges.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fedasync import flat
from fedasync.aggregators import FedAsyncAggregator, FedBuffAggregator
from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.corrections import ErrorFeedback, delay_compensate_delta, topk
from fedasync.flat import FlatParams, flatten
from fedasync.optim import ServerOptimizer
from fedasync.staleness import make_weight_fn
from fedasync.tensors import (
    add,
    axpy,
    clip_by_norm,
    clone,
    global_norm,
    is_finite,
    scale,
    sub,
    weighted_sum,
    zeros_like,
)
from fedasync.types import Update


def _model(seed: int, *, complex_: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {
        "conv.weight": torch.randn(8, 3, 3, 3, generator=g),
        "bn.weight": torch.randn(8, generator=g, dtype=torch.float64),
        "bn.num_batches_tracked": torch.tensor(5 + seed),
        "fc.weight": torch.randn(10, 40, generator=g),
        "mask": torch.tensor([True, False, True]),
        "fc.bias": torch.randn(10, generator=g, dtype=torch.float64),
        "scalar": torch.randn((), generator=g),
    }
    if complex_:
        p["spectral"] = torch.randn(6, generator=g, dtype=torch.complex64)
    return p


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if a[k].is_floating_point() or a[k].is_complex():
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a[k], b[k]), k


def test_flatten_keeps_every_tensor_and_interns_the_layout():
    # Prepare
    p = _model(0)

    # Execute
    f = flatten(p)
    g = flatten(_model(1))

    # Assert: same values, read-only, one buffer per arithmetic dtype, layouts shared; the
    # dict's views are made on the first read, and every way of reading sees them
    assert len(f) == len(p) and not f._made
    assert dict(f).keys() == {**f}.keys() == set(f) == p.keys() and f._made
    _close(dict(f), p)
    assert isinstance(f, FlatParams) and len(f.buffers) == 3  # float32, float64, complex64
    assert f.layout is g.layout is flat.layout_of(p)
    assert f["conv.weight"].data_ptr() != p["conv.weight"].data_ptr()  # a copy
    for name in ("conv.weight", "fc.weight"):  # views of the one float32 buffer
        assert f[name].untyped_storage().data_ptr() == f.buffers[0].untyped_storage().data_ptr()
    with pytest.raises(TypeError, match="read-only"):
        f["conv.weight"] = torch.zeros(8, 3, 3, 3)
    with pytest.raises(TypeError, match="read-only"):
        f.update({})
    other = flatten({**p, "fc.weight": torch.zeros(10, 41)})
    assert other.layout is not f.layout


def test_flat_params_pickle_as_plain_dicts(tmp_path):
    # Prepare
    f = flatten(_model(0))

    # Execute
    save_checkpoint(tmp_path / "f.pt", {"params": f})
    back = load_checkpoint(tmp_path / "f.pt")["params"]
    copied = copy.deepcopy(f)
    pickled = pickle.loads(pickle.dumps(f))

    # Assert: loads with weights_only, as a plain dict that flattens to the same layout
    for d in (back, copied, pickled):
        assert type(d) is dict
        _close(d, dict(f))
    assert flatten(back).layout is f.layout


@pytest.mark.parametrize(
    "op",
    [
        lambda a, b, c: add(a, b),
        lambda a, b, c: sub(a, b),
        lambda a, b, c: scale(a, -0.37),
        lambda a, b, c: axpy(0.3, a, b),
        lambda a, b, c: weighted_sum([a, b, c], [0.5, -1.25, 2.0]),
        lambda a, b, c: zeros_like(a),
        lambda a, b, c: clone(b),
        lambda a, b, c: clip_by_norm(a, 1.0)[0],
        lambda a, b, c: clip_by_norm(a, 1e6)[0],
    ],
    ids=["add", "sub", "scale", "axpy", "weighted_sum", "zeros", "clone", "clip", "no-clip"],
)
def test_fused_ops_equal_the_per_tensor_reference(op):
    # Prepare
    a, b, c = _model(0), _model(1), _model(2)

    # Execute
    ref = op(a, b, c)
    fused = op(flatten(a), flatten(b), flatten(c))

    # Assert: the fused result is flat, and equal; integer buffers from the first argument
    assert isinstance(fused, FlatParams)
    _close(dict(fused), ref)


def test_norm_and_finiteness_match_and_catch_nan_inf_and_overflow():
    # Prepare
    p = _model(3)
    big = {**p, "fc.weight": torch.full((10, 40), 3e37)}  # squares overflow float32

    # Execute / Assert
    assert flat.global_norm(flatten(p)) == pytest.approx(global_norm(p), rel=1e-6)
    assert global_norm(flatten(big)) == pytest.approx(global_norm(big), rel=1e-6)
    assert global_norm(flatten(big)) > 1e38 and is_finite(flatten(big))
    for bad in (float("nan"), float("inf"), -float("inf")):
        q = {**p, "conv.weight": p["conv.weight"].clone()}
        q["conv.weight"][1, 2, 0, 0] = bad
        assert not is_finite(flatten(q)) and not is_finite(q)
        n = global_norm(flatten(q))
        assert n != n or n == float("inf")


@pytest.mark.parametrize("chunk", [7, 1 << 18])
def test_delay_compensation_fused_equals_reference_across_chunk_edges(monkeypatch, chunk):
    # Prepare: a chunk of 7 elements puts chunk edges inside every tensor
    monkeypatch.setattr(flat, "CHUNK", chunk)
    d, now, base = _model(0, complex_=False), _model(1, complex_=False), _model(2, complex_=False)

    # Execute
    ref = delay_compensate_delta(d, now, base, lam=0.4, lr=0.05)
    fused = delay_compensate_delta(flatten(d), flatten(now), flatten(base), lam=0.4, lr=0.05)

    # Assert
    assert isinstance(fused, FlatParams)
    _close(dict(fused), ref)


def _global_topk_reference(x: dict, ratio: float) -> dict:
    """Top-k over every arithmetic entry together, per-tensor code on one concatenation."""
    names = [k for k, v in x.items() if v.is_floating_point() or v.is_complex()]
    cat = torch.cat([x[k].reshape(-1).to(torch.float64) for k in names])
    kept = topk(cat, ratio)
    out, i = dict(x), 0
    for k in names:
        n = x[k].numel()
        out[k] = kept[i : i + n].reshape(x[k].shape).to(x[k].dtype)
        i += n
    return out


def test_error_feedback_exact_topk_is_the_global_reference_and_conserves_mass():
    # Prepare
    x1, x2 = _model(4, complex_=False), _model(5, complex_=False)
    ef = ErrorFeedback(0.1)

    # Execute
    sent1 = ef.apply("a", flatten(x1))
    r1 = ef.residual("a")
    sent2 = ef.apply("a", flatten(x2))
    r2 = ef.residual("a")

    # Assert: step 1 is the global top-k of x1; step 2 that of x2 + r1; sent + residual = input
    assert isinstance(sent1, FlatParams) and r1 is not None and r2 is not None
    _close(dict(sent1), _global_topk_reference(x1, 0.1))
    c2 = {k: (x2[k] + r1[k] if x2[k].is_floating_point() else x2[k]) for k in x2}
    _close(dict(sent2), _global_topk_reference(c2, 0.1))
    for k, v in x1.items():
        if v.is_floating_point():
            assert torch.equal(sent1[k] + r1[k], v), k
            assert torch.equal(sent2[k] + r2[k], c2[k]), k
    n_sent = sum(int((v != 0).sum()) for k, v in sent1.items() if v.is_floating_point())
    total = sum(v.numel() for v in x1.values() if v.is_floating_point())
    assert n_sent == -(-total // 10)
    assert torch.equal(sent1["bn.num_batches_tracked"], x1["bn.num_batches_tracked"])


def test_error_feedback_sampled_threshold_splits_by_magnitude(monkeypatch):
    # Prepare: force the estimated threshold (normally above 262k entries) on a small model
    monkeypatch.setattr(flat, "EXACT_TOPK_MAX", 100)
    monkeypatch.setattr(flat, "TOPK_SAMPLE", 256)
    monkeypatch.setattr(flat, "CHUNK", 13)
    x = flatten(_model(6, complex_=False))
    ef = ErrorFeedback(0.2)

    # Execute
    sent = ef.apply("a", x)
    r = ef.residual("a")

    # Assert: each entry goes wholly to one side; everything sent outweighs everything kept
    assert r is not None
    sent_mags, kept_mags, n_sent, total = [], [], 0, 0
    for k, v in x.items():
        if not v.is_floating_point():
            continue
        assert torch.equal(sent[k] + r[k], v), k
        assert not bool(((sent[k] != 0) & (r[k] != 0)).any()), k
        sent_mags.append(sent[k].abs().reshape(-1)[sent[k].reshape(-1) != 0].double())
        kept_mags.append(r[k].abs().reshape(-1).double())
        n_sent += int((sent[k] != 0).sum())
        total += v.numel()
    assert float(torch.cat(sent_mags).min()) >= float(torch.cat(kept_mags).max())
    assert 0.1 * total < n_sent < 0.3 * total  # about 20%, from a 256-entry sample


def test_error_feedback_within_a_budget_conserves_the_mass_and_drops_what_an_erasure_touches():
    # Prepare: small integers, so every sum below is exact in float32
    g = torch.Generator().manual_seed(0)
    xs = [
        {"w": torch.randint(-9, 10, (50,), generator=g).float(), "n": torch.tensor(1)}
        for _ in range(12)
    ]
    one = flatten(xs[0]).nbytes
    ef = ErrorFeedback(0.2, budget_bytes=3 * one)

    # Execute: 12 keys, room for 3 residuals
    sent = [ef.apply(f"s{i}", flatten(x)) for i, x in enumerate(xs)]

    # Assert: within the budget plus the pool; nothing lost (sent + held = everything given)
    assert ef.nbytes() <= 4 * one and ef.merged >= 8
    held = sum((ef.residual(k)["w"] for k in ef.keys()), torch.zeros(50))
    pool = ef.state_dict()["pool"]
    held = held + (pool["w"] if pool is not None else 0)
    assert torch.equal(sum(s["w"] for s in sent) + held, sum(x["w"] for x in xs))
    # the running byte count is the bytes actually held
    actual = sum(flatten(ef.residual(k)).nbytes for k in ef.keys())
    assert ef.nbytes() == actual + (flatten(pool).nbytes if pool is not None else 0)
    # an erasure of a merged key drops the pool that may hold its mass
    merged_key = ef.state_dict()["pool_origins"][0]
    ef.drop(merged_key)
    assert ef.state_dict()["pool"] is None


def test_fedasync_fold_and_fedbuff_momentum_fused_equal_reference():
    # Prepare
    params = _model(0, complex_=False)
    deltas = [_model(i, complex_=False) for i in (1, 2, 3, 4)]

    def run(as_flat: bool) -> tuple[dict, dict]:
        conv = flatten if as_flat else (lambda p: p)
        p = conv(params)
        fa = FedAsyncAggregator(0.6, make_weight_fn("polynomial", 0.5))
        fb = FedBuffAggregator(
            2, make_weight_fn("constant"), optimizer=ServerOptimizer("momentum", 0.5, 0.9)
        )
        q = p
        for i, d in enumerate(deltas):
            res = fa.fold(p, Update(str(i), 0, conv(d)), tau=i)
            p = res.params
            out = fb.fold(q, Update(str(i), 0, conv(d)), tau=i)
            q = out.params if out.params is not None else q
        return dict(p), dict(q)

    # Execute
    ref_a, ref_b = run(False)
    fused_a, fused_b = run(True)

    # Assert: same models; integer buffers are the params' own, never a delta's
    _close(fused_a, ref_a)
    _close(fused_b, ref_b)
    assert int(fused_a["bn.num_batches_tracked"]) == int(params["bn.num_batches_tracked"])


def test_wire_decodes_packed_updates_to_flat_params_without_a_copy():
    from protocol import wire

    # Prepare
    p = _model(0, complex_=False)
    p32 = {k: (v.float() if v.is_floating_point() else v) for k, v in p.items()}
    rec = wire.encode(p32)

    # Execute
    private, _ = wire.decode_with_flat(rec)
    shared1, buf1 = wire.decode_with_flat(rec, shared=True)
    shared2, buf2 = wire.decode_with_flat(rec, shared=True)

    # Assert: the server's layout, the same values; shared decoding reads the message's bytes
    assert isinstance(private, FlatParams) and isinstance(shared1, FlatParams)
    assert private.layout is flatten(p32).layout is shared1.layout
    _close(dict(shared1), p32)
    assert buf1 is not None and buf2 is not None
    assert buf1.data_ptr() == buf2.data_ptr() != private.buffers[0].data_ptr()
    # a FlatParams is sent as its buffer, and reads back the same
    again = wire.decode(wire.encode(flatten(p32)))
    assert isinstance(again, FlatParams) and again.layout is shared1.layout
    _close(dict(again), p32)


@pytest.mark.parametrize("sampled", [False, True], ids=["exact", "sampled"])
def test_error_feedback_with_delay_compensation_fused_equals_the_two_steps(monkeypatch, sampled):
    # Prepare: the sampled threshold and small chunks forced on a small model
    if sampled:
        monkeypatch.setattr(flat, "EXACT_TOPK_MAX", 100)
        monkeypatch.setattr(flat, "TOPK_SAMPLE", 256)
        monkeypatch.setattr(flat, "CHUNK", 13)
    d = [_model(i, complex_=False) for i in (7, 8)]
    now, base = flatten(_model(1, complex_=False)), flatten(_model(2, complex_=False))
    fused, steps = ErrorFeedback(0.2), ErrorFeedback(0.2)

    # Execute: twice, so the second call carries a residual
    for x in d:
        got = fused.apply("a", flatten(x), compensate=(now, base, 8.0))
        want = steps.apply("a", delay_compensate_delta(flatten(x), now, base, 0.4, 0.05))

        # Assert: the same update sent and the same residual kept
        _close(dict(got), dict(want))
        _close(fused.residual("a"), steps.residual("a"))


def test_the_buffer_pool_reuses_only_memory_nobody_holds(monkeypatch):
    # Prepare: pool every buffer, however small
    monkeypatch.setattr(flat, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(flat, "_POOL", {})
    x, y = flatten(_model(0, complex_=False)), flatten(_model(1, complex_=False))

    # Execute / Assert: a new model while an old one's single tensor is held gets new memory
    first = axpy(0.5, x, y)
    kept = first["fc.weight"]
    ptr = first.buffers[0].data_ptr()
    del first
    second = axpy(0.5, x, y)
    assert second.buffers[0].data_ptr() != ptr
    assert torch.equal(kept, 0.5 * x["fc.weight"] + y["fc.weight"])  # untouched
    # once nothing holds it, the memory is handed out again, and the pool's tensor never is
    del kept
    third = axpy(2.0, x, y)
    assert third.buffers[0].data_ptr() == ptr
    _close(dict(third), dict(axpy(2.0, dict(x), dict(y))))
    assert all(b is not t for bufs in flat._POOL.values() for b in bufs for t in third.buffers)


def test_signature_projection_on_flat_buffers_equals_the_reference():
    from fedasync.unlearning import GradientSignature

    # Prepare: a float32 model (the projection reads its one buffer), a rank-3 signature
    p = {
        k: (v.float() if v.is_floating_point() else v) for k, v in _model(0, complex_=False).items()
    }
    grads = [
        {k: (torch.randn_like(v) if v.is_floating_point() else v) for k, v in p.items()}
        for _ in range(3)
    ]
    sig = GradientSignature.from_gradients(grads, rank=3)
    update = {k: (v + grads[0][k] if v.is_floating_point() else v) for k, v in p.items()}

    # Execute
    ref = sig.project_out(update)
    fused = sig.project_out(flatten(update))

    # Assert: the same projection, flat; nothing of the erased subspace is left
    assert isinstance(fused, FlatParams) and sig.rank == 3
    _close(dict(fused), ref)
    assert sig.overlap(fused) < 1e-5 < sig.overlap(flatten(update))
    assert sig.overlap(flatten(update)) == pytest.approx(sig.overlap(update), rel=1e-5)
