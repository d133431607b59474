import numpy as np
import pytest

from fedasync.errors import ConfigError
from trainers.rl.tasks import (
    BOS,
    EOS,
    PAD,
    TASKS,
    VOCAB,
    VOCAB_SIZE,
    Prompt,
    decode,
    draw_length,
    encode,
    make_task,
)


def _prompt(task: str, text: str, answer: str) -> Prompt:
    return Prompt(0, task, text, (BOS, *encode(text)), answer)


def test_vocabulary_ids():
    # Assert: specials first, then one id per character
    assert (PAD, BOS, EOS) == (0, 1, 2)
    assert VOCAB_SIZE == 3 + len(VOCAB)
    assert encode("0") == [3]
    assert encode("s:31=") == [3 + VOCAB.index(c) for c in "s:31="]


def test_encode_decode_round_trip():
    # Prepare
    text = "a:57+68=125,s:3141=1134"

    # Execute
    ids = encode(text)

    # Assert: decode skips PAD/BOS and stops at EOS
    assert decode(ids) == text
    assert decode([BOS, *ids, EOS, *encode("99")]) == text
    assert decode([BOS, *encode("12"), PAD, PAD]) == "12"
    assert decode([]) == ""


def test_encode_names_the_bad_character():
    # Execute / Assert: the character, then the input cut to its first 20 characters
    with pytest.raises(ValueError, match=r"'x' .*\(in 's:12x456789012345678'\)$"):
        encode("s:12x456789012345678901234")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode([VOCAB_SIZE])


@pytest.mark.parametrize(
    ("task", "text", "answer"),
    [
        ("sort", "s:3141=", "1134"),
        ("reverse", "r:3141=", "1413"),
        ("copy", "c:3141=", "3141"),
        ("add", "a:57+68=", "125"),
    ],
)
def test_scorers_by_hand(task, text, answer):
    # Prepare
    t = make_task(task)
    p = _prompt(task, text, answer)

    # Execute / Assert: exact match only
    assert t.reference(p) == answer
    assert t.score(p, answer) == 1.0
    assert t.score(p, answer[:-1]) == 0.0  # truncated
    assert t.score(p, answer + "0") == 0.0  # extra character
    assert t.score(p, " " + answer) == 0.0
    assert t.score(p, "") == 0.0
    assert t.score(p, "9" + answer[1:]) == 0.0  # wrong first digit


def test_samples_are_right_answers():
    for i in range(200):
        s = make_task("sort").sample(i, 7)
        assert s.text == f"s:{s.text[2:-1]}=" and s.answer == "".join(sorted(s.text[2:-1]))
        r = make_task("reverse").sample(i, 7)
        assert r.answer == r.text[2:-1][::-1]
        c = make_task("copy").sample(i, 7)
        assert c.answer == c.text[2:-1]
        a = make_task("add").sample(i, 7)
        x, y = a.text[2:-1].split("+")
        assert len(x) == len(y) and int(a.answer) == int(x) + int(y)
        assert a.tokens == (BOS, *encode(a.text)) and a.index == i and a.task == "add"


@pytest.mark.parametrize("name", TASKS)
def test_sample_depends_on_seed_and_index_alone(name):
    # Prepare
    t = make_task(name)

    # Execute: the same prompt asked for in a different order and from a second task object
    forward = [t.sample(i, 3) for i in range(50)]
    backward = [make_task(name).sample(i, 3) for i in reversed(range(50))][::-1]

    # Assert
    assert forward == backward
    assert [p.text for p in forward] != [t.sample(i, 4).text for i in range(50)]


def test_tasks_differ_under_the_same_seed_and_index():
    lens = {n: [len(make_task(n).sample(i, 0).answer) for i in range(30)] for n in ("sort", "copy")}
    assert lens["sort"] != lens["copy"]


@pytest.mark.parametrize("name", TASKS)
def test_limits_cover_the_longest_problem(name):
    # Prepare: every prompt at the maximal size
    t = make_task(name, min_len=9, max_len=9)

    # Execute
    samples = [t.sample(i, 0) for i in range(100)]

    # Assert
    assert max(len(p.answer) for p in samples) + 1 <= t.max_new_tokens
    assert max(len(p.tokens) for p in samples) == t.max_prompt_tokens
    assert t.max_new_tokens == make_task(name, min_len=2, max_len=9).max_new_tokens


def test_add_limit_is_reached_by_a_carry():
    t = make_task("add", max_len=3)
    assert t.max_new_tokens == len(str(999 + 999)) + 1


def test_draw_length_is_heavy_tailed():
    # Prepare
    rng = np.random.default_rng(0)

    # Execute
    lens = np.array([draw_length(rng, 2, 24, 1.2) for _ in range(2000)])

    # Assert: mostly short, a few near the cap, mean pulled above the median by the tail
    assert lens.min() == 2 and lens.max() >= 22 and lens.max() <= 24
    assert np.median(lens) <= 4
    assert lens.mean() > np.median(lens) + 1
    assert (lens >= 12).mean() > 0.05


def test_heavier_tail_gives_longer_prompts():
    rng = np.random.default_rng(0)
    light = np.mean([draw_length(rng, 2, 24, 3.0) for _ in range(2000)])
    heavy = np.mean([draw_length(rng, 2, 24, 0.5) for _ in range(2000)])
    assert heavy > light + 3


def test_task_lengths_follow_the_law():
    lens = [len(make_task("sort").sample(i, 0).answer) for i in range(2000)]
    assert np.median(lens) <= 4 and max(lens) >= 22 and min(lens) == 2


def test_fixed_length():
    rng = np.random.default_rng(0)
    assert {draw_length(rng, 5, 5, 1.2) for _ in range(50)} == {5}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "sorting"}, "unknown task 'sorting': choose one of sort, reverse, copy, add"),
        ({"name": "sort", "min_len": 0}, "min_len"),
        ({"name": "sort", "min_len": 5, "max_len": 4}, "min_len <= max_len"),
        ({"name": "sort", "tail": 0.0}, "tail"),
    ],
)
def test_bad_config_is_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        make_task(**kwargs)
    assert "\n" not in str(e.value)
