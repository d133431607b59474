"""Typed configuration of a silo's local work and of the data it holds.

Both travel from the server to every silo inside each train message (as JSON), so that a
SuperNode needs nothing but its silo id to join a run: the same ClientApp serves simulation
and deployment unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from medical_data.federation import Federation


@dataclass
class DPConfig:
    """Differential privacy (opacus DP-SGD); configured here, carried out in a later issue."""

    enabled: bool = False
    """Train with DP-SGD."""


@dataclass
class ClientConfig:
    """Local training of one silo for one message."""

    local_steps: int = 10
    """Optimiser steps per train message (mini-batches, sampled with replacement)."""
    batch_size: int = 32
    """Mini-batch size."""
    lr: float = 0.05
    """Local SGD learning rate."""
    momentum: float = 0.0
    """Local SGD momentum (reset every message: silos keep no optimiser state)."""
    weight_decay: float = 0.0
    """Local L2 weight decay."""
    proximal_mu: float = 0.0
    """FedProx / FedAsync proximal term rho: adds rho/2 * ||w - w_base||^2 to the loss."""
    device: str = "auto"
    """'auto' picks CUDA when present, else CPU; or 'cpu' / 'cuda' / 'cuda:1'."""
    num_threads: int = 1
    """torch intra-op threads per silo process (one CPU per silo in simulation)."""
    dp: DPConfig = field(default_factory=DPConfig)


@dataclass
class DataConfig:
    """Which benchmark and how it is split into silos (see medical_data)."""

    benchmark: str = "brain-tissue"
    """A name from medical_data.BENCHMARKS."""
    partition: str = "natural"
    """natural (groups such as slabs or patients), dirichlet (label skew) or iid."""
    dirichlet_alpha: float = 0.5
    """Concentration of the Dirichlet label skew (smaller is more skewed)."""
    site_shift: float = 1.0
    """Strength of the seeded per-silo scanner shift (MONAI intensity transforms); 0 = none."""
    test_fraction: float = 0.2
    """Held-out fraction pooled across sites for the global test set."""
    max_samples: int | None = None
    """Cap on the number of samples drawn from the benchmark (None = all)."""
    data_dir: str | None = None
    """Where fetched data lives (default $FEDASYNC_DATA or ~/.cache/fedasync/data)."""
    network: str | None = None
    """Override the benchmark's default network (cnn-small, densenet121, resnet18, unet-small)."""


def to_dict(cfg: object) -> dict:
    """A plain dict of a config dataclass (for JSON)."""
    return asdict(cfg)  # type: ignore[call-overload]


def build_silos(d: DataConfig, num_silos: int, seed: int) -> Federation:
    """The federation ``d`` describes (cached in-process by medical_data; treat as read-only)."""
    from medical_data.federation import build_federation

    return build_federation(
        d.benchmark,
        num_silos,
        seed,
        partition=d.partition,
        dirichlet_alpha=d.dirichlet_alpha,
        site_shift=d.site_shift,
        test_fraction=d.test_fraction,
        max_samples=d.max_samples,
        data_dir=d.data_dir,
    )
