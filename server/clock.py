"""The federated run's timing: each silo's speed, the run's clock, what the ClientApp is told.

The clocks themselves are in the core (``fedasync.clock``): simulation runs on its virtual
clock (a job's units are the silo's local steps, its unit time ``lab.speed.step_time_s``, so the
server takes replies in order of virtual finish time, reproducibly for a seed), deployment on
its wall clock (replies taken in the order they arrive).
"""

from __future__ import annotations

import numpy as np

from fedasync import seeds
from fedasync.clock import Clock, VirtualClock, WallClock
from protocol.config import Setup, to_dict
from server.config import FedAsyncConfig, SilosConfig
from server.config_lab import SpeedLab


def silo_speeds(cfg: SilosConfig, speed: SpeedLab, seed: int) -> list[float]:
    """Relative speed of each silo (1.0 = reference), drawn once per seed.

    stragglers: the slowest ``round(fraction * count)`` silos (at least one when fraction > 0)
    run ``straggler_slowdown`` times slower; which silos they are is drawn from the seed.
    """
    rng = seeds.rng(seed, "silo.speeds")
    n = cfg.count
    if speed.profile == "uniform":
        return [1.0] * n
    if speed.profile == "stragglers":
        k = int(round(speed.straggler_fraction * n))
        if speed.straggler_fraction > 0:
            k = max(k, 1)
        slow = set(rng.choice(n, size=min(k, n), replace=False).tolist())
        return [1.0 / speed.straggler_slowdown if i in slow else 1.0 for i in range(n)]
    if speed.profile == "lognormal":
        return [float(x) for x in np.exp(rng.normal(0.0, speed.sigma, size=n))]
    raise ValueError(f"unknown speed profile {speed.profile!r}")


def client_setup(cfg: FedAsyncConfig) -> Setup:
    """What every train message tells the ClientApp about the run (both ServerApps send it,
    as ``client_setup(cfg).to_json()``).

    ``emulate_speeds``: each silo's speed when ``lab.emulate_speed`` is on (the ClientApp
    then waits after training, see ``clients.app``), else None.
    """
    return Setup(
        client=cfg.client,
        data=cfg.data,
        num_silos=cfg.silos.count,
        seed=cfg.run.seed,
        backdoor=to_dict(cfg.lab.backdoor),
        emulate_speeds=silo_speeds(cfg.silos, cfg.lab.speed, cfg.run.seed)
        if cfg.lab.emulate_speed
        else None,
        task=cfg.task,
    )


def run_clock(cfg: FedAsyncConfig, speeds: list[float], wall_clock: bool) -> Clock:
    """The run's clock: the wall clock (deployment), else the virtual clock of the silos'
    ``speeds`` (``lab.speed.step_time_s``, ``.jitter``, ``.latency_s``, ``run.seed``)."""
    if wall_clock:
        return WallClock()
    s = cfg.lab.speed
    return VirtualClock(
        speeds, s.step_time_s, jitter=s.jitter, latency_s=s.latency_s, seed=cfg.run.seed
    )
