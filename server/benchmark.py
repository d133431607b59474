"""What the server builds of the benchmark: its federation, the initial network, the
coordinator's own test set.

In simulation the server builds the benchmark's federation itself (``federation``: its pooled
test set to evaluate on, the silos' sample ids to check erasures against); a deployment's
coordinator holds no silo data and evaluates on its own held-out set (``server_test_set``), a
Decathlon datalist that ``write_server_test`` can write from the benchmark for a demo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedasync.errors import DataError
from medical_data.federation import Federation, SiloData
from medical_data.networks import build_network
from medical_data.registry import BenchmarkSpec
from protocol.config import build_silos
from server.config import FedAsyncConfig


def federation(cfg: FedAsyncConfig) -> Federation:
    """The benchmark's federation of ``silos.count`` silos for ``run.seed`` (reads the data)."""
    return build_silos(cfg.data, cfg.silos.count, cfg.run.seed)


def initial_model(cfg: FedAsyncConfig, spec: BenchmarkSpec | None = None) -> torch.nn.Module:
    """The benchmark's network (a bundle task's ``network_def``), initialised from
    ``run.seed``; sized by ``spec`` (default: the federation's, which reads the data:
    simulation only)."""
    if cfg.task.bundle is not None:
        from medical_data.monai_bundle import read_bundle

        bundle = read_bundle(cfg.task.bundle)
        torch.manual_seed(cfg.run.seed)
        return bundle.network(pretrained=True)
    spec = federation(cfg).spec if spec is None else spec
    torch.manual_seed(cfg.run.seed)
    return build_network(
        cfg.data.network or spec.network, spec.in_channels, spec.num_classes, spec.image_size
    )


def server_test_set(cfg: FedAsyncConfig, spec: BenchmarkSpec) -> SiloData:
    """The coordinator's own held-out set, ``data.server_test``: the ``test`` list of that
    Decathlon datalist, else its ``validation``, else its ``training`` list (each entry with
    its label). DataError naming the key when the file is missing or holds none."""
    from medical_data.datalist import has_list, load_datalist

    path = Path(str(cfg.data.server_test)).expanduser()
    if not path.is_file():
        raise DataError(f"data.server_test={path}: no such file (the coordinator's test set)")
    for key in ("test", "validation", "training"):
        if has_list(path, key):
            return load_datalist(path, spec, key, silo=-1)
    raise DataError(f"data.server_test={path}: no test, validation or training list")


def write_server_test(cfg: FedAsyncConfig, folder: Path) -> Path:
    """Write the benchmark's pooled held-out test set (what a simulation evaluates on) to
    ``folder`` as a Decathlon datalist, for a coordinator to own as ``data.server_test``:
    ``fedasync deploy local`` does, for its silos that split the benchmark. Reads the data:
    run where the benchmark is (the demo's one machine), never in the deployment ServerApp."""
    from medical_data.datalist import write_datalist

    fed = federation(cfg)
    return write_datalist(folder, {"test": fed.test}, fed.spec.task)


class BundleEvaluation:
    """A bundle task's global model on the bundle's validation list (``validate#dataset#data``
    through ``validate#preprocessing`` and ``validate#inferer``), in simulation: the server
    holds that list as it holds a benchmark's test set. Its items are cached in memory."""

    def __init__(self, bundle: Any) -> None:
        from medical_data import monai_bundle as mb

        self.bundle = bundle
        items = bundle.items("validate")
        self.samples = len(items)
        self.data = mb.dataset(items, bundle.transform("validate"), cache=len(items))

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """Loss and score of ``model``."""
        from medical_data import monai_bundle as mb

        return mb.evaluate(model, self.bundle, self.data)


def bundle_evaluation(bundle: Any) -> BundleEvaluation | None:
    """The server's evaluation of a bundle task, or None when the bundle has no
    ``validate#dataset#data`` (the silos then evaluate the model, federated)."""
    if not bundle.has("validate#dataset#data"):
        return None
    return BundleEvaluation(bundle)
