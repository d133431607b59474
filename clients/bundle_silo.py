"""Which items of a bundle task a node trains on.

In simulation every silo shares the machine and the run's bundle (``task.bundle``): silo ``i``
takes its share of the bundle's datalist (``clients.task.split_items``: ``data.partition``,
``run.seed``) and of its validation list. In deployment a hospital's node has its own copy of
the bundle (the ``bundle`` node config, ``fedasync node --bundle``) and its own datalist (the
``datalist`` node config): what the coordinator names is not read there. Both are cached per
process and read again when the bundle's configs or the datalist change.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from clients.task import BundleTask
from protocol.config import parse_setup

BUNDLE = "bundle"
"""Node-config key of a hospital's own MONAI bundle folder (``fedasync node --bundle``)."""


def _bundle_stamp(path: str) -> int:
    try:
        return max(f.stat().st_mtime_ns for f in (Path(path) / "configs").iterdir())
    except (OSError, ValueError):
        return 0


@lru_cache(maxsize=4)
def _bundle_silo_task_at(path: str, setup_json: str, silo: int, stamp: int) -> BundleTask:
    from clients.task import split_items
    from medical_data.monai_bundle import read_bundle

    setup = parse_setup(setup_json)
    bundle = read_bundle(path)
    n, part, seed = setup.num_silos, setup.data.partition, setup.seed
    if not 0 <= silo < n:
        raise ValueError(f"silo {silo} is not a silo of this run (0..{n - 1})")
    items = split_items(bundle.items("train"), n, part, seed)[silo]
    held: list[dict[str, Any]] = []
    if bundle.has("validate#dataset#data"):
        val = bundle.items("validate")
        if len(val) >= n:
            held = split_items(val, n, part, seed)[silo]
    torch.manual_seed(seed)  # (the template's weights are replaced by every message's)
    return BundleTask(bundle, items, held, cache=setup.task.cache, workers=setup.task.workers)


def bundle_silo_task(path: str, setup_json: str, silo: int) -> BundleTask:
    """Silo ``silo``'s share of the run's bundle's datalist (simulation)."""
    return _bundle_silo_task_at(path, setup_json, silo, _bundle_stamp(path))


@lru_cache(maxsize=2)
def _own_bundle_task_at(
    path: str, datalist: str, cache: int, workers: int, stamp: tuple[int, int]
) -> BundleTask:
    from monai.data import load_decathlon_datalist

    from medical_data.monai_bundle import read_bundle

    bundle = read_bundle(path)
    try:
        items = load_decathlon_datalist(datalist, True, "training")
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"datalist {datalist[:200]}: {str(e)[:200]}") from e
    try:
        held = load_decathlon_datalist(datalist, True, "validation")
    except (ValueError, KeyError):
        held = []
    return BundleTask(bundle, items, held, cache=cache, workers=workers)


def own_bundle_task(path: str, datalist: str, cache: int, workers: int) -> BundleTask:
    """A hospital's own bundle on its own datalist (deployment), read again when either
    changes."""
    try:
        stamp = Path(datalist).expanduser().stat().st_mtime_ns
    except OSError:
        stamp = 0
    return _own_bundle_task_at(path, datalist, cache, workers, (_bundle_stamp(path), stamp))
