"""The pipeline trainer's corpus: six pinned Shakespeare plays, their vocabulary, the held-out
split and the batches. Skipped when the plays are not fetched, unless CI is set (`make test`
fetches first, so there a missing file fails)."""

import os

import pytest
import torch

from fedasync.errors import DataError
from trainers.pipeline import corpus


@pytest.fixture(scope="module")
def data() -> corpus.Corpus:
    try:
        return corpus.load_corpus()
    except FileNotFoundError as err:
        if os.environ.get("CI"):
            pytest.fail(f"fetched corpus missing under CI: {err}")
        pytest.skip("corpus not fetched; run `python -m trainers.pipeline.corpus`")


def test_the_corpus_is_the_six_plays_in_order_with_a_stable_vocabulary(data):
    text = data.vocab.decode(data.train[:40])
    assert text.startswith("THE TEMPEST")
    assert data.train.numel() + data.val.numel() > 800_000
    assert data.vocab.chars == "".join(sorted(set(data.vocab.chars)))
    assert "\r" not in data.vocab.chars
    assert data.vocab.decode(data.vocab.encode("To be, or not")) == "To be, or not"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        data.vocab.encode("naïve")


def test_the_held_out_split_is_the_end_of_every_play(data):
    n = data.train.numel() + data.val.numel()
    assert abs(data.val.numel() / n - 0.1) < 0.001
    plays = corpus.play_texts()
    tail = plays[0][int(len(plays[0]) * 0.9) :]
    assert data.vocab.decode(data.val[: len(tail)]) == tail  # the Tempest's last tenth first
    again = corpus.load_corpus()
    assert torch.equal(again.train, data.train) and torch.equal(again.val, data.val)


def test_a_batch_is_windows_and_their_next_characters(data):
    g = torch.Generator().manual_seed(0)
    x, y = corpus.batch(data.train, 64, 8, g)
    assert x.shape == y.shape == (8, 64) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = corpus.batch(data.train, 64, 8, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="no window"):
        corpus.batch(data.train[:10], 64, 1, g)


def test_a_missing_corpus_says_what_to_run(tmp_path):
    with pytest.raises(DataError, match="python -m trainers.pipeline.corpus"):
        corpus.load_corpus(cache_dir=tmp_path)
    with pytest.raises(ValueError, match="val_fraction"):
        corpus.load_corpus(val_fraction=1.0, cache_dir=tmp_path)
