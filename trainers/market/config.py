"""Typed configuration of a pricing-market run (``fedasync market``), validated where it starts.

defaults <- YAML file (``--config``) <- ``key=value`` overrides, on the conventions of the
other trainers (runkit.configload): an unknown key, a wrong type or a value out of range is
a ``fedasync.errors.ConfigError`` naming the key (one line, exit 2). Every key is documented
by the docstring under its field; docs/market.md lists them all (a test checks).

The market's defaults are Calvano et al. (AER 2020): two firms, a_i = 2, a_0 = 0, mu = 0.25,
c = 1, prices within xi = 0.1 of the Nash-to-monopoly span on either side. The discount rate
rho = 0.05 per time unit makes a revision one time unit later worth e^-0.05 = 0.951, about
Calvano's per-period 0.95, at the default rate lambda = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fedasync.ranges import NON_NEGATIVE, POSITIVE, Range
from runkit import configload
from runkit.configload import check, check_ranges, choices, load_structured, recheck
from runkit.keys import TrainerKeys

ClockMode = Literal["async", "sync"]
"""``market.clock``."""
InitPrices = Literal["random", "nash", "monopoly"]
"""``market.init``."""
RewardKind = Literal["integral", "rate"]
"""``market.reward``."""

CLOCK_MODES: tuple[str, ...] = choices(ClockMode)
INITS: tuple[str, ...] = choices(InitPrices)
REWARDS: tuple[str, ...] = choices(RewardKind)

if not TYPE_CHECKING:  # what omegaconf sees: a str carrying its Literal (configload docstring)
    ClockMode, InitPrices, RewardKind = (
        Annotated[str, t] for t in (ClockMode, InitPrices, RewardKind)
    )


@dataclass
class MarketSection:
    """``market.*``: the logit market, its clocks and its observation latency."""

    firms: int = 2
    """Number of firms n (at least 2: one firm is a monopolist)."""
    quality: float = 2.0
    """a_i, every firm's product quality."""
    outside: float = 0.0
    """a_0, the outside good's quality."""
    mu: float = 0.25
    """Horizontal differentiation (logit scale): smaller is closer to Bertrand."""
    cost: float = 1.0
    """c, every firm's marginal cost."""
    xi: float = 0.1
    """Prices lie within [p_N - xi (p_M - p_N), p_M + xi (p_M - p_N)]."""
    clock: ClockMode = "async"
    """async: each firm revises on its own Poisson clock of rate ``rate``; sync: all firms
    revise together on one common clock of that rate."""
    rate: float = 1.0
    """lambda, revisions per firm per time unit."""
    latency: float = 0.0
    """delta, how late (time units) a firm sees its competitors' prices; its own at once."""
    discount_rate: float = 0.05
    """rho: a profit s time units ahead is worth e^(-rho s) (continuous discounting; each
    transition's discount is e^(-rho x its length))."""
    reward: RewardKind = "integral"
    """integral: a transition's reward is the profit earned over it, discounted continuously
    (Q about pi / rho whatever the rate); rate: its mean profit per time unit (Q about
    pi x rate / rho: grows with the revision rate, a probe of failure mode 2)."""
    init: InitPrices = "random"
    """Starting prices: uniform in the price range (seeded), or all at Nash or monopoly."""

    def __post_init__(self) -> None:
        """Checked when built: ranges and choices."""
        check_ranges(self, "market.", RANGES)
        check(
            self.clock in CLOCK_MODES,
            f"market.clock must be one of {CLOCK_MODES}, got {self.clock!r:.40}",
        )
        check(self.init in INITS, f"market.init must be one of {INITS}, got {self.init!r:.40}")
        check(
            self.reward in REWARDS,
            f"market.reward must be one of {REWARDS}, got {self.reward!r:.40}",
        )


@dataclass
class AgentSection:
    """``agent.*``: each firm's DDPG agent; the one place of its defaults (trainers.market.ddpg.
    DDPGSettings is built from this section and has none of its own)."""

    hidden: int = 64
    """Width of the actor's and the critic's hidden layers."""
    layers: int = 2
    """Hidden layers of each network."""
    actor_lr: float = 0.0001
    """Adam learning rate of the actor."""
    critic_lr: float = 0.001
    """Adam learning rate of the critic."""
    batch_size: int = 64
    """Transitions per gradient step."""
    buffer_size: int = 100_000
    """Replay buffer capacity (transitions)."""
    tau: float = 0.01
    """Soft target update: target <- tau online + (1 - tau) target, every step."""
    warmup: int = 256
    """Transitions collected before learning starts."""
    noise_sd: float = 0.2
    """Gaussian exploration noise at the start, as a fraction of the price range's half-width."""
    noise_min: float = 0.01
    """The noise's floor (same units)."""
    noise_decay: float = 0.0005
    """Noise sd = max(noise_min, noise_sd exp(-noise_decay x prices set))."""
    updates_per_revision: int = 1
    """Gradient steps the firm's agent takes at each of its revisions."""
    critic_grad_clip: float = 0.0
    """Clip the critic's gradient norm to this (0: off). A stabiliser against failure mode 2."""
    target_q_clip: bool = False
    """Clip TD targets (trainers.market.ddpg). A stabiliser against failure mode 2."""
    action_reg: float = 0.01
    """Penalty on the actor's pre-tanh output squared (keeps its tanh out of saturation,
    where an actor that overshot to an end of the price range would stay); 0: off."""
    q_bound: float = 10_000.0
    """The divergence detector: a |Q| beyond this marks the run corrupted."""
    loss_bound: float = 1e8
    """The divergence detector: a critic loss beyond this (or NaN) marks the run corrupted."""

    def __post_init__(self) -> None:
        """Checked when built: ranges."""
        check_ranges(self, "agent.", RANGES)


@dataclass
class RunSection(TrainerKeys):
    """``run.*``: the common run keys (runkit.keys.TrainerKeys; ``run.seed`` is the first seed, the
    run's seeds are seed, seed + 1, ..., seed + seeds - 1), length, measures and parallelism."""

    seeds: int = 3
    """Independent runs (seeds) of every setting, for the 95% intervals."""
    name: str = "market"
    """Run folder name under ``run.out_dir``."""
    horizon: float = 2000.0
    """Training length in time units (each firm revises about rate x horizon times)."""
    revisions: int = 0
    """When > 0, the horizon is this many revisions per firm instead: run.horizon is
    replaced by revisions / market.rate (every rate gets the same number of updates)."""
    measure_fraction: float = 0.1
    """The collusion index is measured over this last fraction of the horizon."""
    window: float = 50.0
    """Time units per ``window`` event (mean prices, profits, index, critic losses)."""
    deviation: bool = True
    """After training, the forced-deviation test on the frozen agents (trace diagnostics)."""
    deviation_span: float = 40.0
    """Time units the deviation test runs after the deviation (recovery is looked for
    within it)."""
    workers: int = 0
    """Processes running seeds and cells in parallel (0: one per core, at most the runs)."""

    def __post_init__(self) -> None:
        """Checked when built: the common keys, ranges, a device the agents run on."""
        super().__post_init__()
        check_ranges(self, "run.", RANGES)
        check(
            self.device != "cuda",
            "run.device=cuda: the market's agents are small networks that run on the CPU "
            "(run.device=auto or cpu)",
        )


@dataclass
class SweepSection:
    """``sweep.*``: a phase diagram over (rate, latency) when both lists are given."""

    rates: list[float] = field(default_factory=list)
    """lambda values (rows of the phase diagram); empty: no sweep, one setting."""
    latencies: list[float] = field(default_factory=list)
    """delta values (columns of the phase diagram)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, and both lists or neither."""
        check_ranges(self, "sweep.", RANGES)
        check(
            bool(self.rates) == bool(self.latencies),
            "sweep.rates and sweep.latencies go together: give both lists or neither",
        )
        check(
            len(self.rates) <= 16 and len(self.latencies) <= 16, "a sweep has at most 16x16 cells"
        )


@dataclass
class MarketConfig:
    """The whole ``fedasync market`` config (one section per key prefix)."""

    market: MarketSection = field(default_factory=MarketSection)
    agent: AgentSection = field(default_factory=AgentSection)
    run: RunSection = field(default_factory=RunSection)
    sweep: SweepSection = field(default_factory=SweepSection)

    def __post_init__(self) -> None:
        """Checked when built: the keys of different sections that must agree."""
        events = self.market.rate * self.horizon * self.market.firms
        check(
            events <= 5_000_000,
            f"market.rate x run.horizon x market.firms = {events:.0f} revisions: at most 5e6",
        )
        check(
            self.run.window <= self.horizon,
            f"run.window={self.run.window} exceeds the horizon {self.horizon:g}",
        )

    @property
    def horizon(self) -> float:
        """The training length in time units: ``run.horizon``, or ``run.revisions`` /
        ``market.rate`` when revisions are given."""
        if self.run.revisions > 0:
            return self.run.revisions / self.market.rate
        return self.run.horizon


RANGES: dict[str, Range] = {
    "market.firms": Range(2, 16),
    "market.quality": Range(-100, 100),
    "market.outside": Range(-100, 100),
    "market.mu": Range(0.001, 100),
    "market.cost": Range(0, 100),
    "market.xi": Range(0, 10),
    "market.rate": Range(0.001, 1000),
    "market.latency": Range(0, 1000),
    "market.discount_rate": Range(0, 100),
    "agent.hidden": Range(1, 4096),
    "agent.layers": Range(1, 16),
    "agent.actor_lr": Range(0, 1, lo_open=True),
    "agent.critic_lr": Range(0, 1, lo_open=True),
    "agent.batch_size": Range(1, 65_536),
    "agent.buffer_size": Range(1, 10_000_000),
    "agent.tau": Range(0, 1, lo_open=True),
    "agent.warmup": Range(1, 10_000_000),
    "agent.noise_sd": Range(0, 10),
    "agent.noise_min": Range(0, 10),
    "agent.noise_decay": NON_NEGATIVE,
    "agent.updates_per_revision": Range(0, 64),
    "agent.critic_grad_clip": NON_NEGATIVE,
    "agent.action_reg": Range(0, 100),
    "agent.q_bound": POSITIVE,
    "agent.loss_bound": POSITIVE,
    "run.seed": NON_NEGATIVE,
    "run.seeds": Range(1, 1000),
    "run.horizon": Range(0, 1_000_000, lo_open=True),
    "run.revisions": Range(0, 5_000_000),
    "run.measure_fraction": Range(0, 1, lo_open=True),
    "run.window": POSITIVE,
    "run.deviation_span": POSITIVE,
    "run.workers": Range(0, 256),
    "sweep.rates[]": Range(0.001, 1000),
    "sweep.latencies[]": Range(0, 1000),
}
"""Every numeric key's allowed values."""


def load_market_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> MarketConfig:
    """The config, checked as it is built: defaults <- YAML ``path`` <- ``key=value``
    overrides."""
    return load_structured(MarketConfig, path, overrides, "market.clock=sync")


def validate(cfg: MarketConfig) -> MarketConfig:
    """Check ``cfg`` again (every section, then the whole) and return it."""
    return recheck(cfg)


def to_container(cfg: MarketConfig) -> dict[str, Any]:
    """The config as plain dicts (for metrics.jsonl and summary.json)."""
    return configload.to_container(cfg)
