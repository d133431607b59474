"""The silo's PGA with the membership stopping rule (clients.unlearn.erase_pga(stop=...))."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from clients.unlearn import erase_pga, membership_statistic
from fedasync.membership import MembershipStop, Reading
from medical_data.federation import SiloData


def _data(n: int, seed: int) -> SiloData:
    rng = np.random.default_rng(seed)
    return SiloData(
        0,
        f"random {seed}",
        rng.normal(size=(n, 1, 4, 4)).astype(np.float32),
        rng.integers(0, 3, size=n).astype(np.int64),
        np.array([f"s{seed}/{i}" for i in range(n)]),
    )


def _memorised(forget: SiloData) -> nn.Module:
    """A linear classifier trained on ``forget`` alone until it knows it by heart (its labels
    are random: nothing it learns carries over to other samples)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = torch.tensor(forget.images), torch.tensor(forget.labels)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _pga(model: nn.Module, forget: SiloData, **kw) -> dict[str, float]:
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    args = {"radius": 100.0, "lr": 0.5, "batch_size": 32, "task": "classification", "seed": 0}
    return erase_pga(model, forget, reference=ref, **{**args, **kw})


def test_a_memorised_forget_set_is_ascended_until_it_looks_unseen():
    forget, held = _data(64, 1), _data(64, 2)
    model = _memorised(forget)
    m = _pga(model, forget, steps=300, stop=MembershipStop(alpha=0.05), heldout=held)
    assert m["auc_before"] > 0.5 + m["auc_band"], "precondition: the forget set is memorised"
    assert 0 < m["steps"] < 300, "it stopped before the budget"
    assert m["indistinguishable"] == 1.0 or m["overshoot"] == 1.0
    # the model it returns is the one it read last (or, past an overshoot, its best reading)
    dev = torch.device("cpu")
    idx_f, idx_h = np.arange(64), np.arange(64)
    again = MembershipStop().read(
        membership_statistic(model, forget, idx_f, task="classification", device=dev),
        membership_statistic(model, held, idx_h, task="classification", device=dev),
    )
    assert again.auc == pytest.approx(m["auc"])


class _Scripted(MembershipStop):
    """The rule with scripted AUCs, one per reading (what is tested is the state restored)."""

    def __init__(self, aucs: list[float]) -> None:
        super().__init__()
        object.__setattr__(self, "aucs", list(aucs))

    def read(self, forget_stat, heldout_stat):
        return Reading(self.aucs.pop(0), 0.05, len(forget_stat), len(heldout_stat))


def test_an_overshoot_returns_to_the_state_of_the_best_reading():
    forget, held = _data(64, 1), _data(64, 2)
    model = _memorised(forget)
    states = []
    rule = _Scripted([0.9, 0.7, 0.58, 0.2])  # step 3 overshoots; step 2 was the best
    orig = rule.read

    def read(f, h):
        states.append([p.detach().clone() for p in model.parameters()])
        return orig(f, h)

    object.__setattr__(rule, "read", read)
    m = _pga(model, forget, steps=10, loss_cap=1e9, stop=rule, heldout=held)
    assert m["overshoot"] == 1.0 and m["steps"] == 3 and m["reverted_to_step"] == 2.0
    assert m["auc"] == 0.58 and m["indistinguishable"] == 0.0  # the best, still outside
    assert all(torch.equal(a, b) for a, b in zip(states[2], model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(states[3], model.parameters()))


def test_a_forget_set_that_looks_unseen_already_takes_no_step():
    forget = _data(64, 1)
    model = _memorised(_data(64, 3))  # trained on other samples
    before = [p.detach().clone() for p in model.parameters()]
    m = _pga(model, forget, steps=50, stop=MembershipStop(), heldout=forget)
    assert m["steps"] == 0 and m["readings"] == 1 and m["auc"] == pytest.approx(0.5)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_without_the_rule_it_takes_its_fixed_steps():
    forget = _data(64, 1)
    m = _pga(_memorised(forget), forget, steps=7, loss_cap=1e9)
    assert m["steps"] == 7 and "auc" not in m


def test_the_rule_needs_held_out_samples():
    forget = _data(8, 1)
    with pytest.raises(ValueError, match="held-out"):
        _pga(_memorised(forget), forget, steps=3, stop=MembershipStop())
