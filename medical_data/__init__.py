"""Real medical imaging benchmarks for fedasync, split into federated silos.

Offline benchmarks (real images, real labels, no data hub): ``brain-tissue`` (default,
MNI152 T1 patches from the nilearn wheel), ``radiomics-lesion`` / ``radiomics-slice``
(PyRadiomics test scans), ``nuclei`` (DSB2018 from the stardist wheel); the last two are
fetched once at set-up with ``python -m medical_data.fetch``. ``breast-fna`` (WDBC, from the
scikit-learn wheel) is tabular: 30 features measured on fine-needle-aspirate images, each
sample a ``(1, 1, 30)`` array of z-scores. Online loaders read MedMNIST,
MedNIST and Decathlon files a user downloaded. No Flower or gRPC imports here.

    from medical_data.federation import build_federation
    from medical_data.networks import network_for
    fed = build_federation("brain-tissue", num_silos=10, seed=0)
    model = network_for(fed.spec)
"""

import importlib.abc
import sys

HIDDEN_FROM_MONAI = ("transformers", "mlflow", "matplotlib", "pandas", "scipy.signal", "sklearn")
"""Packages MONAI imports as it loads, only for parts of it fedasync never uses."""


class _HiddenFromMonai(importlib.abc.MetaPathFinder):
    """While MONAI itself loads, ``HIDDEN_FROM_MONAI`` look absent to it.

    ``import monai`` imports every module it has, and those import what they might need:
    Transchex Hugging Face transformers' BERT (over 4 s with transformers 5, installed by the
    ``hf`` extra for the RL trainer's policy), ``monai.handlers`` mlflow (about 1 s, the
    ``mlflow`` extra), its Jupyter and profiling helpers matplotlib's pyplot and pandas, the
    ultrasound confidence map scipy.signal, an embedding metric scikit-learn: together about
    half of a process's start-up, paid by every ClientApp, ServerApp and CLI process. MONAI
    takes each as optional (only those parts then refuse to work), and fedasync uses none of
    them. Only the import *during MONAI's own* is affected: a process that imported one
    first, or imports it after (plots, the MLflow sink, the RL policy), gets it as usual. A
    program that wants those parts of MONAI imports ``monai`` before ``medical_data``."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        """Refuse a hidden package while ``monai`` is being initialised; else no opinion."""
        if any(name == h or name.startswith(h + ".") for h in HIDDEN_FROM_MONAI):
            monai = sys.modules.get("monai")
            if getattr(getattr(monai, "__spec__", None), "_initializing", False):
                raise ModuleNotFoundError(f"{name}: hidden while MONAI loads (not used)")
        return None


if not any(type(f).__name__ == "_HiddenFromMonai" for f in sys.meta_path):
    sys.meta_path.insert(0, _HiddenFromMonai())

from medical_data.registry import BENCHMARKS, BenchmarkSpec, get_spec  # noqa: E402

DEFAULT_BENCHMARK = "brain-tissue"

__all__ = ["BENCHMARKS", "DEFAULT_BENCHMARK", "BenchmarkSpec", "get_spec"]
