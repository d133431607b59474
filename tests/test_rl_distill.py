"""On-policy distillation: the four losses by hand on a three-word vocabulary, the teacher's
finite cache (score_group, check_cache, its size), Monte Carlo ids in generate, the
DistillLearner, the engine's distill path (parity at S = 0, a teacher that dies, kill and
resume with groups at the teacher, the teacher cache) and the distill.* config errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedasync.checkpoint import load_checkpoint
from fedasync.errors import ConfigError
from fedasync.events import read_events
from trainers.rl.backend import build_policy
from trainers.rl.config import LearnerSection, load_rl_config
from trainers.rl.distill import (
    DistillLearner,
    bucket_logprobs,
    cache_bytes_per_token,
    check_cache,
    forward_kl_topk,
    pg_kl_advantage,
    reverse_kl_topk,
    score_group,
    tail_logmass,
)
from trainers.rl.engine import RLRun
from trainers.rl.policy import (
    PolicyConfig,
    TinyLM,
    generate,
    sequence_distributions,
    sequence_logprobs,
)
from trainers.rl.rollout import Group, Trajectory, generate_group
from trainers.rl.tasks import EOS, VOCAB_SIZE, encode, make_task

L = math.log
INF = math.inf


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is many times faster than two on a busy shared CPU
    (restored after the module)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}

# ------------------------------------------------------------------ the losses, by hand
# Two completion positions over a three-word vocabulary {0, 1, 2}:
#   student π_θ: position 0 (.5, .3, .2), position 1 (.1, .6, .3)
#   teacher p_T: position 0 (.2, .7, .1), position 1 (.6, .25, .15)
# The teacher's ids by probability: position 0 -> 1, 0, 2; position 1 -> 0, 1, 2.
STUDENT = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]
TEACHER = [[0.2, 0.7, 0.1], [0.6, 0.25, 0.15]]

# The finite caches (what score_group would write), by k:
#   k = 1: ids (1), (0); tails 1 − .7 = .3 and 1 − .6 = .4 (the tail holds two ids)
#   k = 2: ids (1, 0), (0, 1); tails 1 − .9 = .1 and 1 − .85 = .15 (the one id left)
#   k = 3: every id, no tail bucket (−inf)
CACHES = {
    1: ([[1], [0]], [[L(0.7)], [L(0.6)]], [L(0.3), L(0.4)]),
    2: ([[1, 0], [0, 1]], [[L(0.7), L(0.2)], [L(0.6), L(0.25)]], [L(0.1), L(0.15)]),
    3: (
        [[1, 0, 2], [0, 1, 2]],
        [[L(0.7), L(0.2), L(0.1)], [L(0.6), L(0.25), L(0.15)]],
        [-INF, -INF],
    ),
}

# The buckets (student mass, teacher mass) per position, by k:
#   k = 1: pos 0 {1}: (.3, .7), tail {0, 2}: (.5 + .2 = .7, .3)
#          pos 1 {0}: (.1, .6), tail {1, 2}: (.6 + .3 = .9, .4)
#   k = 2, 3: every id its own bucket (with k = 2 the tail is id 2 alone), so the bucketed
#          KLs are the full-vocabulary ones
BUCKETS = {
    1: [[(0.3, 0.7), (0.7, 0.3)], [(0.1, 0.6), (0.9, 0.4)]],
    2: [[(0.3, 0.7), (0.5, 0.2), (0.2, 0.1)], [(0.1, 0.6), (0.6, 0.25), (0.3, 0.15)]],
    3: [[(0.3, 0.7), (0.5, 0.2), (0.2, 0.1)], [(0.1, 0.6), (0.6, 0.25), (0.3, 0.15)]],
}
# Forward KL(p_T ‖ π) = Σ_b p_T(b) ln(p_T(b)/π(b)):
#   k = 1: pos 0: .7 ln(.7/.3) + .3 ln(.3/.7);  pos 1: .6 ln(.6/.1) + .4 ln(.4/.9)
#   k = 2, 3: pos 0: .7 ln(.7/.3) + .2 ln(.2/.5) + .1 ln(.1/.2)
#             pos 1: .6 ln(.6/.1) + .25 ln(.25/.6) + .15 ln(.15/.3)
FKL = {
    1: [0.7 * L(0.7 / 0.3) + 0.3 * L(0.3 / 0.7), 0.6 * L(0.6 / 0.1) + 0.4 * L(0.4 / 0.9)],
    2: [
        0.7 * L(0.7 / 0.3) + 0.2 * L(0.2 / 0.5) + 0.1 * L(0.1 / 0.2),
        0.6 * L(0.6 / 0.1) + 0.25 * L(0.25 / 0.6) + 0.15 * L(0.15 / 0.3),
    ],
}
FKL[3] = FKL[2]
# Reverse KL(π ‖ p_T) = Σ_b π(b) ln(π(b)/p_T(b)):
#   k = 1: pos 0: .3 ln(.3/.7) + .7 ln(.7/.3);  pos 1: .1 ln(.1/.6) + .9 ln(.9/.4)
#   k = 2, 3: pos 0: .3 ln(.3/.7) + .5 ln(.5/.2) + .2 ln(.2/.1)
#             pos 1: .1 ln(.1/.6) + .6 ln(.6/.25) + .3 ln(.3/.15)
RKL = {
    1: [0.3 * L(0.3 / 0.7) + 0.7 * L(0.7 / 0.3), 0.1 * L(0.1 / 0.6) + 0.9 * L(0.9 / 0.4)],
    2: [
        0.3 * L(0.3 / 0.7) + 0.5 * L(0.5 / 0.2) + 0.2 * L(0.2 / 0.1),
        0.1 * L(0.1 / 0.6) + 0.6 * L(0.6 / 0.25) + 0.3 * L(0.3 / 0.15),
    ],
}
RKL[3] = RKL[2]


def _cache(k: int, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    ids, logp, tail = CACHES[k]
    return (
        torch.tensor(ids, dtype=torch.int16),
        torch.tensor(logp, dtype=dtype),
        torch.tensor(tail, dtype=dtype),
    )


def _student_logp(dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(STUDENT, dtype=dtype).log()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_forward_and_reverse_kl_per_position_by_hand(k):
    ids, t_logp, tail = _cache(k)
    s_all = _student_logp()

    fkl = forward_kl_topk(s_all, ids, t_logp, tail)
    rkl = reverse_kl_topk(s_all, ids, t_logp, tail)

    assert fkl.shape == rkl.shape == (2,)
    assert fkl.tolist() == pytest.approx(FKL[k], abs=1e-6)
    assert rkl.tolist() == pytest.approx(RKL[k], abs=1e-6)
    # and the buckets themselves
    s_b, t_b = bucket_logprobs(s_all, ids, t_logp, tail)
    for pos in range(2):
        assert s_b[pos].exp().tolist() == pytest.approx([s for s, _ in BUCKETS[k][pos]], abs=1e-6)
        assert t_b[pos].exp().tolist() == pytest.approx([t for _, t in BUCKETS[k][pos]], abs=1e-6)


def test_the_kls_broadcast_over_a_batch_of_rows():
    # the same two positions as a (2 rows, 2 positions) batch, row 1 reversed: per position
    ids, t_logp, tail = _cache(2)
    s_all = _student_logp()
    rows = [torch.stack([x, x.flip(0)]) for x in (s_all, ids, t_logp, tail)]

    rkl = reverse_kl_topk(*rows)

    assert rkl.shape == (2, 2)
    assert rkl.reshape(-1).tolist() == pytest.approx([*RKL[2], *RKL[2][::-1]], abs=1e-6)


def test_a_bucket_the_student_gives_no_mass_adds_nothing_to_the_reverse_kl():
    # position 0 puts all its mass on id 0 (log-probs 0, −inf, −inf): with k = 3,
    # KL(π ‖ p_T) = 1 · ln(1/.2) = ln 5, the −inf buckets adding 0 (not 0 · ∞ = nan)
    s_all = torch.tensor([[0.0, -INF, -INF], [L(0.1), L(0.6), L(0.3)]])
    ids, t_logp, tail = _cache(3)

    rkl = reverse_kl_topk(s_all, ids, t_logp, tail)

    assert rkl.tolist() == pytest.approx([L(5.0), RKL[3][1]], abs=1e-6)


def test_tail_logmass_is_the_log_of_what_the_top_ids_leave():
    # 1 − (.7 + .2) = .1; 1 − .6 = .4; ids holding everything leave −inf
    out = tail_logmass(torch.tensor([[L(0.7), L(0.2)], [L(0.6), -INF], [L(0.5), L(0.5)]]))

    assert out[:2].tolist() == pytest.approx([L(0.1), L(0.4)], abs=1e-6)
    assert out[2].item() == -INF


def test_pg_kl_advantages_by_hand_stale_and_online():
    # generated tokens y = (1, 2), one Monte Carlo id per position (0, then 1): columns (y, mc)
    #   teacher log-probs:   pos 0 (ln .7, ln .2),  pos 1 (ln .15, ln .25)
    #   behaviour μ (an older student; μ at pos 0 = (.4, .4, .2), at pos 1 = (.2, .5, .3)):
    #                        pos 0 (ln .4, ln .4),  pos 1 (ln .3, ln .5)
    #   current π_θ (STUDENT): pos 0 (ln .3, ln .5),  pos 1 (ln .3, ln .6)
    # pg_kl (stale):   A = ln p_T − ln μ  = [[ln(.7/.4), ln(.2/.4)], [ln(.15/.3), ln(.25/.5)]]
    # pg_kl_online:    A = ln p_T − ln π_θ = [[ln(.7/.3), ln(.2/.5)], [ln(.15/.3), ln(.25/.6)]]
    teacher = torch.tensor([[L(0.7), L(0.2)], [L(0.15), L(0.25)]])
    behaviour = torch.tensor([[L(0.4), L(0.4)], [L(0.3), L(0.5)]])
    current = torch.tensor([[L(0.3), L(0.5)], [L(0.3), L(0.6)]], requires_grad=True)

    stale = pg_kl_advantage(teacher, behaviour)
    online = pg_kl_advantage(teacher, current)

    assert stale.shape == online.shape == (2, 2)
    assert stale.reshape(-1).tolist() == pytest.approx(
        [L(0.7 / 0.4), L(0.2 / 0.4), L(0.15 / 0.3), L(0.25 / 0.5)], abs=1e-6
    )
    assert online.reshape(-1).tolist() == pytest.approx(
        [L(0.7 / 0.3), L(0.2 / 0.5), L(0.15 / 0.3), L(0.25 / 0.6)], abs=1e-6
    )
    assert not online.requires_grad  # a stop-gradient: only the ratio carries the gradient


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_gradient_of_each_kl_wrt_the_student_logits_is_the_hand_one(k):
    # With π_b the student's mass in bucket b and i in bucket b(i):
    #   ∂ KL(p_T ‖ π)/∂z_i = π_i − p_T(b(i)) · π_i / π_b(i)        (for k = 3: π_i − p_T(i))
    #   ∂ KL(π ‖ p_T)/∂z_i = π_i (ln(π_b(i)/p_T(b(i))) − KL(π ‖ p_T))
    # e.g. k = 3, position 0: forward (.5 − .2, .3 − .7, .2 − .1) = (.3, −.4, .1)
    ids, t_logp, tail = _cache(k, torch.float64)
    members = {  # the ids of each bucket, in bucket order
        1: [[[1], [0, 2]], [[0], [1, 2]]],
        2: [[[1], [0], [2]], [[0], [1], [2]]],
        3: [[[1], [0], [2]], [[0], [1], [2]]],
    }[k]
    want_f, want_r = [], []
    for pos in range(2):
        pi = STUDENT[pos]
        gf, gr = [0.0] * 3, [0.0] * 3
        for (pb, tb), ids_b in zip(BUCKETS[k][pos], members[pos]):
            for i in ids_b:
                gf[i] = pi[i] - tb * pi[i] / pb
                gr[i] = pi[i] * (L(pb / tb) - RKL[k][pos])
        want_f.append(gf)
        want_r.append(gr)

    for fn, want in ((forward_kl_topk, want_f), (reverse_kl_topk, want_r)):
        z = torch.tensor(STUDENT, dtype=torch.float64).log().requires_grad_(True)
        fn(torch.log_softmax(z, -1), ids, t_logp, tail).sum().backward()
        assert torch.isfinite(z.grad).all()
        assert z.grad.tolist()[0] == pytest.approx(want[0], abs=1e-9)
        assert z.grad.tolist()[1] == pytest.approx(want[1], abs=1e-9)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_reverse_kl_gradient_stays_finite_where_the_student_underflows(k):
    # float32, as in training: exp(−120) underflows to 0, so buckets hold no student mass
    ids, t_logp, tail = _cache(k)
    z = torch.tensor([[120.0, 0.0, 0.0], [0.0, -120.0, -120.0]], requires_grad=True)

    out = reverse_kl_topk(torch.log_softmax(z, -1), ids, t_logp, tail)
    out.sum().backward()

    assert torch.isfinite(out).all()
    assert torch.isfinite(z.grad).all()


# ------------------------------------------------------------------ the teacher's cache
def _lm(seed: int, sharp: float = 1.0, d: int = 16) -> TinyLM:
    torch.manual_seed(seed)
    m = TinyLM(PolicyConfig(vocab_size=VOCAB_SIZE, d_model=d, n_layers=1, n_heads=2))
    with torch.no_grad():
        m.head.weight.mul_(sharp)  # sharp > 1: a peaked teacher, far from a uniform student
    return m.eval()


def _traj(prompt: str, completion: list[int], mc: list[list[int]] | None = None) -> Trajectory:
    n = len(completion)
    return Trajectory(
        prompt=(1, *encode(prompt)),
        tokens=completion,
        logprobs=[-1.0] * n,
        versions=[0] * n,
        reward=0.0,
        text="",
        mc_ids=mc or [],
        mc_logprobs=[[-1.0] * len(r) for r in mc] if mc else [],
    )


def _scored_group(k: int, mc: bool = False) -> tuple[TinyLM, Group]:
    """Two trajectories of different lengths (the batched forward pads the shorter one)."""
    short = encode("12") + [EOS]
    long = encode("1134") + [EOS]
    trajs = [
        _traj("s:21=", short, [[3, 7], [EOS, 20], [5, 5]] if mc else None),
        _traj("s:3141=", long, [[i, i + 1] for i in range(4, 9)] if mc else None),
    ]
    teacher = _lm(1, sharp=20.0)
    return teacher, score_group(teacher, Group(0, 0, trajs), k)


def _alone(teacher: TinyLM, t: Trajectory) -> torch.Tensor:
    """The teacher's whole distribution at each of ``t``'s positions, in a forward of its own."""
    with torch.no_grad():
        logp_all, _, _ = sequence_distributions(teacher, [t.prompt], [t.tokens])
    return logp_all[0]


@pytest.mark.parametrize("k", [1, 4, 16])
def test_score_group_writes_a_proper_sorted_top_k_plus_tail(k):
    teacher, group = _scored_group(k)

    for t in group.trajectories:
        c, n = t.teacher, len(t.tokens)
        assert c["topk_ids"].dtype == torch.int16 and c["topk_ids"].shape == (n, k)
        assert c["topk_logp"].shape == (n, k) and c["tail_logp"].shape == (n,)
        assert c["token_logp"].shape == (n, 1)
        # a proper distribution over the k + 1 buckets
        mass = c["topk_logp"].exp().sum(-1) + c["tail_logp"].exp()
        assert torch.allclose(mass, torch.ones(n), atol=1e-5)
        # the teacher's k most likely ids, most likely first
        full = _alone(teacher, t)
        top, _ = full.sort(dim=-1, descending=True)
        assert torch.allclose(c["topk_logp"], top[:, :k], atol=1e-5)
        assert (c["topk_logp"][:, :-1] >= c["topk_logp"][:, 1:]).all()
        assert torch.allclose(full.gather(1, c["topk_ids"].long()), c["topk_logp"], atol=1e-5)
        # column 0: the teacher's log-prob of the generated token
        with torch.no_grad():
            direct, _, _ = sequence_logprobs(teacher, [t.prompt], [t.tokens])
        assert torch.allclose(c["token_logp"][:, 0], direct[0], atol=1e-5)
        assert check_cache(t, k, 1) is None


@pytest.mark.parametrize("k", [0, VOCAB_SIZE, VOCAB_SIZE + 5])
def test_k_zero_or_the_vocabulary_caches_the_whole_distribution_without_a_tail(k):
    teacher, group = _scored_group(k)

    for t in group.trajectories:
        c = t.teacher
        assert c["topk_logp"].shape == (len(t.tokens), VOCAB_SIZE)
        assert (c["tail_logp"] == -INF).all()
        assert torch.allclose(c["topk_logp"].exp().sum(-1), torch.ones(len(t.tokens)), atol=1e-5)
        full = _alone(teacher, t)
        assert torch.allclose(full.gather(1, c["topk_ids"].long()), c["topk_logp"], atol=1e-5)
        assert check_cache(t, k, 1) is None


def test_score_group_scores_the_monte_carlo_ids_too():
    teacher, group = _scored_group(4, mc=True)

    for t in group.trajectories:
        c = t.teacher
        assert c["token_logp"].shape == (len(t.tokens), 3)
        full = _alone(teacher, t)
        want = full.gather(1, torch.tensor([[y, *m] for y, m in zip(t.tokens, t.mc_ids)]))
        assert torch.allclose(c["token_logp"], want, atol=1e-5)
        assert check_cache(t, 4, 3) is None
        assert check_cache(t, 4, 1) is not None  # N = 3 columns, not 1


def _bad(mutate) -> Trajectory:
    _, group = _scored_group(4)
    t = group.trajectories[1]  # 5 tokens
    mutate(t)
    return t


def _set(key, value):
    def f(t):
        t.teacher[key] = value

    return f


def _poke(key, index, value):
    def f(t):
        t.teacher[key][index] = value

    return f


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda t: setattr(t, "teacher", None), "no teacher scores"),
        (lambda t: t.teacher.pop("tail_logp"), "tail_logp has the wrong shape"),
        (_set("topk_logp", torch.zeros(4, 4) - 1.0), "topk_logp has the wrong shape"),
        (_set("topk_logp", torch.zeros(5) - 1.0), "topk_logp has the wrong shape"),
        (_set("tail_logp", torch.zeros(6) - 1.0), "tail_logp has the wrong shape"),
        (_set("token_logp", torch.zeros(5, 2) - 1.0), "wrong number of scored ids"),
        (_set("topk_ids", torch.zeros(5, 3, dtype=torch.int16)), "wrong number of scored ids"),
        (_set("topk_logp", "not a tensor"), "topk_logp has the wrong shape"),
        (_poke("topk_logp", (2, 1), math.nan), "non-finite"),
        (_poke("token_logp", (0, 0), math.nan), "non-finite"),
        (_poke("topk_logp", (3, 0), INF), "non-finite"),
        (_poke("tail_logp", 1, math.nan), "non-finite"),
        (_poke("topk_logp", (1, 2), 0.25), "positive log-prob"),
        (_poke("token_logp", (4, 0), 1e-3), "positive log-prob"),
        (_poke("tail_logp", 0, 0.5), "positive log-prob"),
    ],
)
def test_check_cache_rejects_a_cache_that_cannot_be_learnt_from(mutate, words):
    why = check_cache(_bad(mutate), 4, 1)

    assert isinstance(why, str) and words in why and "\n" not in why


def test_check_cache_rejects_a_cache_of_another_k():
    # a teacher that cached 16 ids (with a tail) is not what distill.top_k=4 asks for, and a
    # top-4 cache is not the whole vocabulary that top_k=0 asks for
    _, g16 = _scored_group(16)
    _, g4 = _scored_group(4)
    _, gall = _scored_group(0)

    assert check_cache(g16.trajectories[0], 4, 1) is not None
    assert check_cache(g4.trajectories[0], 0, 1) is not None
    assert check_cache(g4.trajectories[0], 16, 1) is not None
    assert check_cache(gall.trajectories[0], 0, 1) is None
    assert check_cache(gall.trajectories[0], VOCAB_SIZE + 3, 1) is None


@pytest.mark.parametrize("mc", [1, 3])
@pytest.mark.parametrize("k", [1, 4, 16, 0])
def test_cache_bytes_per_token_is_what_score_group_stores(k, mc):
    # k ids at 2 bytes and k log-probs at 4, a 4-byte tail when k < V, N token log-probs at 4;
    # V = 21: k=1 -> 6+4, k=4 -> 24+4, k=16 -> 96+4, full -> 21·6 = 126 (no tail), + 4N
    want = {1: 10, 4: 28, 16: 100, 0: 126}[k] + 4 * mc
    assert cache_bytes_per_token(k, VOCAB_SIZE, mc) == want

    _, group = _scored_group(k, mc=mc == 3)
    t = group.trajectories[1]
    stored = sum(
        v.numel() * v.element_size()
        for key, v in t.teacher.items()
        if not (key == "tail_logp" and k == 0)  # −inf placeholders: no tail bucket to store
    )
    assert stored == want * len(t.tokens)


# ------------------------------------------------------------------ Monte Carlo ids
PROMPT = (1, *encode("s:3141="))


def _gen(policy, extra: int, extra_seed: int = 5, temperature: float = 0.8):
    return generate(
        policy,
        PROMPT,
        4,
        7,
        torch.Generator().manual_seed(3),
        temperature=temperature,
        extra=extra,
        extra_generator=torch.Generator().manual_seed(extra_seed) if extra else None,
    )


def test_extra_samples_leave_the_sequences_alone_and_carry_behaviour_log_probs():
    policy = _lm(0)
    plain = _gen(policy, 0)
    more = _gen(policy, 2)
    other = _gen(policy, 2, extra_seed=6)

    assert [s.tokens for s in more] == [s.tokens for s in plain]
    assert [s.logprobs for s in more] == [s.logprobs for s in plain]  # bit for bit
    assert [s.tokens for s in other] == [s.tokens for s in plain]
    assert [s.extra_ids for s in other] != [s.extra_ids for s in more]
    assert all(not s.extra_ids and not s.extra_logprobs for s in plain)
    with torch.no_grad():
        dist, _, _ = sequence_distributions(
            policy, [PROMPT] * 4, [s.tokens for s in more], temperature=0.8
        )
    for i, s in enumerate(more):
        assert len(s.extra_ids) == len(s.extra_logprobs) == len(s.tokens)
        assert all(len(r) == 2 for r in s.extra_ids + s.extra_logprobs)
        assert all(0 <= x < VOCAB_SIZE for r in s.extra_ids for x in r)
        # the behaviour's (tempered) log-probs of the extra ids, at their positions
        want = dist[i, : len(s.tokens)].gather(1, torch.tensor(s.extra_ids))
        assert torch.allclose(torch.tensor(s.extra_logprobs), want, atol=1e-5)
        got = dist[i, : len(s.tokens)].gather(1, torch.tensor(s.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), got, atol=1e-5)


def test_extra_samples_need_their_own_generator():
    with pytest.raises(ValueError, match="extra_generator"):
        generate(_lm(0), PROMPT, 2, 5, torch.Generator().manual_seed(0), extra=1)


def test_generate_group_mc_ids_are_n_minus_one_per_position_and_change_nothing_else():
    policy, task = _lm(0), make_task("sort", min_len=2, max_len=5)
    kw = dict(seed=0, group_id=3, version=2, group_size=4, temperature=1.0)
    one = generate_group(policy, task, **kw)
    three = generate_group(policy, task, mc_samples=3, **kw)

    for a, b in zip(one.trajectories, three.trajectories, strict=True):
        assert (a.tokens, a.logprobs, a.reward) == (b.tokens, b.logprobs, b.reward)
        assert a.mc_ids == [] and len(b.mc_ids) == len(b.tokens)
        assert all(len(r) == 2 for r in b.mc_ids + b.mc_logprobs)


# ------------------------------------------------------------------ the learner
TASK = make_task("sort", min_len=2, max_len=4)


def _batch(n_mc: int, top_k: int = 4) -> tuple[TinyLM, TinyLM, list[Group]]:
    """Four groups of 8 samples from a near-uniform student, scored by a peaked teacher."""
    student, teacher = _lm(0), _lm(1, sharp=20.0)
    groups = [
        generate_group(
            student,
            TASK,
            seed=0,
            group_id=g,
            version=0,
            group_size=8,
            temperature=1.0,
            mc_samples=n_mc,
        )
        for g in range(4)
    ]
    for g in groups:
        score_group(teacher, g, top_k)
    return student, teacher, groups


@torch.no_grad()
def _kls(student: TinyLM, teacher: TinyLM, groups: list[Group]) -> dict[str, float]:
    """Full-vocabulary KLs between student and teacher, mean over the batch's positions."""
    trajs = [t for g in groups for t in g.trajectories]
    prompts, comps = [t.prompt for t in trajs], [t.tokens for t in trajs]
    s, mask, _ = sequence_distributions(student, prompts, comps)
    t, _, _ = sequence_distributions(teacher, prompts, comps)
    m = mask.float()
    return {
        "fkl": float(((t.exp() * (t - s)).sum(-1) * m).sum() / m.sum()),
        "rkl": float(((s.exp() * (s - t)).sum(-1) * m).sum() / m.sum()),
    }


@pytest.mark.parametrize(
    "loss, n_mc", [("forward_kl", 1), ("reverse_kl", 1), ("pg_kl", 4), ("pg_kl_online", 4)]
)
def test_each_loss_lowers_its_kl_to_the_teacher_on_a_fixed_batch(loss, n_mc):
    student, teacher, groups = _batch(n_mc)
    learner = DistillLearner(student, LearnerSection(lr=1e-2), 1.0, torch.device("cpu"), loss, n_mc)
    kind = "fkl" if loss == "forward_kl" else "rkl"
    before = _kls(student, teacher, groups)[kind]

    for _ in range(8):
        m = learner.step(groups, 0)

    after = _kls(student, teacher, groups)[kind]
    assert m["loss_kind"] == loss and math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert before > 0.5  # a peaked teacher, a near-uniform student: far apart to begin with
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize("loss, kind", [("forward_kl", "fkl"), ("reverse_kl", "rkl")])
def test_with_the_whole_vocabulary_cached_the_loss_is_the_full_kl(loss, kind):
    # top_k=0: no tail bucket, so the bucketed KLs are the full ones; fresh tokens (μ = π_prox)
    # weigh 1, so the first step's loss is the mean full KL of its kind over the batch
    student, teacher, groups = _batch(1, top_k=0)
    want = _kls(student, teacher, groups)
    learner = DistillLearner(student, LearnerSection(), 1.0, torch.device("cpu"), loss, 1)

    m = learner.step(groups, 0)

    assert abs(want["fkl"] - want["rkl"]) > 0.1  # the two kinds are told apart
    assert m["loss"] == pytest.approx(want[kind], rel=1e-4)
    assert m["teacher_rkl"] == pytest.approx(want["rkl"], rel=1e-4)
    assert m["teacher_fkl"] == pytest.approx(want["fkl"], rel=1e-4)
    assert m["cache_bytes_per_token"] == cache_bytes_per_token(0, VOCAB_SIZE, 1)


def _pg_grads(loss: str, shift: float) -> tuple[torch.Tensor, dict, list[Group], TinyLM]:
    """One pg step with correction none and lr 0: the gradient and the metrics, with the
    behaviour log-probs (of the generated and the Monte Carlo ids) moved by ``shift``."""
    student, _, groups = _batch(2)
    for g in groups:
        for t in g.trajectories:
            t.logprobs = [x + shift for x in t.logprobs]
            t.mc_logprobs = [[x + shift for x in r] for r in t.mc_logprobs]
    learner = DistillLearner(
        student,
        LearnerSection(correction="none", max_grad_norm=1e9),
        1.0,
        torch.device("cpu"),
        loss,
        2,
    )
    learner.opt = torch.optim.SGD(student.parameters(), lr=0.0)
    m = learner.step(groups, 0)
    return torch.cat([p.grad.reshape(-1) for p in student.parameters()]), m, groups, student


def test_pg_kl_uses_the_behaviour_signal_and_pg_kl_online_the_current_one():
    # correction none, first pass: the PPO ratio is 1, so the loss is −mean(A) over every
    # scored id (generated and Monte Carlo):
    #   pg_kl:        −mean(ln p_T − ln μ)   (μ = the trajectories' behaviour log-probs)
    #   pg_kl_online: −mean(ln p_T − ln π_θ) (π_θ = the student now)
    stale_g, stale_m, groups, _ = _pg_grads("pg_kl", -1.0)
    trajs = [t for g in groups for t in g.trajectories]
    t_lp = [x for t in trajs for x in t.teacher["token_logp"].reshape(-1).tolist()]
    b_lp = [x for t in trajs for b, m in zip(t.logprobs, t.mc_logprobs) for x in (b, *m)]
    assert stale_m["loss"] == pytest.approx(
        -sum(t - b for t, b in zip(t_lp, b_lp)) / len(t_lp), rel=1e-5
    )

    online_g, online_m, groups, student = _pg_grads("pg_kl_online", -1.0)
    with torch.no_grad():
        dist, _, _ = sequence_distributions(
            student, [t.prompt for t in trajs], [t.tokens for t in trajs]
        )
    cur = [
        x
        for i, t in enumerate(trajs)
        for row in dist[i, : len(t.tokens)]
        .gather(1, torch.tensor([[y, *m] for y, m in zip(t.tokens, t.mc_ids)]))
        .tolist()
        for x in row
    ]
    assert online_m["loss"] == pytest.approx(
        -sum(t - c for t, c in zip(t_lp, cur)) / len(t_lp), rel=1e-4
    )

    # the behaviour's log-probs move pg_kl's gradient and leave pg_kl_online's alone
    fresh_stale, _, _, _ = _pg_grads("pg_kl", 0.0)
    fresh_online, _, _, _ = _pg_grads("pg_kl_online", 0.0)
    assert torch.equal(fresh_online, online_g)
    assert not torch.allclose(fresh_stale, stale_g, atol=1e-6)
    # with μ = π_θ (fresh, same weights) the two signals agree
    assert torch.allclose(fresh_stale, fresh_online, rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------ the engine
DTINY = [
    "policy.d_model=32",
    "policy.n_layers=1",
    "policy.n_heads=2",
    "policy.warm_start_steps=0",
    "rollout.workers=3",
    "rollout.group_size=4",
    "rollout.batch_groups=3",
    "run.max_steps=3",
    "run.eval_every=100",
    "run.eval_prompts=4",
    "run.progress=false",
    "run.plots=false",
    "clock.gen_token_s=0.01",
    "clock.learn_token_s=0.002",
    "clock.teacher_token_s=0.001",
    "task.max_len=6",
    "distill.loss=reverse_kl",
    "distill.top_k=4",
    "distill.teacher_d_model=32",
    "distill.teacher_n_layers=1",
    "distill.teacher_n_heads=2",
    "distill.teacher_steps=20",
    "distill.teacher_batch=16",
]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> Path:
    """One teacher cache for the module's engine runs (trained by the first, loaded after)."""
    return tmp_path_factory.mktemp("teachers")


def _args(tmp_path: Path, cache: Path, name: str, *extra: str) -> list[str]:
    return [
        *DTINY,
        f"run.out_dir={tmp_path}",
        f"run.name={name}",
        f"distill.cache_dir={cache}",
        *extra,
    ]


def _drun(tmp_path: Path, cache: Path, name: str, *extra: str) -> tuple[RLRun, dict]:
    cfg = load_rl_config(None, _args(tmp_path, cache, name, *extra))
    run = RLRun(cfg, tmp_path / name)
    summary = run.run()
    return run, summary


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == kind]


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "extra", [["distill.loss=reverse_kl"], ["distill.loss=pg_kl", "distill.mc_samples=2"]]
)
def test_distill_async_and_streaming_at_staleness_zero_equal_sync_bit_for_bit(
    tmp_path, teachers, extra
):
    sync, _ = _drun(tmp_path, teachers, "sync", "rollout.mode=sync", *extra)
    others = [
        _drun(tmp_path, teachers, m, f"rollout.mode={m}", "rollout.max_staleness=0", *extra)[0]
        for m in ("async", "streaming")
    ]

    for run in others:
        assert _same_weights(run.policy.state_dict(), sync.policy.state_dict())
        assert [s["groups"] for s in _events(run.run_dir, "step")] == [
            s["groups"] for s in _events(sync.run_dir, "step")
        ]
    # the learning moved the weights (parity of runs that learnt nothing proves nothing)
    initial = build_policy(sync.cfg).state_dict()  # warm_start_steps=0: the seed's weights
    final = sync.policy.state_dict()
    assert not any(torch.equal(initial[k], final[k].cpu()) for k in ("head.weight", "tok.weight"))
    assert sync.version == 3
    assert {e["group"] for e in _events(sync.run_dir, "score")} == set(range(9))


def test_a_teacher_that_dies_is_restarted_and_its_request_sent_again(tmp_path, teachers):
    plain, _ = _drun(tmp_path, teachers, "plain", "rollout.mode=sync")
    run, s = _drun(
        tmp_path, teachers, "died", "rollout.mode=sync", "faults.teacher_die_on_groups=[2]"
    )

    assert s["distill"]["teacher_restarts"] == 1 and s["distill"]["teacher_resent"] == 1
    scores = {e["group"]: e["attempts"] for e in _events(run.run_dir, "score")}
    assert scores[2] == 2
    assert all(a == 1 for g, a in scores.items() if g != 2)
    assert run.version == 3 and s["rejected_trajectories"] == 0 and not s["dropped"]
    # the restarted teacher scores as the first would have: same batches, same weights
    assert _same_weights(run.policy.state_dict(), plain.policy.state_dict())


def test_a_second_run_loads_the_cached_teacher_and_a_torn_cache_is_trained_again(tmp_path):
    cache = tmp_path / "teachers"
    one = ("rollout.mode=sync", "run.max_steps=1")
    first, s1 = _drun(tmp_path, cache, "first", *one)
    second, s2 = _drun(tmp_path, cache, "second", *one)

    assert s1["distill"]["teacher"]["trained"] is True
    assert s2["distill"]["teacher"]["trained"] is False
    assert s2["distill"]["teacher"]["accuracy"] == s1["distill"]["teacher"]["accuracy"]
    assert _same_weights(first.policy.state_dict(), second.policy.state_dict())

    (weights,) = cache.glob("teacher-*.pt")
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # a torn write
    third, s3 = _drun(tmp_path, cache, "third", *one)

    assert s3["distill"]["teacher"]["trained"] is True
    assert _same_weights(first.policy.state_dict(), third.policy.state_dict())
    assert weights.read_bytes() == whole  # trained to the same weights and cached again


@pytest.mark.parametrize("top_k", [4, 0])
def test_a_run_resumed_from_its_checkpoint_ends_with_the_same_weights(tmp_path, teachers, top_k):
    # a finished run leaves its last checkpoint (version 2 of 4) behind: resuming from it
    # replays versions 3 and 4 from the state it holds (the groups at the teacher included,
    # with their caches; with top_k=0 their tail is −inf, there being no tail bucket)
    extra = (
        "rollout.mode=streaming",
        "rollout.max_staleness=1",
        "run.max_steps=4",
        "run.checkpoint_every=2",
        "clock.teacher_token_s=0.01",  # one slow teacher: groups queue at it
        f"distill.top_k={top_k}",
    )
    whole, _ = _drun(tmp_path, teachers, "whole", *extra)
    state = load_checkpoint(tmp_path / "whole" / "checkpoint.pt")
    assert state["state"]["version"] == 2 and state["state"]["scoring"]["jobs"]  # at the teacher
    before = {kind: _events(whole.run_dir, kind) for kind in ("step", "score")}

    resumed, s = _drun(tmp_path, teachers, "whole", *extra, "run.resume=true")

    assert _same_weights(whole.policy.state_dict(), resumed.policy.state_dict())
    after = {kind: _events(resumed.run_dir, kind) for kind in ("step", "score")}
    assert [e["version"] for e in after["step"]] == [1, 2, 3, 4]
    # the same virtual times: the groups at the teacher finish when they would have
    assert [(e["t"], e["groups"]) for e in after["step"]] == [
        (e["t"], e["groups"]) for e in before["step"]
    ]
    keys = ("group", "t", "start", "attempts", "scorer")
    assert [[e[k] for k in keys] for e in after["score"]] == [
        [e[k] for k in keys] for e in before["score"]
    ]
    assert s["versions"] == 4 and resumed.clock.now == whole.clock.now


def _fedasync() -> str:
    return str(Path(sys.executable).parent / "fedasync")


@pytest.mark.slow
def test_a_run_killed_with_groups_at_the_teacher_resumes_to_the_same_weights(tmp_path):
    args = [
        *DTINY,
        "rollout.mode=streaming",
        "rollout.max_staleness=1",
        "run.max_steps=8",
        "run.checkpoint_every=2",
        "clock.teacher_token_s=0.01",  # one slow teacher: groups queue at it
        f"run.out_dir={tmp_path}",
        f"distill.cache_dir={tmp_path / 'teachers'}",
    ]
    whole = subprocess.run(
        [_fedasync(), "rl", *args, "run.name=whole"],
        capture_output=True,
        text=True,
        timeout=600,
        env=ONE_THREAD,
    )
    assert whole.returncode == 0, whole.stderr[-2000:]

    proc = subprocess.Popen(
        [_fedasync(), "rl", *args, "run.name=killed"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ONE_THREAD,
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if metrics.is_file() and any(
                e["event"] == "checkpoint" and e["version"] >= 4 for e in read_events(metrics)
            ):
                break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not (tmp_path / "killed" / "summary.json").exists()  # it really died mid-run
    state = load_checkpoint(tmp_path / "killed" / "checkpoint.pt")
    assert state["state"]["scoring"]["jobs"], "the checkpoint holds no group at the teacher"

    resumed = subprocess.run(
        [_fedasync(), "rl", *args, "run.name=killed", "run.resume=true"],
        capture_output=True,
        text=True,
        timeout=600,
        env=ONE_THREAD,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    a = torch.load(tmp_path / "whole" / "policy.pt")
    b = torch.load(tmp_path / "killed" / "policy.pt")
    assert _same_weights(a, b)
    events = read_events(metrics)
    steps = [e for e in events if e["event"] == "step"]
    assert [s["version"] for s in steps] == list(range(1, 9))  # none twice, none lost
    assert any(e["event"] == "resume" for e in events)
    # the same schedule as the uninterrupted run: learner steps, and every group scored once
    # at the same virtual times by the same teacher server
    ref = read_events(tmp_path / "whole" / "metrics.jsonl")
    assert [(e["t"], e["groups"]) for e in steps] == [
        (e["t"], e["groups"]) for e in ref if e["event"] == "step"
    ]
    keys = ("group", "t", "start", "attempts", "scorer")
    assert [[e[k] for k in keys] for e in events if e["event"] == "score"] == [
        [e[k] for k in keys] for e in ref if e["event"] == "score"
    ]
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["versions"] == 8


# ------------------------------------------------------------------ config errors
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["distill.loss=forward_kl", "distill.mc_samples=2"], "distill.mc_samples"),
        (["distill.loss=bogus"], "distill.loss"),
        (["distill.top_k=-1"], "distill.top_k"),
    ],
)
def test_a_bad_distill_key_is_one_line_naming_it_and_exit_2(overrides, key, tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        load_rl_config(None, [*overrides, f"run.out_dir={tmp_path}"])
    assert key in str(e.value) and "\n" not in str(e.value)
    # the CLI's entry point in this process (test_rl_engine checks the process's exit code)
    from simulations.cli import main

    assert main(["rl", *overrides, f"run.out_dir={tmp_path}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], lines
