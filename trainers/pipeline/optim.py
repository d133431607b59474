"""A stage's optimiser: AdamW, or Muon for the blocks' weight matrices with AdamW for the rest.

Papers: AdamW (Loshchilov & Hutter 2019); Muon (Jordan et al. 2024; ``torch.optim.Muon``):
momentum orthogonalised by Newton-Schulz iterations, for 2-D hidden weight matrices only; the
embeddings, the head and every vector (biases, LayerNorm) stay on AdamW, as Muon's authors
do. Muon's learning rate is matched to AdamW's update RMS (``adjust_lr_fn=
"match_rms_adamw"``), so one ``lr`` serves both parts.

:class:`Muon` is ``torch.optim.Muon``'s update (the same momentum, Nesterov, Newton-Schulz
coefficients, shape scaling and weight decay) with the orthogonalisation in a chosen dtype
(``optim.muon_dtype``): ``torch.optim.Muon`` always orthogonalises in bfloat16, which is what
tensor cores want but costs about 200x float32's time on a CPU without bfloat16 matrix units
(0.41 s against about 2 ms a stage step here). ``auto`` is float32 on the CPU and bfloat16 on
CUDA; in bfloat16 :func:`newton_schulz` runs ``torch.optim.Muon``'s operations, so the two
optimisers give the same update (a test).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

OPTIMIZERS = ("adamw", "muon")
MUON_DTYPES = ("auto", "float32", "bfloat16")
"""``optim.muon_dtype``: the dtype Muon orthogonalises in (auto: float32 on the CPU, bfloat16
on CUDA)."""

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients of Keller Jordan's Muon (and ``torch.optim.Muon``)."""
NS_STEPS = 5
NS_EPS = 1e-7


def resolve_muon_dtype(choice: str, device: torch.device | str) -> torch.dtype:
    """The dtype Muon orthogonalises in for ``choice`` (one of MUON_DTYPES) on ``device``."""
    if choice not in MUON_DTYPES:
        raise ValueError(f"muon_dtype must be one of {MUON_DTYPES}, got {choice!r:.40}")
    if choice == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return torch.float32 if choice == "float32" else torch.bfloat16


def newton_schulz(
    g: Tensor,
    dtype: torch.dtype = torch.float32,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> Tensor:
    """The orthogonalisation of the 2-D ``g`` (about U V^T of its SVD U S V^T), computed in
    ``dtype`` and returned in it: ``g`` over its Frobenius norm (so every singular value is at
    most 1), then ``steps`` quintic iterations X <- aX + (bA + cA^2)X with A = X X^T, on the
    wide orientation (a tall matrix is transposed, so A is the smaller Gram matrix). With
    these coefficients the singular values land in roughly [0.7, 1.2], not exactly 1, which
    Muon's authors found does not hurt."""
    if g.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, shape: torch.Size, adjust: str | None = "match_rms_adamw") -> float:
    """Muon's per-matrix learning rate (``torch.optim.Muon``'s ``adjust_lr_fn``): ``original``
    (or None) scales by sqrt(max(1, rows / cols)), ``match_rms_adamw`` by 0.2 sqrt(max(rows,
    cols)) so the update's RMS is AdamW's."""
    rows, cols = shape[0], shape[1]
    if adjust is None or adjust == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be original or match_rms_adamw, got {adjust!r:.40}")


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` with the Newton-Schulz orthogonalisation in ``ns_dtype``.

    Per 2-D parameter W with gradient G: B <- momentum·B + (1 − momentum)·G (the buffer as a
    lerp, as ``torch.optim.Muon`` keeps it), U = G + momentum·(B − G) with Nesterov else B,
    O = NS(U) in ``ns_dtype``, W <- W·(1 − lr·weight_decay) − lr'·O with lr' the shape-scaled
    rate (:func:`adjusted_lr`). The momentum buffer stays in the parameter's dtype."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_dtype: torch.dtype = torch.float32,
        ns_steps: int = NS_STEPS,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        adjust_lr_fn: str | None = "match_rms_adamw",
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"Muon needs lr, momentum, weight_decay >= 0: {lr}, {momentum}, {weight_decay}"
            )
        adjusted_lr(1.0, torch.Size((1, 1)), adjust_lr_fn)  # checks the name
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One Muon step of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = float(group["lr"]), float(group["momentum"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                o = newton_schulz(
                    update,
                    self.ns_dtype,
                    group["ns_steps"],
                    tuple(group["ns_coefficients"]),
                    group["eps"],
                )
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(o.to(p.dtype), alpha=-adjusted_lr(lr, p.shape, group["adjust_lr_fn"]))
        return loss


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
        muon_dtype: str = "auto",
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
        device = next(iter(stage.parameters())).device if matrices else torch.device("cpu")
        self.muon_dtype = resolve_muon_dtype(muon_dtype, device)
        """The dtype Muon orthogonalises in (``muon_dtype`` resolved for the stage's device)."""
        self.opts: list[torch.optim.Optimizer] = []
        if matrices:
            self.opts.append(
                Muon(
                    matrices,
                    lr=lr,
                    momentum=momentum,
                    weight_decay=weight_decay,
                    ns_dtype=self.muon_dtype,
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
