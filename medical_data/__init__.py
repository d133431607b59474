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

from medical_data.registry import BENCHMARKS, BenchmarkSpec, get_spec

DEFAULT_BENCHMARK = "brain-tissue"

__all__ = ["BENCHMARKS", "DEFAULT_BENCHMARK", "BenchmarkSpec", "get_spec"]
