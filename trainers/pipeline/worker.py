"""One pipeline stage's work: forwards and backwards of micro-batches, the optimiser step,
weight versions, the drift bound, the delay correction, and what it measured.

The same :class:`StageWorker` runs in the single-process emulator (all stages in one loop)
and in each process of the real pipeline, so the two compute the same numbers.

Which weights an operation uses (``version`` counts the stage's optimiser steps):

- ``gpipe`` / ``1f1b``: the live weights; the flush makes forward and backward agree.
- ``2bw`` (PipeDream-2BW): batch t computes forward and backward under W(t − delay), a
  version stashed in the core's :class:`fedasync.versions.VersionedSnapshots` (delay + 1
  versions kept on the stage's device) and run with ``torch.func.functional_call``; its
  gradient is applied to the live weights, W(t+1) = W(t) − ν ∇f(W(t−1)).
- ``paci`` (PACI): no stash. The forward uses the live weights of its time; the backward
  runs later on the same autograd graph while the optimiser has updated the live weights in
  place, so input gradients use the weights of the backward's time and weight gradients the
  activations of the forward's time (what a pipeline without stashing computes; autograd's
  version check is lifted with ``saved_tensors_hooks``). The steps a micro-batch crossed
  (its drift) are checked against the core's :class:`fedasync.staleness.StalenessBound`
  at every backward, and a violation stops the run.

Delay correction (``correction``): the core's :class:`fedasync.corrections.
DelayErrorFeedback` on the stage's accumulated gradient before the optimiser step.

Measured, not estimated: per micro-batch, the bytes of the distinct tensor storages autograd
saved in its forward (parameters excluded) plus its input and output, summed over the
micro-batches a stage holds, peak kept (``activation_peak_bytes``); at every step the bytes
of the live weights, their gradients, the optimiser's state and the stashed versions
(``weight_peak_bytes``); on CUDA also ``torch.cuda.max_memory_allocated``. Every operation's
start and end (``time.perf_counter``, comparable across processes of one machine).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from fedasync.corrections import DelayErrorFeedback
from fedasync.staleness import StalenessBound
from fedasync.versions import VersionedSnapshots
from trainers.pipeline.model import Stage
from trainers.pipeline.schedule import SCHEDULES, SYNCHRONOUS, max_drift


class DriftExceeded(RuntimeError):
    """A micro-batch crossed more optimiser steps than the bound allows."""


@dataclass
class _Held:
    inp: Tensor
    out: Tensor
    version: int
    bytes: int


def _storage_key(t: Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages among ``tensors`` (an iterable of tensors)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, Tensor):
            ptr, n = _storage_key(t)
            seen[ptr] = n
    return sum(seen.values())


class MicroBatches:
    """Micro-batch ``j``'s ids and targets: batch ``j // micro`` from ``get_batch(t)``, drawn
    once, cut into ``micro`` chunks and kept while it may still be needed (at most ``keep``
    batches, the oldest dropped: without a flush a stage's forwards run up to P − 1
    micro-batches ahead of the last stage's backwards)."""

    def __init__(
        self,
        get_batch: Callable[[int], tuple[Tensor, Tensor]],
        micro: int,
        keep: int = 2,
        device: torch.device | None = None,
    ) -> None:
        self.get_batch, self.micro, self.keep, self.device = get_batch, micro, keep, device
        self._cache: dict[int, tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {}

    def __call__(self, j: int) -> tuple[Tensor, Tensor]:
        """Micro-batch ``j``'s ids and targets (on ``device`` when given)."""
        m, t = self.micro, j // self.micro
        if t not in self._cache:
            x, y = self.get_batch(t)
            if x.shape[0] % m:
                raise ValueError(f"batch of {x.shape[0]} does not split into {m} micro-batches")
            if self.device is not None:
                x, y = x.to(self.device), y.to(self.device)
            self._cache[t] = (x.chunk(m), y.chunk(m))
            while len(self._cache) > self.keep:
                del self._cache[min(self._cache)]
        xs, ys = self._cache[t]
        return xs[j % m], ys[j % m]


class StageWorker:
    """Stage ``stage``'s operations under ``schedule`` with ``micro`` micro-batches a step.

    ``optimizer`` has ``step`` / ``zero_grad`` / ``state_dict`` (e.g. a StageOptimizer);
    ``on_step(worker, t)`` runs after the stage's step of batch t.
    """

    def __init__(
        self,
        stage: Stage,
        optimizer: Any,
        schedule: str,
        micro: int,
        *,
        delay: int = 1,
        correction: DelayErrorFeedback | None = None,
        max_drift_bound: int | None = None,
        on_step: Callable[[StageWorker, int], None] | None = None,
        record: bool = True,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r:.40}")
        if delay not in (0, 1):
            raise ValueError(f"2BW keeps two weight versions: delay 0 or 1, got {delay}")
        self.stage, self.opt, self.schedule, self.micro = stage, optimizer, schedule, micro
        self.index, self.first, self.last = stage.index, stage.first, stage.last
        self.delay = delay if schedule == "2bw" else 0
        self.correction = correction if schedule not in SYNCHRONOUS else None
        if schedule == "paci":
            bound = max_drift(schedule, stage.count, micro)
            allowed = bound if max_drift_bound is None else max_drift_bound
        else:
            allowed = self.delay
        self.bound = StalenessBound(max_staleness=allowed)
        self.on_step = on_step
        self.record = record
        self.device = next(stage.parameters()).device
        self.version = 0
        self.snapshots: VersionedSnapshots | None = None
        if self.delay:
            self.snapshots = VersionedSnapshots(self.delay + 1, device=self.device)
            self.snapshots.put(0, self._live_params())
        self.held: dict[int, _Held] = {}
        self.losses: dict[int, float] = {}
        """Per micro-batch, its loss (last stage only)."""
        self.events: list[dict[str, Any]] = []
        self.drift_seen: dict[int, int] = {}
        """How many micro-batches crossed each number of steps (PACI: 0 or 1 by default)."""
        self.act_now = self.act_peak = self.weight_peak = 0
        self._param_ptrs: set[int] = set()
        self._refresh_param_ptrs()

    # -- weights -------------------------------------------------------------------------
    def _live_params(self) -> dict[str, Tensor]:
        return dict(self.stage.named_parameters())

    def _refresh_param_ptrs(self) -> None:
        ptrs = {p.untyped_storage().data_ptr() for p in self.stage.parameters()}
        if self.snapshots is not None:
            for v in self.snapshots.versions():
                snap = self.snapshots.get(v)
                assert snap is not None
                ptrs |= {t.untyped_storage().data_ptr() for t in snap.values()}
        self._param_ptrs = ptrs

    def computed_under(self, batch: int) -> int:
        """The weight version batch ``batch`` is computed under (2BW: ``batch − delay``)."""
        return max(batch - self.delay, 0)

    # -- operations ----------------------------------------------------------------------
    def _saved(self, sizes: dict[int, int]) -> Any:
        params = self._param_ptrs

        def pack(t: Tensor) -> Tensor:
            ptr, n = _storage_key(t)
            if ptr not in params:
                sizes[ptr] = n
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def forward(self, j: int, inp: Tensor) -> Tensor:
        """Micro-batch ``j``'s forward on this stage; the output to send on (detached), or the
        logits at the last stage."""
        t0 = time.perf_counter()
        if not self.first:
            inp = inp.detach().requires_grad_(True)
        sizes: dict[int, int] = {}
        version = self.version
        with self._saved(sizes):
            if self.snapshots is not None:
                v = self.computed_under(j // self.micro)
                snap = self.snapshots.get(v)
                if snap is None:
                    raise RuntimeError(
                        f"stage {self.index}: weight version {v} for batch {j // self.micro} is "
                        f"no longer stashed (kept: {self.snapshots.versions()})"
                    )
                for t in snap.values():
                    t.requires_grad_(True)
                out = functional_call(self.stage, snap, (inp,))
                version = v
            else:
                out = self.stage(inp)
        for t in (inp, out):
            ptr, n = _storage_key(t)
            sizes[ptr] = n
        nbytes = sum(sizes.values())
        self.held[j] = _Held(inp, out, version, nbytes)
        self.act_now += nbytes
        self.act_peak = max(self.act_peak, self.act_now)
        self._event("F", j, t0)
        return out if self.last else out.detach()

    def backward(self, j: int, incoming: Tensor) -> Tensor | None:
        """Micro-batch ``j``'s backward: ``incoming`` is the target ids at the last stage, the
        gradient of this stage's output elsewhere. Returns the gradient to send back (None at
        the first stage). Steps the optimiser after the batch's last micro-batch."""
        t0 = time.perf_counter()
        h = self.held.pop(j, None)
        if h is None:
            raise RuntimeError(
                f"stage {self.index}: backward of micro-batch {j} before its forward"
            )
        # 2BW's backward runs on its stash (no drift); the others on the live weights
        tau = 0 if self.snapshots is not None else self.version - h.version
        decision = self.bound.check(tau)
        if decision.action == "reject":
            raise DriftExceeded(
                f"stage {self.index}: micro-batch {j} crossed {tau} optimiser steps between its "
                f"forward and backward ({decision.reason}); raise pipeline.micro or the bound"
            )
        self.drift_seen[tau] = self.drift_seen.get(tau, 0) + 1
        if self.last:
            logits = h.out
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), incoming.reshape(-1))
            self.losses[j] = float(loss.detach())
            (loss / self.micro).backward()
        else:
            h.out.backward(incoming)
        self.act_now -= h.bytes
        grad = None
        if not self.first:
            assert h.inp.grad is not None
            grad = h.inp.grad
        self._event("B", j, t0)
        if (j + 1) % self.micro == 0:
            self._step(j // self.micro)
        return grad

    def _step(self, t: int) -> None:
        t0 = time.perf_counter()
        live = self._live_params()
        if self.snapshots is not None:
            v = self.computed_under(t)
            snap = self.snapshots.get(v)
            assert snap is not None, f"stashed version {v} evicted before its step"
            # the stale gradient lands on the live weights: W(t+1) = W(t) − ν ∇f(W(t−delay))
            tau = self.version - v
            decision = self.bound.check(tau)
            if decision.action == "reject":
                raise DriftExceeded(f"stage {self.index}: 2BW step {t}: {decision.reason}")
            for k, p in live.items():
                g = snap[k].grad
                p.grad = None if g is None else g.detach().clone()
                snap[k].grad = None
        if self.correction is not None:
            grads = {k: p.grad for k, p in live.items() if p.grad is not None}
            fixed = self.correction.apply(f"stage{self.index}", grads)
            for k, g in fixed.items():
                live[k].grad = g
        self.weight_peak = max(self.weight_peak, self.weight_bytes())
        with torch.no_grad():
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version += 1
        if self.snapshots is not None:
            self.snapshots.put(self.version, live)
            self._refresh_param_ptrs()
        self._event("S", t * self.micro + self.micro - 1, t0)  # batch t's last micro-batch
        if self.on_step is not None:
            self.on_step(self, t)

    def _event(self, kind: str, j: int, t0: float) -> None:
        if self.record:
            self.events.append(
                {
                    "stage": self.index,
                    "kind": kind,
                    "micro": j,
                    "start": t0,
                    "end": time.perf_counter(),
                }
            )

    # -- measurement and state -----------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes held for weights now: live weights and gradients, optimiser state, stash."""
        tensors: list[Tensor] = []
        for p in self.stage.parameters():
            tensors.append(p)
            if p.grad is not None:
                tensors.append(p.grad)
        for opt in getattr(self.opt, "opts", [self.opt]):
            for st in opt.state.values():
                tensors += [v for v in st.values() if isinstance(v, Tensor) and v.dim() > 0]
        if self.snapshots is not None:
            for v in self.snapshots.versions():
                snap = self.snapshots.get(v)
                assert snap is not None
                tensors += list(snap.values())
                tensors += [t.grad for t in snap.values() if t.grad is not None]
        return tensor_bytes(tensors)

    def memory(self) -> dict[str, int]:
        """Peak bytes seen so far: activations, weights (and on CUDA ``max_memory_allocated``)."""
        out = {"activation_peak_bytes": self.act_peak, "weight_peak_bytes": self.weight_peak}
        if self.device.type == "cuda":
            out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        return out

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs (nothing may be in flight: call at a step boundary)."""
        return {
            "stage": {k: v.detach().clone() for k, v in self.stage.state_dict().items()},
            "opt": self.opt.state_dict(),
            "version": self.version,
            "snapshots": None if self.snapshots is None else self.snapshots.state_dict(),
            "correction": None if self.correction is None else self.correction.state_dict(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (at a step boundary, as it was taken)."""
        self.stage.load_state_dict(d["stage"])
        self.opt.load_state_dict(d["opt"])
        self.version = int(d["version"])
        if self.snapshots is not None and d["snapshots"] is not None:
            self.snapshots.load_state_dict(d["snapshots"])
        if self.correction is not None and d["correction"] is not None:
            self.correction.load_state_dict(d["correction"])
        self._refresh_param_ptrs()
