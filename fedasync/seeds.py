"""The one seed stream of the tree: every random draw derives from the run's seed and a named
purpose, never from a number chosen at the call site.

``rng(seed, purpose, *keys)`` is a numpy Generator on ``SeedSequence([seed, *keys, salt])``
and ``torch_seed(seed, purpose, *keys)`` the 63-bit integer the same sequence gives for
``torch.Generator.manual_seed``. The purpose's number (``PURPOSES``) keeps two streams of one
seed apart; ``keys`` (a silo, a job id, a prompt's index) keep apart the draws of one purpose.
The numbers are the ones each stream had before the registry existed, so that every published
figure (docs/measured.md) still reproduces from its seed; a new purpose takes a new number from
`purpose_number`, which derives it from the name.

Deterministic in its arguments alone, in every process: a job's draws are the same whichever
worker runs it and whether or not the run was resumed.
"""

from __future__ import annotations

import zlib

import numpy as np

PURPOSES: dict[str, int | None] = {
    # federated runs
    "silo.speeds": 7919,  # which silos straggle, and how much (server.clock)
    "job.duration": 104729,  # a job's simulated duration on a silo (fedasync.clock)
    "job.train": None,  # the seed a silo's training (or calibration) job gets (server)
    "job.unlearn": 7,  # the seed of an unlearning job (server)
    "erasure.fraction": 4242,  # which samples a scheduled sample-level erasure names
    "site.shift": 0x7AB,  # a site's measurement shift of tabular features (medical_data)
    "backdoor.relearn": 0x5E1EA5,  # the poisoned samples a relearning attack uses
    "unlearn.probe": 0x570,  # the forget/held-out samples an unlearning rule probes
    # trainers
    "market.start": 0x3A7E,  # the market's initial prices
    "rl.slowdown": 7_368_787,  # a rollout's simulated slowdown under a speed profile
    "rl.prompt.sort": 101,  # prompt number i of each RL task
    "rl.prompt.reverse": 102,
    "rl.prompt.copy": 103,
    "rl.prompt.add": 104,
}
"""Each purpose's number (None: the purpose is the stream's only use of its keys)."""

LINEAR: dict[str, tuple[int, tuple[int, ...], int]] = {
    # purpose: (the seed's multiplier, each key's multiplier, a constant)
    "pipeline.batch": (1_000_003, (1,), 0),  # batch t of the training stream
    "market.agent": (1009, (1,), 0),  # firm i's agent (its networks, its noise)
    "rl.rollout": (1_000_003, (7919,), 17),  # group g's samples
    "rl.teacher": (1, (), 4_242),  # the teacher's initialisation, training and recovery prompts
    "rl.dagger": (1, (), 1),  # DAgger's samples (of the teacher's seed)
}
"""Torch seeds that are linear in (seed, keys): the form these streams had when their figures
were published, kept so those reproduce. A new torch stream uses `torch_seed`."""

EVAL_SEED = 2**31 - 1
"""The held-out batches' seed: the same for every run and seed (so runs compare on one set)."""


def purpose_number(purpose: str) -> int:
    """The number of ``purpose``: its registered one, or, for a purpose not in the registry,
    one derived from its name (CRC-32, stable across processes and versions)."""
    if purpose in PURPOSES:
        n = PURPOSES[purpose]
        return -1 if n is None else n
    return zlib.crc32(purpose.encode("utf-8"))


def entropy(seed: int, purpose: str, *keys: int) -> list[int]:
    """The SeedSequence entropy of (seed, purpose, keys): ``[seed, *keys, number]``."""
    words = [int(seed), *(int(k) for k in keys)]
    n = purpose_number(purpose)
    return words if n < 0 else [*words, n]


def rng(seed: int, purpose: str, *keys: int) -> np.random.Generator:
    """A numpy Generator for ``purpose`` (and ``keys``) under the run's ``seed``."""
    return np.random.default_rng(entropy(seed, purpose, *keys))


def torch_seed(seed: int, purpose: str, *keys: int) -> int:
    """An integer seed for torch (``manual_seed``) for ``purpose`` under ``seed``."""
    return int(rng(seed, purpose, *keys).integers(2**63 - 1))


def linear_seed(seed: int, purpose: str, *keys: int) -> int:
    """The torch seed of a `LINEAR` purpose: seed x m + sum(key x k) + c, modulo 2^63 - 1."""
    m, ks, c = LINEAR[purpose]
    if len(keys) != len(ks):
        raise ValueError(f"{purpose} takes {len(ks)} key(s), got {len(keys)}")
    return (int(seed) * m + sum(int(k) * x for k, x in zip(keys, ks, strict=True)) + c) % (
        2**63 - 1
    )


def int_seed(seed: int, purpose: str, *keys: int) -> int:
    """A 31-bit integer seed (what a client or an older API takes) for ``purpose``."""
    return int(rng(seed, purpose, *keys).integers(2**31 - 1))
