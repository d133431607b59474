"""Build a federation: silos (one per simulated hospital) and a held-out test set.

`build_federation` loads a benchmark (`medical_data.offline` or, with ``data_dir``,
`medical_data.online`), partitions it (natural / dirichlet / iid, see
`medical_data.partition`), holds out a stratified ``test_fraction`` of every silo, and
applies each silo's site shift to its own samples and to its held-out ones, so the pooled
test set represents every site. A source with a fixed test split (MedMNIST's official one,
breast-fna's) gives its test samples to seeded random sites instead; a source without natural
groups (breast-fna) names the split its ``natural`` partition stands for (iid). Same
arguments -> identical arrays; results are cached in-process and their arrays are read-only.

    fed = build_federation("brain-tissue", num_silos=10, seed=0)
    print(fed.table())
    x, y = fed.silos[0].to_tensors()  # (N, 1, 28, 28) float32, (N,) int64
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedasync.errors import ConfigError, DataError
from medical_data.partition import (
    apply_site_shift,
    dirichlet_partition,
    iid_partition,
    natural_partition,
)
from medical_data.raw import RawData
from medical_data.registry import PARTITIONS, BenchmarkSpec, get_spec


@dataclass
class SiloData:
    """The samples one silo (or the test set) holds."""

    silo_id: int
    """0..num_silos-1; -1 for the test set."""
    name: str
    """Human-readable, e.g. ``"slab z002-036"`` or ``"lung1 (CT lung)"``."""
    images: np.ndarray
    """float32, shape ``(N, C, H, W)``."""
    labels: np.ndarray
    """int64, ``(N,)`` (classification) or ``(N, H, W)`` (segmentation)."""
    sample_ids: np.ndarray
    """str, ``(N,)``: globally unique and stable, e.g. ``"brain-tissue/z071/x045y102"``."""
    patch: tuple[int, ...] | None = None
    """Volumes: the random crop of each sample a training step takes, and the window of the
    network's sliding-window inference on whole volumes (its benchmark's ``patch``)."""

    def __len__(self) -> int:
        return len(self.images)

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies as torch tensors: images float32 ``(N, C, H, W)``, labels int64."""
        return torch.tensor(self.images, dtype=torch.float32), torch.tensor(self.labels)


@dataclass
class Federation:
    """Silos plus a test set pooled from every site. Treat as read-only (it is cached)."""

    spec: BenchmarkSpec
    silos: list[SiloData]
    test: SiloData
    info: dict = field(default_factory=dict)
    """benchmark, partition, seed, site_params (one dict per silo), test_sites (``(N_test,)``
    silo whose site shift each test sample carries), source, ..."""

    def table(self) -> str:
        """Readable text table: one row per silo and one for the test set."""
        i = self.info
        head = (
            f"{self.spec.name} ({self.spec.task}, {self.spec.modality}): {len(self.silos)} "
            f"silos, partition={i['partition']}, seed={i['seed']}, site_shift={i['site_shift']}"
        )
        if self.spec.task == "classification":
            content = "class counts (" + "/".join(self.spec.class_names) + ")"
        else:
            content = "foreground px % (images with fg)"
        rows = [("silo", "name", "samples", content, "site shift")]
        for silo, params in zip([*self.silos, self.test], [*i["site_params"], None]):
            shift = "per source silo" if params is None else _fmt_params(params)
            rows.append((str(silo.silo_id), silo.name, str(len(silo)), self._content(silo), shift))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        lines = [head] + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(2, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def _content(self, silo: SiloData) -> str:
        if self.spec.task == "classification":
            counts = np.bincount(silo.labels, minlength=self.spec.num_classes)
            return "/".join(str(c) for c in counts)
        frac = float((silo.labels > 0).mean()) if len(silo) else 0.0
        has = int((silo.labels.reshape(len(silo), -1) > 0).any(1).sum())
        return f"{100 * frac:.2f}% ({has}/{len(silo)})"


def _fmt_params(p: dict[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in p.items())


def _load(benchmark: str, data_dir: str | None) -> tuple[BenchmarkSpec, RawData]:
    """The benchmark's spec and samples; DataError (naming the file and what to run) when a
    data file is missing or is not the pinned one."""
    spec = get_spec(benchmark)
    if not spec.offline and data_dir is None:
        raise ConfigError(
            f"benchmark {benchmark!r} reads a file you downloaded: set data.data_dir to it"
        )
    try:
        if spec.offline:
            from medical_data.offline import load_offline

            return spec, load_offline(benchmark, cache_dir=data_dir)
        from medical_data.online import load_online

        raw = load_online(benchmark, str(data_dir))
    except OSError as e:  # missing (FileNotFoundError) or not the pinned file (checksum)
        if isinstance(e, DataError):
            raise
        raise DataError(str(e).splitlines()[0] if str(e) else repr(e)) from e
    # the fields load_online derived from the data: int, int, (H, W) and a tuple of names
    in_channels, num_classes = raw.info["in_channels"], raw.info["num_classes"]
    image_size, class_names = raw.info["image_size"], raw.info["class_names"]
    if not (
        isinstance(in_channels, int)
        and isinstance(num_classes, int)
        and isinstance(image_size, tuple)
        and isinstance(class_names, tuple)
    ):
        raise TypeError(f"{benchmark}: the loader's class info has the wrong types")
    return dataclasses.replace(
        spec,
        in_channels=in_channels,
        num_classes=num_classes,
        image_size=image_size,
        class_names=class_names,
    ), raw


def _stratified_pick(strata: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` positions into ``strata`` spread evenly over strata (systematic sample)."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((rng.random(len(strata)), strata))
    pos = np.floor((np.arange(k) + rng.random()) * len(strata) / k).astype(np.int64)
    return np.sort(order[pos])


def _silo_name(raw: RawData, idx: np.ndarray, partition: str, k: int) -> str:
    if partition != "natural":
        return f"silo {k}"
    g = raw.groups[idx]
    names = raw.info.get("group_names")
    if names is not None and g.min() == g.max():
        if not isinstance(names, Sequence):  # (a list of names, one per group)
            raise TypeError(f"'{type(names).__name__}' object is not subscriptable")
        return str(names[int(g[0])])
    label = {"axial slice z": "slab z", "region": "regions "}.get(
        str(raw.info.get("group")), "groups "
    )
    return f"{label}{g.min():03d}-{g.max():03d}"


def _readonly(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    x.flags.writeable = False
    return x


@functools.lru_cache(maxsize=8)
def _build(
    benchmark: str,
    num_silos: int,
    seed: int,
    partition: str,
    dirichlet_alpha: float,
    site_shift: float,
    test_fraction: float,
    max_samples: int | None,
    data_dir: str | None,
) -> Federation:
    spec, raw = _load(benchmark, data_dir)
    rng = np.random.default_rng(seed)
    if max_samples is not None and max_samples < len(raw.images):
        key = raw.strata * 2 + (0 if raw.is_test is None else raw.is_test)
        raw = raw.subset(_stratified_pick(key, max_samples, rng))
    pool = np.arange(len(raw.images)) if raw.is_test is None else np.flatnonzero(~raw.is_test)
    if num_silos > len(pool) // 2:
        raise ConfigError(
            f"{benchmark} has {len(pool)} training samples: at most {len(pool) // 2} silos "
            f"(silos.count, --silos), got {num_silos}"
        )
    # a source without natural groups (breast-fna) names the split that stands in for one
    split = (
        str(raw.info.get("natural_partition", "natural")) if partition == "natural" else partition
    )
    if split == "natural":
        parts = natural_partition(raw.groups[pool], num_silos)
    elif split == "dirichlet":
        parts = dirichlet_partition(raw.strata[pool], num_silos, dirichlet_alpha, rng)
    else:
        parts = iid_partition(len(pool), num_silos, rng)
    parts = [pool[p] for p in parts]

    official = None if raw.is_test is None else np.flatnonzero(raw.is_test)
    official_site = None if official is None else rng.integers(num_silos, size=len(official))
    silos, tests, test_sites, site_params = [], [], [], []
    for k, idx in enumerate(parts):
        if official is None:
            n_test = min(int(round(test_fraction * len(idx))), len(idx) - 1)
            held = idx[_stratified_pick(raw.strata[idx], n_test, rng)]
        else:
            held = official[official_site == k]
        train = np.setdiff1d(idx, held)
        both = np.concatenate([train, held])
        shifted, params = apply_site_shift(raw.images[both], seed * 1_000_003 + k, site_shift)
        site_params.append(params)
        name = _silo_name(raw, idx, split, k)
        silos.append(
            SiloData(
                k,
                name,
                shifted[: len(train)],
                raw.labels[train],
                raw.sample_ids[train],
                patch=spec.patch,
            )
        )
        tests.append((shifted[len(train) :], held))
        test_sites.append(np.full(len(held), k, dtype=np.int64))

    test_idx = np.concatenate([h for _, h in tests])
    test = SiloData(
        silo_id=-1,
        name="test (all sites)",
        images=np.concatenate([x for x, _ in tests]),
        labels=raw.labels[test_idx],
        sample_ids=raw.sample_ids[test_idx],
        patch=spec.patch,
    )
    for s in [*silos, test]:
        s.images = _readonly(s.images.astype(np.float32, copy=False))
        s.labels = _readonly(s.labels.astype(np.int64, copy=False))
        s.sample_ids = _readonly(s.sample_ids)
    info = {
        "benchmark": benchmark,
        "partition": partition,
        "seed": seed,
        "num_silos": num_silos,
        "dirichlet_alpha": dirichlet_alpha,
        "site_shift": site_shift,
        "test_fraction": test_fraction,
        "site_params": site_params,
        "test_sites": _readonly(np.concatenate(test_sites)),
        **{k: v for k, v in raw.info.items() if isinstance(v, str)},
    }
    return Federation(spec=spec, silos=silos, test=test, info=info)


def build_federation(
    benchmark: str,
    num_silos: int,
    seed: int,
    *,
    partition: str = "natural",
    dirichlet_alpha: float = 0.5,
    site_shift: float = 1.0,
    test_fraction: float = 0.2,
    max_samples: int | None = None,
    data_dir: str | None = None,
) -> Federation:
    """Partition a benchmark into ``num_silos`` silos plus a pooled held-out test set.

    Args:
        benchmark: a name in `medical_data.registry.BENCHMARKS`.
        partition: ``"natural"`` (whole slabs/patients/regions), ``"dirichlet"`` (label skew,
            ``dirichlet_alpha``) or ``"iid"``.
        site_shift: strength of each silo's simulated scanner shift (0 = none).
        test_fraction: stratified fraction of each silo held out into the test set (ignored
            when the source has an official test split, e.g. MedMNIST).
        max_samples: stratified subsample of the benchmark before partitioning.
        data_dir: online benchmarks: the downloaded file/folder; offline: the cache dir.

    Returns a cached, read-only `Federation`; identical for identical arguments.
    """
    spec = get_spec(benchmark)
    if partition not in PARTITIONS:
        raise ConfigError(
            f"unknown partition {partition!r} (data.partition, --partition); choose one of "
            f"{PARTITIONS}"
        )
    if partition == "natural" and spec.natural_split.startswith("none"):
        raise ConfigError(
            f"{benchmark!r} has no natural split; use partition dirichlet or iid "
            "(data.partition, --partition)"
        )
    if seed < 0:
        raise ConfigError(f"seed (run.seed, --seed) must be >= 0, got {seed}")
    if not isinstance(num_silos, int | np.integer) or num_silos < 1:
        raise ConfigError(f"num_silos (silos.count, --silos) must be >= 1, got {num_silos!r}")
    if not 0.0 <= test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction must be in [0, 1), got {test_fraction}")
    if site_shift < 0:
        raise ConfigError(f"data.site_shift must be >= 0, got {site_shift}")
    if max_samples is not None and max_samples < 2 * num_silos:
        raise ConfigError(
            f"data.max_samples={max_samples} is too small for {num_silos} silos "
            f"(at least {2 * num_silos})"
        )
    return _build(
        benchmark,
        int(num_silos),
        int(seed),
        partition,
        float(dirichlet_alpha),
        float(site_shift),
        float(test_fraction),
        max_samples,
        None if data_dir is None else str(data_dir),
    )
