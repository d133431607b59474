"""What a bundle task (``task.bundle``) asks of the rest of a run's config.

A MONAI bundle brings its own network, loss, optimiser and data, so some settings of the
built-in benchmarks cannot apply to it: its datalist splits by ``site`` or at random, not by
label skew; DP-SGD and the backdoor verification runs are the built-in benchmarks' (for now);
a simulated erasure request erases a whole silo (the coordinator holds no sample ids of a
bundle's datalist), and a bundle's silo erases by projected gradient ascent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from protocol.config import ClientConfig, DataConfig, TaskConfig
    from server.config_erasure import ErasureRequestConfig, UnlearningConfig
    from server.config_lab import LabConfig


class RunSections(Protocol):
    """The sections of a run's config these rules read (``server.config.FedAsyncConfig``)."""

    task: TaskConfig
    data: DataConfig
    lab: LabConfig
    client: ClientConfig
    unlearning: UnlearningConfig
    erasures: list[ErasureRequestConfig]


def task_checks(cfg: RunSections) -> list[tuple[bool, str]]:
    """(holds, what to say when it does not) for each rule above; none without a bundle."""
    if cfg.task.bundle is None:
        return []
    d = cfg.data
    rules = [
        (
            d.partition in ("natural", "iid"),
            f"data.partition={d.partition}: a bundle's datalist splits natural or iid",
        ),
        (not cfg.lab.backdoor.enabled, "lab.backdoor.enabled: not supported with task.bundle yet"),
        (not cfg.client.dp.enabled, "client.dp (DP-SGD): not supported with task.bundle yet"),
        (
            cfg.unlearning.method == "pga",
            "unlearning.method=relabel: a bundle task erases by projected gradient ascent (pga)",
        ),
    ]
    for i, e in enumerate(cfg.erasures):
        rules.append(
            (
                e.fraction >= 1.0,
                f"erasures[{i}].fraction={e.fraction}: with task.bundle a simulated request "
                "erases a whole silo (sample ids go through the erasure service)",
            )
        )
    return rules
