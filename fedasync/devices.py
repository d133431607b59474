"""The one device picker of the tree: the server's clients, the medical tasks and every trainer
ask it, so ``auto`` means the same everywhere."""

from __future__ import annotations

import torch


def pick_device(name: str | torch.device | None = "auto") -> torch.device:
    """``auto`` (or None): CUDA when present, else the CPU. Anything else as torch names it
    (``cpu``, ``cuda``, ``cuda:1``); asking for CUDA where there is none is the caller's
    config error to report, not silently the CPU."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
