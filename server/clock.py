"""Clocks that decide which finished work the server takes next.

Simulation runs on a deterministic *virtual clock*: every silo has a speed drawn from the
configured profile, a job's duration is known when it is dispatched (local steps x step time /
speed, plus latency and seeded jitter), and the server takes replies in order of virtual
finish time, waiting for the real computation of exactly that job. A run is therefore
reproducible for a seed even though Flower's engine computes jobs in parallel and in any order.

Deployment runs on the *wall clock*: replies are taken in the order they arrive.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from server.config import FedAsyncConfig, SilosConfig


def silo_speeds(cfg: SilosConfig, seed: int) -> list[float]:
    """Relative speed of each silo (1.0 = reference), drawn once per seed.

    stragglers: the slowest ``round(fraction * count)`` silos (at least one when fraction > 0)
    run ``straggler_slowdown`` times slower; which silos they are is drawn from the seed.
    """
    rng = np.random.default_rng([seed, 7919])
    n = cfg.count
    if cfg.speed_profile == "uniform":
        return [1.0] * n
    if cfg.speed_profile == "stragglers":
        k = int(round(cfg.straggler_fraction * n))
        if cfg.straggler_fraction > 0:
            k = max(k, 1)
        slow = set(rng.choice(n, size=min(k, n), replace=False).tolist())
        return [1.0 / cfg.straggler_slowdown if i in slow else 1.0 for i in range(n)]
    if cfg.speed_profile == "lognormal":
        return [float(x) for x in np.exp(rng.normal(0.0, cfg.sigma, size=n))]
    raise ValueError(f"unknown speed profile {cfg.speed_profile!r}")


def client_setup(cfg: FedAsyncConfig) -> dict[str, Any]:
    """What every train message tells the ClientApp about the run (both ServerApps send it).

    ``emulate_speeds``: each silo's speed when ``silos.emulate_speed`` is on (the ClientApp
    then waits after training, see ``clients.app``), else None.
    """
    from clients.config import to_dict

    return {
        "client": to_dict(cfg.client),
        "data": to_dict(cfg.data),
        "backdoor": to_dict(cfg.backdoor),
        "num_silos": cfg.silos.count,
        "seed": cfg.run.seed,
        "emulate_speeds": silo_speeds(cfg.silos, cfg.run.seed) if cfg.silos.emulate_speed else None,
    }


class Timed(Protocol):
    """Anything with a dispatch and a finish time (a job in flight)."""

    dispatched_at: float
    finishes_at: float


@dataclass
class JobTiming:
    """When a job was sent and when it finishes, in seconds of the clock in use."""

    dispatched_at: float
    finishes_at: float


class VirtualClock:
    """Deterministic virtual time; the next job to take is the one that finishes first."""

    kind = "virtual"

    def __init__(self, cfg: SilosConfig, speeds: list[float], local_steps: int, seed: int):
        self.cfg = cfg
        self.speeds = speeds
        self.local_steps = local_steps
        self.seed = seed
        self.now = 0.0

    def duration(self, silo: int, job_id: int) -> float:
        """Virtual seconds of job ``job_id`` on ``silo``: compute / speed x jitter + latency."""
        rng = np.random.default_rng([self.seed, silo, job_id, 104729])
        jitter = 1.0 + self.cfg.jitter * float(rng.uniform(-1.0, 1.0))
        compute = self.local_steps * self.cfg.step_time_s / self.speeds[silo]
        return compute * jitter + self.cfg.latency_s

    def schedule(self, silo: int, job_id: int) -> JobTiming:
        return JobTiming(self.now, self.now + self.duration(silo, job_id))

    def select(self, inflight: Mapping[str, Timed], arrived: set[str]) -> list[str] | None:
        """Message ids to take now (all that finish at the earliest time), or None to wait.

        Simultaneous finishes are taken together, as one discrete event, so that equal
        speeds reproduce synchronous rounds exactly.
        """
        if not inflight:
            return None
        first = min(t.finishes_at for t in inflight.values())
        due = sorted(
            m
            for m, t in inflight.items()
            if math.isclose(t.finishes_at, first, rel_tol=0, abs_tol=1e-9)
        )
        if all(m in arrived for m in due):
            return due
        return None

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)

    def next_event_time(self, inflight: Mapping[str, Timed]) -> float:
        return min((t.finishes_at for t in inflight.values()), default=math.inf)

    def state_dict(self) -> dict:
        return {"now": self.now}

    def load_state_dict(self, d: dict) -> None:
        self.now = float(d["now"])


class WallClock:
    """Wall time since start; replies are taken as they arrive."""

    kind = "wall"

    def __init__(self, start_offset: float = 0.0):
        self._t0 = time.monotonic() - start_offset

    @property
    def now(self) -> float:
        return time.monotonic() - self._t0

    def schedule(self, silo: int, job_id: int) -> JobTiming:
        return JobTiming(self.now, math.inf)

    def select(self, inflight: Mapping[str, Timed], arrived: set[str]) -> list[str] | None:
        due = sorted((m for m in arrived if m in inflight), key=lambda m: inflight[m].dispatched_at)
        return due or None

    def advance_to(self, t: float) -> None:  # wall time advances by itself
        return None

    def next_event_time(self, inflight: Mapping[str, Timed]) -> float:
        return self.now

    def state_dict(self) -> dict:
        return {"now": self.now}

    def load_state_dict(self, d: dict) -> None:
        self._t0 = time.monotonic() - float(d["now"])
