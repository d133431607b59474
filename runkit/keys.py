"""The run section's common keys: what every run command's ``run.*`` holds.

``fedasync simulate`` (server.config.RunConfig) extends `RunKeys`, and ``fedasync rl``,
``fedasync pipeline`` and ``fedasync market`` extend `TrainerKeys` (RunKeys and ``run.device``),
each with their own keys (length, evaluation cadence, workers), so ``run.seed``, ``run.name``,
``run.out_dir``, ``run.resume``, ``run.progress``, ``run.plots``, the metrics sinks'
``run.tensorboard``, ``run.mlflow`` and ``run.mlflow_uri`` (runkit.sinks) and ``run.device``
mean the same in every command, with the same defaults except the name. (A federated run has no
``run.device``: each silo trains on its own ``client.device``, the coordinator on the CPU.) A
section that extends them and has checks of its own calls ``super().__post_init__()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

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
SINK_KEYS = ("tensorboard", "mlflow", "mlflow_uri")
"""The ``run.*`` keys of the metrics sinks: where a run is watched, never what it computes (a
resumed run may change them)."""


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
    plots: bool = True
    """Write the run's PNGs at the end."""
    tensorboard: bool = True
    """Follow the event log live into TensorBoard event files in ``<run folder>/tensorboard``
    (when the tensorboard package is installed; runkit.sinks)."""
    mlflow: bool = False
    """Also follow it into MLflow (``pip install 'fedasync[mlflow]'``)."""
    mlflow_uri: str | None = None
    """MLflow's tracking URI (``http://host:5000``, ``sqlite:///path/mlflow.db``, ...); None: a
    local store in the run folder (``sqlite:///<run folder>/mlflow.db``)."""

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
                    "run.mlflow_uri is set but run.mlflow=false: add run.mlflow=true to log to "
                    "MLflow"
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
