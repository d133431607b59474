"""The run section's common keys: what every run command's ``run.*`` holds.

``fedasync simulate`` (server.config.RunConfig) extends `RunKeys`, and ``fedasync rl``,
``fedasync pipeline`` and ``fedasync market`` extend `TrainerKeys` (RunKeys and ``run.device``),
each with their own keys (length, evaluation cadence, workers), so ``run.seed``, ``run.name``,
``run.out_dir``, ``run.resume``, ``run.progress``, ``run.trackers`` (the PNGs and the metrics
sinks, runkit.sinks), ``run.mlflow_uri`` and ``run.device``
mean the same in every command, with the same defaults except the name. (A federated run has no
``run.device``: each silo trains on its own ``client.device``, the coordinator on the CPU.) A
section that extends them and has checks of its own calls ``super().__post_init__()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fedasync.errors import ConfigError
from runkit.configload import choices

Device = Literal["auto", "cpu", "cuda"]
"""``run.device``: auto (CUDA when present, fedasync.devices.pick_device), cpu or cuda."""

DEVICES: tuple[str, ...] = choices(Device)

if not TYPE_CHECKING:  # what omegaconf sees: a str carrying its Literal (runkit.configload)
    Device = Annotated[str, Device]

NAME_LIMIT = 200
"""Characters a run name may have (it names a folder)."""
URI_LIMIT = 500
"""Characters ``run.mlflow_uri`` may have."""
TRACKERS = ("plots", "tensorboard", "mlflow")
"""What ``run.trackers`` may name: the run's PNGs at the end, TensorBoard event files followed
live, MLflow followed live."""
DEFAULT_TRACKERS = ("plots", "tensorboard")
"""``run.trackers`` unless given (what ``run.plots=true``, ``run.tensorboard=true`` and
``run.mlflow=false``, the three keys it replaced, were by default)."""
OLD_TRACKER_KEYS = tuple(f"run.{t}" for t in TRACKERS)
"""The three booleans ``run.trackers`` replaced, still read (`tracker_layers`)."""
SINK_KEYS = ("trackers", "mlflow_uri", *TRACKERS)
"""The ``run.*`` keys of the PNGs and the metrics sinks: where a run is watched, never what it
computes (a resumed run may change them; an earlier run's checkpoint holds the three booleans
``run.trackers`` replaced)."""


def tracker_layers(layers: list[Any]) -> list[Any]:
    """``layers`` (plain nested dicts or omegaconf containers), with ``run.plots``,
    ``run.tensorboard`` and ``run.mlflow`` (booleans, each layer overriding the ones before, as
    they were) read as ``run.trackers``: removed from their layers, and one last layer that
    holds ``run.trackers`` as the layers say in turn (a layer's ``run.trackers`` replaces the
    list so far; each boolean after it adds or removes its tracker). Merged over the layers
    rather than layer by layer, because one layer may turn a tracker on and a later one another
    off, or give today's list after an earlier run's booleans. ``layers`` are left as they
    were; without any of the three they are returned as they were."""
    import copy

    from omegaconf import DictConfig, OmegaConf

    def run_of(layer: Any) -> Any:
        tree = (
            OmegaConf.to_container(layer, resolve=False) if isinstance(layer, DictConfig) else layer
        )
        run = tree.get("run") if isinstance(tree, dict) else None
        return tree, run if isinstance(run, dict) else {}

    if not any(t in run_of(layer)[1] for layer in layers for t in TRACKERS):
        return list(layers)
    chosen: list[Any] = list(DEFAULT_TRACKERS)
    out: list[Any] = []
    for layer in layers:
        tree, run = run_of(layer)
        if "trackers" in run:
            if not isinstance(run["trackers"], list):
                raise ConfigError(
                    f"run.trackers={str(run['trackers'])[:60]!r}: a list of {TRACKERS}"
                )
            chosen = list(run["trackers"])
        if any(t in run for t in TRACKERS):
            tree = copy.deepcopy(tree) if tree is layer else tree
            for t in TRACKERS:
                if t not in run:
                    continue
                on = tree["run"].pop(t)
                if not isinstance(on, bool):
                    raise ConfigError(
                        f"run.{t}={str(on)[:40]!r}: true or false (it is run.trackers now)"
                    )
                if on and t not in chosen:
                    chosen.append(t)
                if not on and t in chosen:
                    chosen.remove(t)
            tree["run"].pop("trackers", None)
            layer = tree
        out.append(layer)
    return [*out, {"run": {"trackers": chosen}}]


@dataclass
class RunKeys:
    """``run.*`` keys every run command has."""

    seed: int = 0
    """The run's seed: every random draw of the run derives from it (fedasync.seeds)."""
    name: str = "run"
    """Run folder name under ``run.out_dir``."""
    out_dir: str = "runs"
    """Where run folders go (metrics.jsonl, summary.json, checkpoints, PNGs)."""
    resume: bool = False
    """Continue from the run folder's checkpoint (same config, except ``run.*``)."""
    progress: bool = True
    """A progress bar on stderr while it runs."""
    trackers: list[str] = field(default_factory=lambda: list(DEFAULT_TRACKERS))
    """How the run is watched, any of: ``plots`` (write the run's PNGs at the end),
    ``tensorboard`` (follow the event log live into TensorBoard event files in
    ``<run folder>/tensorboard``, when the tensorboard package is installed; runkit.sinks),
    ``mlflow`` (follow it into MLflow, ``pip install 'fedasync[mlflow]'``); ``[]``: none. One
    list for what were three booleans (``run.plots``, ``run.tensorboard``, ``run.mlflow``,
    still read: `tracker_layers`)."""
    mlflow_uri: str | None = None
    """MLflow's tracking URI (``http://host:5000``, ``sqlite:///path/mlflow.db``, ...); None: a
    local store in the run folder (``sqlite:///<run folder>/mlflow.db``)."""

    @property
    def plots(self) -> bool:
        """``plots`` is in ``run.trackers``."""
        return "plots" in self.trackers

    @property
    def tensorboard(self) -> bool:
        """``tensorboard`` is in ``run.trackers``."""
        return "tensorboard" in self.trackers

    @property
    def mlflow(self) -> bool:
        """``mlflow`` is in ``run.trackers``."""
        return "mlflow" in self.trackers

    def __post_init__(self) -> None:
        """Checked when built: a name that can be a folder, a tracking URI for MLflow only."""
        if (
            not self.name
            or len(self.name) > NAME_LIMIT
            or "/" in self.name
            or self.name
            in {
                ".",
                "..",
            }
        ):
            raise ConfigError(
                f"run.name={self.name[:60]!r}: a folder name (1-{NAME_LIMIT} characters, no '/')"
            )
        for t in self.trackers:
            if t not in TRACKERS:
                raise ConfigError(f"run.trackers: {str(t)[:40]!r} is not one of {TRACKERS}")
        if len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(f"run.trackers={list(self.trackers)}: each at most once")
        uri = self.mlflow_uri
        if uri is not None:
            if (
                not uri
                or len(uri) > URI_LIMIT
                or any(c.isspace() or not c.isprintable() for c in uri)
            ):
                raise ConfigError(
                    f"run.mlflow_uri={uri[:60]!r}: a tracking URI (1-{URI_LIMIT} characters, "
                    "no spaces), e.g. http://host:5000 or sqlite:///path/mlflow.db"
                )
            if not self.mlflow:
                raise ConfigError(
                    "run.mlflow_uri is set but run.trackers has no mlflow: add it to log to "
                    "MLflow (e.g. run.trackers=[plots,tensorboard,mlflow])"
                )


@dataclass
class TrainerKeys(RunKeys):
    """``run.*`` keys every trainer has: the common ones and the device it computes on."""

    device: Device = "auto"
    """auto (CUDA when present), cpu or cuda."""

    def __post_init__(self) -> None:
        """Checked when built: the common keys, a device there is a name for."""
        super().__post_init__()
        if self.device not in DEVICES:
            raise ConfigError(f"run.device={str(self.device)[:40]!r}: use one of {DEVICES}")
