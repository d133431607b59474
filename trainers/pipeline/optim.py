"""A stage's optimiser: AdamW, or Muon for the blocks' weight matrices with AdamW for the rest.

Papers: AdamW (Loshchilov & Hutter 2019); Muon (Jordan et al. 2024; ``torch.optim.Muon``):
momentum orthogonalised by Newton-Schulz iterations, for 2-D hidden weight matrices only; the
embeddings, the head and every vector (biases, LayerNorm) stay on AdamW, as Muon's authors
do. Muon's learning rate is matched to AdamW's update RMS (``adjust_lr_fn=
"match_rms_adamw"``), so one ``lr`` serves both parts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")


class StageOptimizer:
    """One stage's optimiser(s), stepped and zeroed together."""

    def __init__(
        self,
        stage: nn.Module,
        name: str,
        lr: float,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        warmup: int = 0,
    ) -> None:
        if name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r:.40}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.name, self.warmup, self.steps = name, warmup, 0
        matrices: list[nn.Parameter] = []
        rest: list[nn.Parameter] = []
        for pname, p in stage.named_parameters():
            hidden = pname.startswith("blocks.") and p.dim() == 2
            (matrices if name == "muon" and hidden else rest).append(p)
        self.opts: list[torch.optim.Optimizer] = []
        if matrices:
            self.opts.append(
                torch.optim.Muon(
                    matrices,
                    lr=lr,
                    momentum=momentum,
                    weight_decay=weight_decay,
                    adjust_lr_fn="match_rms_adamw",
                )
            )
        if rest:
            self.opts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay))
        self.muon_params = sum(p.numel() for p in matrices)
        self.adamw_params = sum(p.numel() for p in rest)

        self._base = [[g["lr"] for g in o.param_groups] for o in self.opts]

    def step(self) -> None:
        """One step of every part; during ``warmup`` steps the lr rises linearly to ``lr``."""
        scale = min(1.0, (self.steps + 1) / self.warmup) if self.warmup else 1.0
        for opt, base in zip(self.opts, self._base):
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr * scale
            opt.step()
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every part's gradients."""
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Every part's state and the step count (which the warm-up reads)."""
        return {"opts": [o.state_dict() for o in self.opts], "steps": self.steps}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (same parts, in the same order)."""
        for o, s in zip(self.opts, d["opts"], strict=True):
            o.load_state_dict(s)
        self.steps = int(d.get("steps", 0))
