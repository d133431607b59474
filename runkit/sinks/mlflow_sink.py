"""The MLflow sink: a run's scalars as MLflow metrics, its config as parameters, its PNGs as
artifacts (``pip install 'fedasync[mlflow]'``: MLflow's client, mlflow-skinny).

Each follower makes one MLflow run (named ``run.name``, in the experiment ``fedasync <kind>``)
for the run folder, with one nested run per stream beneath it (the sync baseline, a market
seed). The tracking URI is ``run.mlflow_uri``, or by default a local store in the run folder:
``sqlite:///<run folder>/mlflow.db``, artifacts in ``<run folder>/mlartifacts`` (MLflow 3
refuses its older file store, ``./mlruns``, unless told to allow it; its SQLite store needs
SQLAlchemy and Alembic, which Flower already brings). View it with ``mlflow ui
--backend-store-uri sqlite:///<run folder>/mlflow.db`` (the full ``mlflow`` package).

A stream whose log began again (a resumed run cut it back) gets a new MLflow run, the old one
deleted (MLflow keeps deleted runs until they are purged), since every metric is sent again.
An unreachable server fails within seconds, not MLflow's default minutes of retries.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from runkit.folder import flat_keys

BATCH = 1000
"""Metrics per ``log_batch`` call (MLflow's limit)."""
PARAMS = 100
"""Parameters per ``log_batch`` call (MLflow's limit)."""
PARAM_CHARS = 500
"""Characters of a parameter's value kept (MLflow refuses longer ones on some stores)."""

QUICK_FAILURE = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
"""MLflow's HTTP retries, unless the environment sets them: an unreachable tracking server is
a sink failure in seconds (logged once), not minutes of retries at the run's end."""


def available() -> str | None:
    """None when MLflow's client is installed; else why not."""
    try:
        import mlflow.tracking  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def local_uri(run_dir: Path) -> str:
    """The default tracking URI: a SQLite store in the run folder."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


class MlflowSink:
    """MLflow runs of one run folder (see the module's docstring)."""

    name = "MLflow"

    def __init__(
        self,
        uri: str | None,
        run_dir: Path,
        experiment: str,
        run_name: str,
        params: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.local = uri is None
        self.uri = local_uri(run_dir) if uri is None else uri
        self.experiment, self.run_name = experiment, run_name
        self.params = params or {}
        self.client: Any = None
        self._experiment_id = ""
        self._runs: dict[str, str] = {}

    def open(self) -> None:
        """Connect, find or make the experiment, start the run folder's MLflow run."""
        for k, v in QUICK_FAILURE.items():
            os.environ.setdefault(k, v)
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their INFO lines (a new store's tables): not ours
            logging.getLogger(name).setLevel(logging.WARNING)  # (mlflow sets its own on import)

        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            self._experiment_id = found.experiment_id
        else:
            where = (self.run_dir / "mlartifacts").resolve().as_uri() if self.local else None
            self._experiment_id = self.client.create_experiment(
                self.experiment, artifact_location=where
            )
        self._run("")
        self._log_params()

    def _run(self, stream: str) -> str:
        """The MLflow run of ``stream`` ("": the run folder's own), made when first asked."""
        rid = self._runs.get(stream)
        if rid is None:
            tags = {"fedasync.run_dir": str(self.run_dir.resolve())[:500]}
            if stream:
                tags["mlflow.parentRunId"] = self._run("")
                tags["fedasync.stream"] = stream
            name = f"{self.run_name}/{stream}" if stream else self.run_name
            rid = self.client.create_run(self._experiment_id, run_name=name, tags=tags).info.run_id
            self._runs[stream] = rid
        return rid

    def _log_params(self) -> None:
        from mlflow.entities import Param

        flat = flat_keys(self.params)
        params = [Param(k[:250], str(v)[:PARAM_CHARS]) for k, v in sorted(flat.items())]
        for i in range(0, len(params), PARAMS):
            self.client.log_batch(self._run(""), params=params[i : i + PARAMS])

    def reset(self, stream: str) -> None:
        """The stream's log began again: its MLflow run is deleted and made anew."""
        rid = self._runs.pop(stream, None)
        if rid is not None:
            self.client.delete_run(rid)
        self._run(stream)
        if not stream:
            self._log_params()

    def scalars(self, stream: str, rows: list[tuple[str, float, int, float]]) -> None:
        """Log ``(tag, value, step, wall time)`` rows as the stream's metrics."""
        from mlflow.entities import Metric

        rid = self._run(stream)
        metrics = [Metric(tag, value, int(wall * 1000), step) for tag, value, step, wall in rows]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(rid, metrics=metrics[i : i + BATCH])

    def images(self, pngs: list[Path], step: int) -> None:
        """The run's PNGs as artifacts of the run folder's MLflow run, under ``plots/``."""
        for p in pngs:
            self.client.log_artifact(self._run(""), str(p), "plots")

    def close(self, ok: bool) -> None:
        """End every MLflow run: FINISHED, or KILLED when the run did not finish."""
        for rid in self._runs.values():
            self.client.set_terminated(rid, status="FINISHED" if ok else "KILLED")
        self._runs.clear()
