import pytest
import torch
from torch import nn

from trainers.rl.policy import (
    HELD_OUT_INDEX,
    Policy,
    PolicyConfig,
    Sample,
    TinyLM,
    generate,
    greedy_accuracy,
    greedy_completions,
    pick_device,
    sequence_logprobs,
    warm_start,
)
from trainers.rl.tasks import BOS, EOS, VOCAB_SIZE, encode, make_task

PROMPT = [BOS, *encode("s:3141=")]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: tiny models gain nothing from more, and lose 10x on a busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(seed: int = 0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    cfg = {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_len": 48} | kw
    return TinyLM(PolicyConfig(VOCAB_SIZE, **cfg)).eval()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Scripted(nn.Module):
    """Writes '7' until the sequence reaches ``stop_at`` tokens, then EOS (logit 50 vs 0)."""

    def __init__(self, stop_at: int) -> None:
        super().__init__()
        self.stop_at = stop_at
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        logits = torch.zeros(b, t, VOCAB_SIZE)
        pos = torch.arange(t)
        logits[:, pos + 1 >= self.stop_at, EOS] = 50.0
        logits[:, pos + 1 < self.stop_at, encode("7")[0]] = 50.0
        return logits


def test_tiny_lm_fits_the_policy_protocol():
    assert isinstance(_model(), Policy)
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_init_and_forward_are_deterministic():
    # Prepare
    a, b = _model(0), _model(0)
    ids = torch.tensor([PROMPT, PROMPT[::-1]])

    # Execute
    first, again, other = a(ids), a(ids), b(ids)

    # Assert: bit-identical, and the shape is (b, t, vocab)
    assert first.shape == (2, len(PROMPT), VOCAB_SIZE)
    assert torch.equal(first, again) and torch.equal(first, other)
    assert not torch.equal(first, _model(1)(ids))


def test_causal_and_right_padding_leave_earlier_logits():
    # Prepare
    m = _model()
    ids = torch.tensor([PROMPT])
    changed = ids.clone()
    changed[0, 4:] = 5

    # Execute
    base, later, padded = m(ids), m(changed), m(torch.cat([ids, torch.zeros(1, 6).long()], 1))

    # Assert
    assert torch.allclose(base[0, :4], later[0, :4], atol=1e-6)
    assert not torch.allclose(base[0, 4:], later[0, 4:])
    assert torch.allclose(base, padded[:, : len(PROMPT)], atol=1e-6)


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="max_len 48"):
        _model()(torch.zeros(1, 49, dtype=torch.long))


def test_generate_is_deterministic_under_a_seed():
    # Prepare
    m = _model()

    # Execute
    a = generate(m, PROMPT, n=6, max_new_tokens=10, generator=_gen(1))
    b = generate(m, PROMPT, n=6, max_new_tokens=10, generator=_gen(1))
    c = generate(m, PROMPT, n=6, max_new_tokens=10, generator=_gen(2))

    # Assert
    assert len(a) == 6 and all(isinstance(s, Sample) for s in a)
    assert [(s.tokens, s.logprobs) for s in a] == [(s.tokens, s.logprobs) for s in b]
    assert [s.tokens for s in a] != [s.tokens for s in c]


def test_generate_rows_stop_at_eos_or_the_cap():
    # Prepare: an untrained model emits EOS at random, so rows end at different lengths
    m = _model()

    # Execute
    samples = generate(m, PROMPT, n=32, max_new_tokens=8, generator=_gen(0), temperature=2.0)

    # Assert
    assert len({len(s.tokens) for s in samples}) > 1
    for s in samples:
        assert 1 <= len(s.tokens) <= 8 and len(s.logprobs) == len(s.tokens)
        assert EOS not in s.tokens[:-1]
        assert s.done == (s.tokens[-1] == EOS)
        assert all(lp <= 0.0 for lp in s.logprobs)


def test_generate_scripted_policy_by_hand():
    # Prepare: EOS once the sequence holds len(PROMPT) + 3 tokens
    m = _Scripted(stop_at=len(PROMPT) + 3)

    # Execute
    (s,) = generate(m, PROMPT, n=1, max_new_tokens=10, generator=_gen(0))
    (cut,) = generate(m, PROMPT, n=1, max_new_tokens=2, generator=_gen(0))

    # Assert: '7', '7', '7' then EOS; log-prob of a logit 50 against 0s is -log(1 + 20 e^-50)
    assert s.tokens == [*encode("777"), EOS] and s.text == "777" and s.done
    assert s.logprobs == pytest.approx([0.0] * 4, abs=1e-12)
    assert cut.tokens == encode("77") and not cut.done


def test_prefix_continuation_returns_only_new_tokens():
    # Prepare
    m = _Scripted(stop_at=len(PROMPT) + 3)
    prefix = [encode("7"), [], [*encode("777"), EOS], encode("77")]

    # Execute: the cap counts the prefix
    out = generate(m, PROMPT, n=4, max_new_tokens=3, generator=_gen(0), prefix=prefix)

    # Assert
    assert [s.tokens for s in out] == [encode("77"), encode("777"), [], encode("7")]
    with pytest.raises(ValueError, match="prefix has 1 rows"):
        generate(m, PROMPT, n=2, max_new_tokens=3, generator=_gen(0), prefix=[[]])


def test_prefix_logprobs_match_the_full_sequence():
    # Prepare
    m = _model()
    prefix = [encode("11"), encode("3"), []]

    # Execute
    out = generate(m, PROMPT, n=3, max_new_tokens=9, generator=_gen(4), prefix=prefix)
    logp, mask, _ = sequence_logprobs(
        m, [PROMPT + p for p in prefix], [s.tokens for s in out], temperature=1.0
    )

    # Assert
    for i, s in enumerate(out):
        assert len(prefix[i]) + len(s.tokens) <= 9
        assert logp[i, mask[i]].tolist() == pytest.approx(s.logprobs, abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_sequence_logprobs(temperature):
    # Prepare
    m = _model()
    samples = generate(m, PROMPT, 8, 12, _gen(3), temperature=temperature)

    # Execute
    logp, mask, entropy = sequence_logprobs(
        m, [PROMPT] * 8, [s.tokens for s in samples], temperature=temperature
    )

    # Assert
    assert logp.dtype == torch.float32 and mask.dtype == torch.bool
    assert logp.shape == mask.shape == entropy.shape == (8, max(len(s.tokens) for s in samples))
    for i, s in enumerate(samples):
        assert mask[i].sum() == len(s.tokens)
        assert logp[i, : len(s.tokens)].tolist() == pytest.approx(s.logprobs, abs=1e-5)
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()
    assert (entropy[mask] > 0).all() and (
        entropy[mask] <= torch.log(torch.tensor(VOCAB_SIZE))
    ).all()


def test_batched_sequence_logprobs_equal_unbatched():
    # Prepare: prompts and completions of different lengths, one empty completion
    m = _model()
    prompts = [PROMPT, [BOS, *encode("r:9=")], [BOS, *encode("a:57+68=")]]
    completions = [[*encode("1134"), EOS], [], [*encode("12"), EOS]]

    # Execute
    logp, mask, entropy = sequence_logprobs(m, prompts, completions)
    alone = [sequence_logprobs(m, [p], [c]) for p, c in zip(prompts, completions)]

    # Assert
    assert mask.tolist() == [[True] * 5, [False] * 5, [True] * 3 + [False] * 2]
    for i, (lp, mk, en) in enumerate(alone):
        n = mk.shape[1]
        assert torch.allclose(logp[i, :n], lp[0], atol=1e-5)
        assert torch.allclose(entropy[i, :n], en[0], atol=1e-5)


def test_sequence_logprobs_by_hand_and_differentiable():
    # Prepare: a model whose logits are all zero gives log(1/V) everywhere
    m = _model()
    for p in m.head.parameters():
        nn.init.zeros_(p)

    # Execute
    logp, mask, entropy = sequence_logprobs(m, [PROMPT], [[*encode("1"), EOS]], temperature=0.5)
    logp.sum().backward()

    # Assert
    v = torch.tensor(float(VOCAB_SIZE))
    assert torch.allclose(logp, -torch.log(v).expand(1, 2))
    assert torch.allclose(entropy, torch.log(v).expand(1, 2))
    assert m.head.weight.grad is not None and not entropy.requires_grad


def test_greedy_completions_are_argmax():
    # Prepare
    m = _Scripted(stop_at=len(PROMPT) + 2)
    task = make_task("sort")

    # Execute
    texts = greedy_completions(m, [PROMPT, PROMPT[:-1]], max_new_tokens=5)

    # Assert: the shorter prompt needs one more '7' before reaching stop_at
    assert texts == ["77", "777"]
    assert greedy_accuracy(m, task, range(3), seed=0) == 0.0


def test_state_dict_round_trip():
    # Prepare
    a, b = _model(0), _model(1)
    ids = torch.tensor([PROMPT])

    # Execute
    b.load_state_dict(a.state_dict())

    # Assert
    assert torch.equal(a(ids), b(ids))
    ga = generate(a, PROMPT, 4, 6, _gen(0))
    gb = generate(b, PROMPT, 4, 6, _gen(0))
    assert [s.tokens for s in ga] == [s.tokens for s in gb]


def test_warm_start_learns_and_is_deterministic():
    # Prepare: short lists so that a tiny budget is enough
    task = make_task("sort", min_len=2, max_len=4)
    held_out = range(HELD_OUT_INDEX, HELD_OUT_INDEX + 64)
    untrained = greedy_accuracy(_model(0, n_layers=1), task, held_out, seed=0)

    # Execute
    out = warm_start(_model(0, n_layers=1), task, steps=60, batch_size=32, lr=1e-2, seed=0)
    again = warm_start(_model(0, n_layers=1), task, steps=2, batch_size=8, lr=1e-2, seed=0)
    same = warm_start(_model(0, n_layers=1), task, steps=2, batch_size=8, lr=1e-2, seed=0)

    # Assert
    assert untrained == 0.0
    assert out["accuracy"] >= 0.3 and out["loss"] < 1.0
    assert again == same
