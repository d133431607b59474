"""Typed configuration of a silo's local work, of the data it holds, and of an erasure.

``Setup`` (local training, data, DP, backdoor, seed) travels from the server to every silo
inside each message (as JSON), so that a SuperNode needs nothing but its silo id to join a
run: the same ClientApp serves simulation and deployment unchanged. ``SiloErasure`` is what an
unlearn request asks of the silo. Both are parsed and validated once on arrival.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from protocol.keys import dumps, loads

PRECISIONS = ("fp32", "bf16", "fp16")
"""What ``client.precision`` may name (clients/loop.py)."""
DP_DELTA = 1e-5
"""The delta every silo's DP-SGD epsilon is for (``dp-delta`` in its replies). A constant, not
a setting (was ``client.dp.delta``): the usual delta, well below 1/n for every benchmark's
silos, the same as the central one (server.privacy.CENTRAL_DELTA) so that a silo's two
epsilons compare, and a silo's ledger composes every message at one delta; no run has
reported at another."""
DP_ACCOUNTANT = "rdp"
"""The opacus accountant a silo keeps its privacy ledger with. A constant, not a setting (was
``client.dp.accountant``): RDP composes messages of different noise multipliers and sample
rates (gdp cannot), it is opacus's default and the one the tests check the ledger against, and
a silo's ledger, kept across runs, is read by one accountant (another would state another
epsilon for the same history)."""
TEST_FRACTION = 0.2
"""Held-out share of every silo pooled into the global test set (ignored where the data has a
fixed test split: medmnist, breast-fna). A constant, not a setting (was ``data.test_fraction``):
every benchmark and measurement used 0.2, and changing it changes the test set every score of
docs/measured.md is against."""
SETTLED: dict[str, tuple[str, object]] = {
    "client.dp.delta": ("delta", DP_DELTA),
    "client.dp.accountant": ("accountant", DP_ACCOUNTANT),
    "data.test_fraction": ("test_fraction", TEST_FRACTION),
}
"""Keys that were settings and travelled in the setup: an earlier coordinator's message that
gives one is read when it holds the constant's value, and refused otherwise (`Setup.from_json`)."""

if TYPE_CHECKING:
    from medical_data.federation import Federation


@dataclass
class DPConfig:
    """Differential privacy: DP-SGD on every silo with opacus (clients/dp.py), each silo's
    epsilon accumulated across messages and runs in its ledger (clients/privacy.py)."""

    noise_multiplier: float | None = None
    """Train with DP-SGD (per-sample clipping, Gaussian noise, Poisson-sampled batches) at this
    noise standard deviation, as a multiple of max_grad_norm. None (and no target_epsilon):
    no DP. Setting it (or target_epsilon) is what turned DP on (``client.dp.enabled``, still
    read: ``enabled=true`` alone is ``noise_multiplier=1.0``, its default then)."""
    target_epsilon: float | None = None
    """Instead of noise_multiplier, DP-SGD at the smallest noise for which one train message
    costs at most this epsilon (at delta), by opacus's get_noise_multiplier."""
    max_grad_norm: float = 1.0
    """Per-sample gradient clipping norm C (L2 over all parameters)."""
    epsilon_budget: float | None = None
    """A silo refuses any message that would take its accumulated epsilon past this (None: no
    budget)."""

    @property
    def enabled(self) -> bool:
        """DP-SGD is on: a noise multiplier or a target epsilon is set."""
        return self.noise_multiplier is not None or self.target_epsilon is not None

    def to_wire(self) -> dict[str, Any]:
        """As the setup carries it, the form every node reads (``enabled`` and a number for
        ``noise_multiplier``, 1.0 where none is used), so that a node of an earlier version
        trains exactly as this one does."""
        return {
            **asdict(self),
            "enabled": self.enabled,
            "noise_multiplier": 1.0 if self.noise_multiplier is None else self.noise_multiplier,
        }

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> DPConfig:
        """The DPConfig `to_wire` (or an earlier coordinator, with ``delta`` and
        ``accountant`` taken out) wrote: off unless ``enabled``; on, the target epsilon if
        there is one, else the noise multiplier."""
        raw = dict(raw)
        if "enabled" in raw:
            enabled = raw.pop("enabled")
            if not isinstance(enabled, bool):
                raise ValueError("client.dp.enabled must be true or false")
            if not enabled:
                raw["noise_multiplier"] = raw["target_epsilon"] = None
            elif raw.get("target_epsilon") is not None:
                raw["noise_multiplier"] = None
        return cls(**raw)

    @property
    def delta(self) -> float:
        """The delta every reported epsilon is for (``DP_DELTA``, a constant)."""
        return DP_DELTA

    @property
    def accountant(self) -> str:
        """The opacus accountant (``DP_ACCOUNTANT``, a constant)."""
        return DP_ACCOUNTANT

    def __post_init__(self) -> None:
        """Validated whenever built (omegaconf builds a run's config, the ClientApp the one it
        is sent); an error names the key."""
        checks = [
            (
                self.noise_multiplier is None or self.noise_multiplier > 0,
                "client.dp.noise_multiplier must be > 0 (or null)",
            ),
            (
                self.noise_multiplier is None or self.target_epsilon is None,
                "client.dp.noise_multiplier and client.dp.target_epsilon: give one (the noise, "
                "or the epsilon a message may cost), not both",
            ),
            (
                self.target_epsilon is None or self.target_epsilon > 0,
                "client.dp.target_epsilon must be > 0 (or null)",
            ),
            (self.max_grad_norm > 0, "client.dp.max_grad_norm must be > 0"),
            (
                self.epsilon_budget is None or self.epsilon_budget > 0,
                "client.dp.epsilon_budget must be > 0 (or null)",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


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
    precision: str = "fp32"
    """fp32, or mixed precision on CUDA: bf16 or fp16 (dynamic loss scaling); a CPU trains
    in float32 whatever this says (clients/loop.py)."""
    dp: DPConfig = field(default_factory=DPConfig)


@dataclass
class TaskConfig:
    """The silos' task when it is a MONAI bundle instead of a built-in benchmark."""

    bundle: str | None = None
    """A MONAI training bundle's folder (configs/train.json or .yaml, configs/metadata.json):
    its network, loss, optimiser, transforms, datalist and inferers are the task
    (medical_data/monai_bundle.py); its datalist is split into silos by ``data.partition``
    (natural: each item's ``site``; iid). None: the built-in ``data.benchmark``."""
    cache: int = 8
    """Items per silo whose deterministic transforms stay in memory (MONAI CacheDataset's
    cache_num); every other read streams from disk. 0: none cached."""
    workers: int = 0
    """DataLoader worker processes per silo (0: in the silo's own process)."""

    def __post_init__(self) -> None:
        if self.cache < 0 or self.workers < 0:
            raise ValueError("task.cache and task.workers must be >= 0")
        if self.bundle is not None and not str(self.bundle).strip():
            raise ValueError("task.bundle must name a folder (or be null)")


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
    max_samples: int | None = None
    """Cap on the number of samples drawn from the benchmark (None = all)."""
    data_dir: str | None = None
    """Where fetched data lives (default $FEDASYNC_DATA or ~/.cache/fedasync/data)."""
    network: str | None = None
    """Override the benchmark's default network (cnn-small, densenet121, resnet18, unet-small, unet,
    mlp-small)."""
    server_test: str | None = None
    """Deployment: the coordinator's own held-out set, a Decathlon datalist on its machine
    (its ``test`` list, else ``validation``, else ``training``; medical_data.datalist), which
    the global model is evaluated on during the run. None: the silos evaluate it on their own
    data at the end (federated, weighted by sample count). Simulation ignores it."""


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
        test_fraction=TEST_FRACTION,
        max_samples=d.max_samples,
        data_dir=d.data_dir,
    )


def _bounded(text: object, limit: int = 200) -> str:
    """``str(text)`` cut to ``limit`` characters (errors never echo unbounded input)."""
    s = str(text)
    return s if len(s) <= limit else s[:limit] + "..."


def _int(value: object, name: str) -> int:
    """An integer JSON value (not a bool, not a float), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_bounded(repr(value), 60)}")
    return value


def _float(value: object, name: str) -> float:
    """A real JSON number as float (not a bool), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {_bounded(repr(value), 60)}")
    return float(value)


@dataclass(frozen=True)
class Setup:
    """What every message tells a silo about the run (``keys.SETUP``, as JSON).

    Sent unchanged in every train, evaluate, query and unlearn message, so a SuperNode needs
    nothing but its silo id to join a run. The ClientApp parses it once per distinct JSON
    (``parse_setup``) and keys its caches (data, network) by the JSON text itself. Treat the
    nested configs as read-only: a parsed Setup is shared between messages.
    """

    client: ClientConfig
    data: DataConfig
    num_silos: int
    seed: int
    backdoor: dict[str, Any] | None = None
    """The server's BackdoorConfig as a dict (``medical_data.tasks.training_data`` reads it)."""
    emulate_speeds: list[float] | None = None
    """Each silo's speed when a one-machine deployment emulates heterogeneity, else None."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """A bundle task (its folder as the coordinator sees it: simulation, where silos share
    the machine; a deployed node uses its own ``bundle`` node config instead)."""

    def to_json(self) -> str:
        """The JSON the server sends (sorted keys, as ``keys.dumps`` writes it)."""
        return dumps(
            {
                "client": {**to_dict(self.client), "dp": self.client.dp.to_wire()},
                "data": to_dict(self.data),
                "backdoor": self.backdoor,
                "num_silos": self.num_silos,
                "seed": self.seed,
                "emulate_speeds": self.emulate_speeds,
                **({"task": to_dict(self.task)} if self.task.bundle else {}),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Setup:
        """The Setup ``text`` holds; ValueError (bounded message) for anything malformed."""
        try:
            raw = loads(text)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            unknown = set(raw) - {"client", "data", "backdoor", "num_silos", "seed"}
            unknown.discard("emulate_speeds")
            unknown.discard("task")
            if unknown:
                raise ValueError(f"unknown keys {_bounded(sorted(unknown), 100)}")
            client = dict(raw["client"])
            dp_raw = dict(client.pop("dp", {}))
            data = dict(raw["data"])
            for key, (name, fixed) in SETTLED.items():  # an earlier coordinator's message
                section = dp_raw if key.startswith("client.dp.") else data
                if name in section and section.pop(name) != fixed:
                    raise ValueError(f"{key} is fixed at {fixed} in this version of the silo")
            dp = DPConfig.from_wire(dp_raw)
            backdoor = raw.get("backdoor")
            if backdoor is not None and not isinstance(backdoor, dict):
                raise ValueError("backdoor must be an object or null")
            speeds = raw.get("emulate_speeds")
            if speeds is not None:
                if not isinstance(speeds, list):
                    raise ValueError("emulate_speeds must be a list or null")
                speeds = [_float(s, "emulate_speeds[i]") for s in speeds]
            return cls(
                client=ClientConfig(**client, dp=dp),
                data=DataConfig(**data),
                num_silos=_int(raw["num_silos"], "num_silos"),
                seed=_int(raw["seed"], "seed"),
                backdoor=backdoor,
                emulate_speeds=speeds,
                task=TaskConfig(**raw.get("task", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"bad setup: {_bounded(what)}") from e


@lru_cache(maxsize=8)
def parse_setup(text: str) -> Setup:
    """``Setup.from_json(text)``, parsed once per distinct text (the result is shared)."""
    return Setup.from_json(text)


STOP_ALPHA = 0.05
"""The significance level of an erasing silo's membership test (``unlearning.stop=membership``).
A constant, not a setting: the usual 5%, which the erasure benchmarks' verified runs used."""
STOP_PROBE = 128
"""Forget and held-out samples each reading of that test compares (at most). A constant, not a
setting: enough for the test's power at the sets' usual sizes, its cost measured at about 2.7
training steps of 32 samples a reading (docs/erasure.md)."""

ERASURE_METHODS = ("pga", "relabel")
ERASURE_STOPS = ("fixed", "membership")
SIGNATURE_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class SiloErasure:
    """How a silo erases its forget set (``keys.UNLEARN_JSON``, as JSON): the server's
    ``unlearning`` config with the erasure's own size (a sample-level erasure scales its PGA
    radius or relabel steps to its share of the silo's samples)."""

    method: Literal["pga", "relabel"] = "pga"
    """pga (projected gradient ascent, Halimi et al. 2022) or relabel."""
    steps: int = 5
    """Local erasure steps."""
    lr: float = 0.01
    """Local erasure learning rate."""
    stop: Literal["fixed", "membership"] = "fixed"
    """PGA: after ``steps`` (fixed) or when the membership test says so (at most ``steps``)."""
    stop_alpha: float = STOP_ALPHA
    """The membership test's significance level."""
    stop_every: int = 5
    """Erasure steps between two readings of the membership test."""
    stop_probe: int = STOP_PROBE
    """Forget and held-out samples each reading compares (at most)."""
    radius: float = 2.0
    """PGA: L2 radius of the ball around the reference model."""
    signature_rank: int = 4
    """Rank of the gradient signature the silo sends back."""
    signature_batches: int = 4
    """Forget-set batches whose loss gradients span that signature."""
    signature_dtype: Literal["float32", "float16"] = "float32"
    """Precision the signature crosses the wire in."""

    def __post_init__(self) -> None:
        """The same bounds as the server's ``unlearning`` config; ValueError naming the field."""
        checks = [
            (self.method in ERASURE_METHODS, "method must be pga or relabel"),
            (self.steps >= 0, "steps must be >= 0"),
            (self.lr > 0, "lr must be > 0"),
            (self.stop in ERASURE_STOPS, "stop must be fixed or membership"),
            (0 < self.stop_alpha < 1, "stop_alpha must be in (0, 1)"),
            (self.stop_every >= 1, "stop_every must be >= 1"),
            (self.stop_probe >= 1, "stop_probe must be >= 1"),
            (self.radius >= 0, "radius must be >= 0"),
            (self.signature_rank >= 1, "signature_rank must be >= 1"),
            (self.signature_batches >= 1, "signature_batches must be >= 1"),
            (
                self.signature_dtype in SIGNATURE_DTYPES,
                "signature_dtype must be float32 or float16",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"erasure {msg}")

    def work_units(self, steps: int, compared: int, readings: int, batch_size: int) -> float:
        """The work of an erasure in training steps (the virtual clock's unit): its ascent
        ``steps``, then one gradient per signature batch, and with ``stop=membership`` each of
        its ``readings``, a forward pass over the ``compared`` forget and held-out samples (a
        forward pass costs about a third of a training step on as many samples)."""
        return steps + self.signature_batches + readings * compared / (3.0 * batch_size)

    def work_bounds(self, batch_size: int) -> tuple[float, float]:
        """The least and the most work (``work_units``) this erasure can take: fixed steps
        know theirs; with ``stop=membership`` it ends after 0 to ``steps`` steps, read before
        the first, every ``stop_every`` and after the last, comparing at most ``stop_probe``
        samples of each set."""
        if self.stop != "membership" or self.method != "pga":
            units = self.work_units(self.steps, 0, 0, batch_size)
            return units, units
        most = self.work_units(
            self.steps, 2 * self.stop_probe, 2 + self.steps // self.stop_every, batch_size
        )
        return self.work_units(0, 0, 0, batch_size), most

    def to_json(self) -> str:
        """The JSON sent in the unlearn request (sorted keys)."""
        return dumps(to_dict(self))

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> SiloErasure:
        """A SiloErasure from a mapping of exactly its fields (types checked, ints as floats
        accepted); ValueError (bounded message) otherwise."""
        names = [f.name for f in fields(cls)]
        unknown = set(raw) - set(names)
        if unknown:
            raise ValueError(f"erasure: unknown keys {_bounded(sorted(unknown), 100)}")
        missing = [n for n in names if n not in raw]
        if missing:
            raise ValueError(f"erasure: missing keys {missing}")
        for text in ("method", "stop", "signature_dtype"):
            if not isinstance(raw[text], str):
                raise ValueError(f"erasure {text} must be a string")
        return cls(
            method=raw["method"],
            steps=_int(raw["steps"], "erasure steps"),
            lr=_float(raw["lr"], "erasure lr"),
            stop=raw["stop"],
            stop_alpha=_float(raw["stop_alpha"], "erasure stop_alpha"),
            stop_every=_int(raw["stop_every"], "erasure stop_every"),
            stop_probe=_int(raw["stop_probe"], "erasure stop_probe"),
            radius=_float(raw["radius"], "erasure radius"),
            signature_rank=_int(raw["signature_rank"], "erasure signature_rank"),
            signature_batches=_int(raw["signature_batches"], "erasure signature_batches"),
            signature_dtype=raw["signature_dtype"],
        )

    @classmethod
    def from_json(cls, text: str) -> SiloErasure:
        """The SiloErasure ``text`` holds; ValueError (bounded message) for anything else."""
        try:
            raw = loads(text)
        except ValueError as e:
            raise ValueError(f"erasure: not JSON: {_bounded(e)}") from e
        if not isinstance(raw, dict):
            raise ValueError("erasure: not a JSON object")
        return cls.from_mapping(raw)

    @classmethod
    def of(cls, overrides: Mapping[str, Any], *sources: object) -> SiloErasure:
        """This erasure's config: each field from ``overrides`` when there, else the same-named
        attribute of the first of ``sources`` that has one (the server's ``unlearning`` and
        ``lab.erasure`` sections), else the field's default (``STOP_ALPHA``, ``STOP_PROBE``)."""
        defaults = cls()
        raw = {}
        for f in fields(cls):
            have = [s for s in sources if hasattr(s, f.name)]
            fallback = getattr(have[0] if have else defaults, f.name)
            raw[f.name] = overrides.get(f.name, fallback)
        return cls.from_mapping(raw)
