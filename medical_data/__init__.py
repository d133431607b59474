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


class _TransformersHiddenFromMonai(importlib.abc.MetaPathFinder):
    """While MONAI itself loads, Hugging Face ``transformers`` looks absent to it.

    ``import monai`` imports every network it has, Transchex among them, which imports
    transformers' BERT: over 4 s of every process's start-up with transformers 5 installed
    (the ``hf`` extra, for the RL trainer's policy). fedasync never uses Transchex, and MONAI
    takes a missing transformers as optional (Transchex alone then refuses to build). Only the
    import of transformers *during MONAI's own* is affected: a process that imported
    transformers first, or imports it after, gets it as usual."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        """Refuse ``transformers*`` while ``monai`` is being initialised; else no opinion."""
        if name == "transformers" or name.startswith("transformers."):
            monai = sys.modules.get("monai")
            if getattr(getattr(monai, "__spec__", None), "_initializing", False):
                raise ModuleNotFoundError(f"{name}: hidden while MONAI loads (not used)")
        return None


if not any(isinstance(f, _TransformersHiddenFromMonai) for f in sys.meta_path):
    sys.meta_path.insert(0, _TransformersHiddenFromMonai())

from medical_data.registry import BENCHMARKS, BenchmarkSpec, get_spec  # noqa: E402

DEFAULT_BENCHMARK = "brain-tissue"

__all__ = ["BENCHMARKS", "DEFAULT_BENCHMARK", "BenchmarkSpec", "get_spec"]
