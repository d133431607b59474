"""The one seed stream (fedasync.seeds): named purposes, the published streams kept."""

import numpy as np
import pytest

from fedasync import seeds


@pytest.mark.parametrize(
    ("purpose", "keys", "old"),
    [
        ("job.duration", (3, 11), [5, 3, 11, 104729]),
        ("silo.speeds", (), [5, 7919]),
        ("job.train", (2, 9), [5, 2, 9]),
        ("job.unlearn", (2, 9), [5, 2, 9, 7]),
        ("market.start", (), [5, 0x3A7E]),
    ],
)
def test_a_registered_purpose_draws_what_its_call_site_drew_before(purpose, keys, old):
    # the figures in docs/measured.md reproduce from their seeds only if these stay equal
    assert seeds.rng(5, purpose, *keys).random(4).tolist() == (
        np.random.default_rng(old).random(4).tolist()
    )


def test_purposes_and_keys_keep_streams_apart_and_a_new_purpose_gets_a_stable_number():
    a = seeds.rng(0, "job.duration", 1, 1).random(3)
    assert not np.array_equal(a, seeds.rng(0, "job.duration", 1, 2).random(3))
    assert not np.array_equal(a, seeds.rng(0, "silo.speeds", 1, 1).random(3))
    assert seeds.purpose_number("a.new.purpose") == seeds.purpose_number("a.new.purpose")
    assert seeds.purpose_number("a.new.purpose") not in seeds.PURPOSES.values()
    assert 0 <= seeds.torch_seed(0, "toy") < 2**63 and 0 <= seeds.int_seed(0, "toy") < 2**31


def test_a_linear_torch_seed_is_the_formula_its_stream_was_published_with():
    assert seeds.linear_seed(7, "pipeline.batch", 12) == 7 * 1_000_003 + 12
    assert seeds.linear_seed(7, "market.agent", 1) == 7 * 1009 + 1
    assert seeds.linear_seed(7, "rl.rollout", 3) == (7 * 1_000_003 + 3 * 7919 + 17) % (2**63 - 1)
    with pytest.raises(ValueError, match="takes 1 key"):
        seeds.linear_seed(7, "market.agent")
