"""Procedural tasks with exact rewards and long-tailed answer lengths, and their vocabulary.

Idea: the rollout-length tail that asynchronous RL trainers exploit (AReaL, Fu et al. 2025,
arXiv:2505.24298; DORA, arXiv:2604.26256): a synchronous trainer waits at every batch for its
longest generation. Each task draws its problem size (a list length, a number of digits) from
a discrete truncated Pareto law, so most prompts are short and a few are long, and the answer
length grows with the size. Rewards are verifiable: 1.0 for an exact match, else 0.0, in the
spirit of the procedural generators with scorers of reasoning-gym, written here to stay
dependency-free.

Tasks (prompt -> answer): ``sort`` ``"s:3141=" -> "1134"``; ``reverse``
``"r:3141=" -> "1413"``; ``copy`` ``"c:3141=" -> "3141"``; ``add`` (two n-digit numbers)
``"a:57+68=" -> "125"``. Prompt number ``index`` under ``seed`` is the same in every run, mode
and process: its generator is seeded by ``(seed, index, task constant)`` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fedasync import seeds
from fedasync.errors import ConfigError

PAD, BOS, EOS = 0, 1, 2
VOCAB: str = "0123456789+,:=acrs"
"""The characters a prompt or answer may hold; character ``VOCAB[i]`` has id ``3 + i``."""
VOCAB_SIZE: int = 3 + len(VOCAB)
_ID = {ch: 3 + i for i, ch in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    """Token ids of ``text``, one per character (no BOS, no EOS)."""
    try:
        return [_ID[ch] for ch in text]
    except KeyError as e:
        raise ValueError(
            f"character {e.args[0]!r} is not in the vocabulary {VOCAB!r} (in {text[:20]!r})"
        ) from None


def decode(ids: Sequence[int]) -> str:
    """Text of ``ids``: stops at the first EOS, skips PAD and BOS."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i in (PAD, BOS):
            continue
        if not 3 <= i < VOCAB_SIZE:
            raise ValueError(f"token id {i} is outside the vocabulary (size {VOCAB_SIZE})")
        out.append(VOCAB[i - 3])
    return "".join(out)


def draw_length(rng: np.random.Generator, min_len: int, max_len: int, tail: float) -> int:
    """A problem size in ``[min_len, max_len]`` from a discrete truncated Pareto law.

    ``floor(X)`` with X Pareto(scale ``min_len``, exponent ``tail``) truncated to
    ``[min_len, max_len + 1)``, drawn by inverting its CDF with one uniform from ``rng``:
    P(L ≥ k) ∝ (min_len/k)^tail − (min_len/(max_len+1))^tail. Smaller ``tail`` = heavier tail;
    min 2, max 24, tail 1.2 gives median 3 and 99th percentile 21.
    """
    top = 1.0 - (min_len / (max_len + 1)) ** tail
    u = rng.random() * top
    x = min_len * (1.0 - u) ** (-1.0 / tail)
    return min(max(int(x), min_len), max_len)


@dataclass(frozen=True)
class Prompt:
    """One problem: ``tokens`` is BOS + encode(text); ``answer`` is the exact reference."""

    index: int
    task: str
    text: str
    tokens: tuple[int, ...]
    answer: str


def _digits(rng: np.random.Generator, n: int) -> str:
    return "".join(str(d) for d in rng.integers(0, 10, size=n))


def _number(rng: np.random.Generator, n: int) -> int:
    """An n-digit number (no leading zero unless n == 1)."""
    first = str(rng.integers(0 if n == 1 else 1, 10))
    return int(first + _digits(rng, n - 1))


def _sort(rng: np.random.Generator, n: int) -> tuple[str, str]:
    d = _digits(rng, n)
    return f"s:{d}=", "".join(sorted(d))


def _reverse(rng: np.random.Generator, n: int) -> tuple[str, str]:
    d = _digits(rng, n)
    return f"r:{d}=", d[::-1]


def _copy(rng: np.random.Generator, n: int) -> tuple[str, str]:
    d = _digits(rng, n)
    return f"c:{d}=", d


def _add(rng: np.random.Generator, n: int) -> tuple[str, str]:
    x, y = _number(rng, n), _number(rng, n)
    return f"a:{x}+{y}=", str(x + y)


# name -> (maker of (text, answer) for problem size n, constant in the prompt's seed)
_SPECS: dict[str, Callable[[np.random.Generator, int], tuple[str, str]]] = {
    "sort": _sort,
    "reverse": _reverse,
    "copy": _copy,
    "add": _add,
}
TASKS: tuple[str, ...] = tuple(_SPECS)


@dataclass(frozen=True)
class Task:
    """A procedural task: prompts drawn by ``(seed, index)``, scored by exact match.

    ``min_len``/``max_len``/``tail`` set the problem-size law (see :func:`draw_length`).
    """

    name: str
    min_len: int = 2
    max_len: int = 24
    tail: float = 1.2

    @property
    def max_new_tokens(self) -> int:
        """Longest possible answer plus one for EOS (a sum has one digit more)."""
        return self.max_len + (2 if self.name == "add" else 1)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest possible ``Prompt.tokens`` (BOS included)."""
        body = 2 * self.max_len + 1 if self.name == "add" else self.max_len
        return 1 + len("x:") + body + len("=")

    def sample(self, index: int, seed: int) -> Prompt:
        """Prompt number ``index`` under ``seed``; depends on ``(seed, index)`` alone."""
        make = _SPECS[self.name]
        rng = seeds.rng(seed, f"rl.prompt.{self.name}", index)
        n = draw_length(rng, self.min_len, self.max_len, self.tail)
        text, answer = make(rng, n)
        return Prompt(index, self.name, text, (BOS, *encode(text)), answer)

    def reference(self, prompt: Prompt) -> str:
        """The exact answer to ``prompt``."""
        return prompt.answer

    def expert_labels(self, prompt: Prompt, completion: Sequence[int]) -> list[int]:
        """The expert's next token before each token of ``completion`` (ids, EOS included):
        label ``j`` is the best continuation of ``completion[:j]``, right or wrong so far.

        ``sort``: the smallest prompt digit not yet written (a written digit with no copy
        left in the prompt is ignored), EOS once every digit is written: after a mistake the
        rest of the list still comes out in order. The other tasks: the exact answer's token
        at position ``j``, EOS from the answer's length on. An imitation learner trained on
        these labels at its own prefixes (DAgger) learns to recover, not only to continue a
        right answer.
        """
        answer = encode(prompt.answer)
        labels: list[int] = []
        if self.name == "sort":
            left = sorted(answer)
            for tok in completion:
                labels.append(left[0] if left else EOS)
                if tok in left:
                    left.remove(tok)
            return labels
        for j in range(len(completion)):
            labels.append(answer[j] if j < len(answer) else EOS)
        return labels

    def score(self, prompt: Prompt, completion: str) -> float:
        """Reward in [0, 1]: 1.0 if ``completion`` equals the answer exactly, else 0.0."""
        return 1.0 if completion == prompt.answer else 0.0


def make_task(name: str, *, min_len: int = 2, max_len: int = 24, tail: float = 1.2) -> Task:
    """The task called ``name`` with a validated problem-size law."""
    if name not in _SPECS:
        raise ConfigError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
    if not 1 <= min_len <= max_len:
        raise ConfigError(f"task lengths need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if not tail > 0:
        raise ConfigError(f"task tail exponent must be > 0, got {tail}")
    return Task(name, min_len, max_len, float(tail))
