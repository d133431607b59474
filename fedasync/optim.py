"""Server optimizers applied to an aggregated update direction Δ.

Paper: "Adaptive Federated Optimization" (FedOpt / FedAdam, Reddi et al. 2021). The server
treats Δ = (desired new params) − (old params), i.e. a *negative* pseudo-gradient, and takes
a step along it:

- ``sgd``:      x ← x + lr·Δ                          (lr = 1 is plain FedAvg / FedBuff)
- ``momentum``: m ← μ·m + Δ;  x ← x + lr·m              (FedAvgM, Hsu et al. 2019)
- ``adam``:     m ← β1·m + (1−β1)·Δ;  v ← β2·v + (1−β2)·Δ²;  x ← x + lr·m / (√v + ε)

Departures: like FedAdam, Adam here does **not** bias-correct m and v (no division by
1 − β^t) and uses a large ε (default 1e-3) as the paper's adaptivity knob; m and v start at
zero. State is kept per tensor name and created lazily on the first step. Only floating
tensors are updated; integer buffers are taken from ``params`` unchanged (see
:mod:`fedasync.tensors`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from fedasync import flat
from fedasync.flat import FlatParams
from fedasync.tensors import is_arithmetic
from fedasync.types import Params


def _flat_or_empty(m: Params, params: Params) -> bool:
    """No moment yet, or one on ``params``' flat layout (the fused step may run)."""
    return not m or (isinstance(m, FlatParams) and flat.same(m, params))


OptimizerKind = Literal["sgd", "momentum", "adam"]
"""The update rules (see module docstring): the type of ``server.optimizer.kind``."""
OPTIMIZER_KINDS: tuple[OptimizerKind, ...] = get_args(OptimizerKind)
"""The same names as a tuple, derived from the Literal (the one place they are written)."""


@dataclass
class ServerOptimizer:
    """Server-side optimizer over ``Params``; ``step`` returns new params, never mutates."""

    kind: OptimizerKind = "sgd"
    """Update rule (see module docstring)."""
    lr: float = 1.0
    """Server learning rate η (dimensionless multiplier on Δ)."""
    momentum: float = 0.9
    """μ for ``momentum``."""
    betas: tuple[float, float] = (0.9, 0.99)
    """(β1, β2) for ``adam``."""
    eps: float = 1e-3
    """ε (adaptivity) for ``adam``."""
    _m: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)
    _v: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)
    _steps: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZER_KINDS:
            raise ValueError(
                f"unknown optimizer kind {self.kind!r}; valid: {', '.join(OPTIMIZER_KINDS)}"
            )
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")

    @property
    def steps(self) -> int:
        """Number of ``step`` calls so far."""
        return self._steps

    def step(self, params: Params, delta: Params) -> Params:
        """Return the new params after one step along ``delta`` (same names as ``params``)."""
        if not flat.same(params, delta) and params.keys() != delta.keys():
            raise KeyError("params and delta have different tensor names")
        if self.kind != "adam" and flat.same(params, delta) and _flat_or_empty(self._m, params):
            return self._flat_step(params, delta)  # type: ignore[arg-type]
        if isinstance(self._m, FlatParams):  # per tensor from here on: a dict of its own
            self._m = {k: v for k, v in self._m.items() if is_arithmetic(v)}
        out: Params = {}
        b1, b2 = self.betas
        for k, x in params.items():
            if not is_arithmetic(x):
                out[k] = x.detach().clone()
                continue
            d = delta[k].detach().to(dtype=x.dtype, device=x.device)
            if self.kind == "sgd":
                out[k] = x.detach() + self.lr * d
            elif self.kind == "momentum":
                m = self._m.get(k)
                m = d.clone() if m is None else self.momentum * m.to(x.device) + d
                self._m[k] = m
                out[k] = x.detach() + self.lr * m
            else:
                m = self._m.get(k)
                v = self._v.get(k)
                m = (1 - b1) * d if m is None else b1 * m.to(x.device) + (1 - b1) * d
                v = (1 - b2) * d * d if v is None else b2 * v.to(x.device) + (1 - b2) * d * d
                self._m[k], self._v[k] = m, v
                out[k] = x.detach() + self.lr * m / (v.sqrt() + self.eps)
        self._steps += 1
        return out

    def _flat_step(self, params: FlatParams, delta: FlatParams) -> FlatParams:
        """sgd and momentum on flat buffers (the same arithmetic as the loop in ``step``)."""
        if self.kind == "momentum":
            m = self._m
            if not m:
                m = flat.clone(delta)
            else:
                m = flat.axpy(self.momentum, m, delta)  # type: ignore[arg-type]
            self._m = m
            delta = m  # type: ignore[assignment]
        self._steps += 1
        return flat.axpy(self.lr, delta, params, loose_from=params)

    def map_first_moment(self, fn: Callable[[Params], Params]) -> None:
        """Replace the first moment m (momentum's velocity, Adam's m) by ``fn(m)``, e.g. a
        projection out of an erased subspace. Adam's second moment v holds squared magnitudes,
        no direction, and is kept."""
        if self._m:
            out = fn(self._m if isinstance(self._m, FlatParams) else dict(self._m))
            if isinstance(out, FlatParams) and flat.same(out, self._m):
                self._m = out
            else:
                self._m = {k: out[k].detach() if k in out else v for k, v in self._m.items()}

    def state_dict(self) -> dict[str, Any]:
        """Settings, step count and the moments (copies)."""
        return {
            "kind": self.kind,
            "lr": self.lr,
            "momentum": self.momentum,
            "betas": list(self.betas),
            "eps": self.eps,
            "steps": self._steps,
            "m": {k: v.detach().clone() for k, v in self._m.items() if is_arithmetic(v)},
            "v": {k: v.detach().clone() for k, v in self._v.items()},
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.kind = d["kind"]
        self.lr = float(d["lr"])
        self.momentum = float(d["momentum"])
        b1, b2 = d["betas"]
        self.betas = (float(b1), float(b2))
        self.eps = float(d["eps"])
        self._steps = int(d["steps"])
        self._m = {k: v.detach().clone() for k, v in d["m"].items()}
        self._v = {k: v.detach().clone() for k, v in d["v"].items()}
        self.__post_init__()
