"""The pipeline trainer's model cut into stages and its single-process schedule emulator:
a cut model is the whole model; GPipe and 1F1B-flush give the same weights; PipeDream-2BW with
no delay is 1F1B bit for bit, with a delay of one it computes under the previous version."""

import pytest
import torch

from trainers.pipeline.emulate import Emulator, evaluate, peak_in_flight, stage_order
from trainers.pipeline.model import GPTConfig, build_stages, run_stages, split_blocks

CFG = GPTConfig(vocab_size=20, d_model=32, n_layers=4, n_heads=2, context=16)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _data(n: int = 6, batch: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, CFG.vocab_size, (4000,), generator=g)
    out = []
    for _ in range(n):
        s = torch.randint(0, stream.numel() - CFG.context - 1, (batch,), generator=g)
        idx = s[:, None] + torch.arange(CFG.context)
        out.append((stream[idx], stream[idx + 1]))
    return out


def _train(schedule: str, stages: int, delay: int = 1, steps: int = 6, micro: int = 4):
    model = build_stages(CFG, stages, seed=0)
    emu = Emulator(
        model, lambda s: torch.optim.AdamW(s.parameters(), lr=3e-3), schedule, micro, delay
    )
    losses = [emu.step(x, y) for x, y in _data(steps)]
    return model, losses


def _flat(stages) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for s in stages for p in s.parameters()])


@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_model_cut_into_stages_is_the_whole_model(count):
    whole = build_stages(CFG, 1, seed=3)
    cut = build_stages(CFG, count, seed=3)
    assert torch.equal(_flat(whole), _flat(cut))
    x, _ = _data(1)[0]
    assert torch.equal(run_stages(whole, x), run_stages(cut, x))
    assert [len(s.blocks) for s in cut] == split_blocks(4, count)


def test_blocks_are_cut_evenly_and_bad_cuts_are_refused():
    assert split_blocks(5, 2) == [3, 2] and split_blocks(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="1 <= P"):
        split_blocks(2, 3)


def test_1f1b_holds_fewer_activations_than_gpipe():
    gpipe, ofob = stage_order("gpipe", 4, 8), stage_order("1f1b", 4, 8)
    assert [peak_in_flight(o) for o in gpipe] == [8, 8, 8, 8]
    assert [peak_in_flight(o) for o in ofob] == [4, 3, 2, 1]
    for ops in gpipe + ofob:  # every micro-batch forward once, then backward once
        assert sorted(ops) == sorted([("F", i) for i in range(8)] + [("B", i) for i in range(8)])
        assert [i for k, i in ops if k == "B"] == list(range(8))


def test_gpipe_and_1f1b_flush_give_the_same_weights_bit_for_bit():
    a, la = _train("gpipe", 2)
    b, lb = _train("1f1b", 2)
    assert la == lb and torch.equal(_flat(a), _flat(b))
    assert not torch.equal(_flat(a), _flat(build_stages(CFG, 2, seed=0)))  # it learnt


def test_2bw_without_delay_is_1f1b_bit_for_bit_and_with_delay_is_not():
    sync, ls = _train("1f1b", 2)
    zero, l0 = _train("2bw", 2, delay=0)
    assert l0 == ls and torch.equal(_flat(zero), _flat(sync))
    one, l1 = _train("2bw", 2, delay=1)
    assert l1[0] == ls[0] and l1[1] != ls[1]  # step 1 computes under W(0), sync under W(1)
    assert not torch.equal(_flat(one), _flat(sync))


def test_2bw_applies_the_gradient_of_the_previous_version():
    # W(2) = W(1) − ν ∇f(W(0)) with plain SGD: check it against the arithmetic
    data = _data(2)
    model = build_stages(CFG, 2, seed=0)
    emu = Emulator(model, lambda s: torch.optim.SGD(s.parameters(), lr=0.1), "2bw", 2, delay=1)
    ref = build_stages(CFG, 2, seed=0)
    w0 = _flat(ref).clone()

    def grad_at(weights_from, x, y):
        probe = build_stages(CFG, 2, seed=0)
        for p, q in zip(
            [p for s in probe for p in s.parameters()],
            [p for s in weights_from for p in s.parameters()],
        ):
            p.data.copy_(q.data)
        logits = run_stages(probe, x)
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, CFG.vocab_size), y.reshape(-1)
        ).backward()
        return torch.cat([p.grad.reshape(-1) for s in probe for p in s.parameters()])

    g0 = grad_at(ref, *data[0])
    emu.step(*data[0])
    g1_stale = grad_at(ref, *data[1])  # step 2 computes under W(0) again
    emu.step(*data[1])
    expected = w0 - 0.1 * g0 - 0.1 * g1_stale
    assert torch.allclose(_flat(model), expected, atol=1e-6)


def test_bad_settings_are_refused():
    model = build_stages(CFG, 2, seed=0)
    with pytest.raises(ValueError, match="schedule"):
        Emulator(model, lambda s: torch.optim.SGD(s.parameters(), lr=0.1), "zero-bubble", 2)
    with pytest.raises(ValueError, match="delay 0 or 1"):
        Emulator(model, lambda s: torch.optim.SGD(s.parameters(), lr=0.1), "2bw", 2, delay=2)
    emu = Emulator(model, lambda s: torch.optim.SGD(s.parameters(), lr=0.1), "1f1b", 3)
    x, y = _data(1)[0]
    with pytest.raises(ValueError, match="micro-batches"):
        emu.step(x, y)
    assert evaluate(model, [(x, y)]) > 0


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    from trainers.pipeline.optim import StageOptimizer

    first, last = build_stages(CFG, 2, seed=0)
    opt = StageOptimizer(first, "muon", lr=1e-3)
    matrices = sum(
        p.numel() for n, p in first.named_parameters() if n.startswith("blocks.") and p.dim() == 2
    )
    assert opt.muon_params == matrices > 0
    assert opt.adamw_params == sum(p.numel() for p in first.parameters()) - matrices
    assert StageOptimizer(last, "adamw", lr=1e-3).muon_params == 0
    with pytest.raises(ValueError, match="optimizer"):
        StageOptimizer(last, "lion", lr=1e-3)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_both_optimisers_lower_the_loss_through_the_emulator(name):
    from trainers.pipeline.optim import StageOptimizer

    model = build_stages(CFG, 2, seed=0)
    emu = Emulator(model, lambda s: StageOptimizer(s, name, lr=3e-3), "2bw", micro=2)
    x, y = _data(1)[0]
    before = evaluate(model, [(x, y)])
    for _ in range(15):
        emu.step(x, y)
    assert evaluate(model, [(x, y)]) < before - 0.1
