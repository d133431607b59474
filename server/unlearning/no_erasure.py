"""The erasure part of a run that cannot erase (``NoErasure``, with ``NoCalibration``), so that
the server loop calls its erasure part without asking whether there is one."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NoReturn

from fedasync import Params
from server.unlearning.calibration import NoCalibration


class NoErasure:
    """The erasure part of a run that cannot erase (no ``erasures``, no service): every silo
    may train, nothing is ever due, nothing is recorded or checkpointed, and updates pass
    uncalibrated. Erasure jobs (``train.unlearn``, FedEraser's calibration) are never sent
    in such a run, so their replies never reach it."""

    enabled = False
    """Whether live erasure requests may come (the loop then looks for them every second)."""
    calibration = NoCalibration()
    excluded: Mapping[int, list[str]] = MappingProxyType({})

    def may_train(self, silo: int) -> bool:
        """Always."""
        return True

    def poll(self) -> None:
        """Nothing to submit or start."""

    def next_time(self) -> float:
        """Never."""
        return float("inf")

    def record(
        self,
        silo: int | None,
        contributions: dict[str, Params],
        version: int,
        norm: float | None = None,
    ) -> None:
        """Nothing is kept."""

    def fold_sink(self, silo: int, version: int) -> None:
        """Nothing is kept of an update."""
        return None

    def on_version(self, score: float | None = None) -> None:
        """Nothing to verify."""

    def reconcile(self) -> None:
        """Nothing to resume."""

    def state_dict(self) -> None:
        """Nothing to checkpoint (the loop's ``parts["erasure"]`` is None)."""
        return None

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """An erasure state from an earlier run that could erase: ignored, as before."""

    def _no_erasure_job(self, *args: Any) -> NoReturn:
        raise RuntimeError("an erasure job's reply in a run that cannot erase")

    # (the replies of erasure jobs, which such a run never sends)
    take_unlearn = take_calibration = requeue = failed = event = _no_erasure_job
