"""The run's models as MONAI bundles: what a hospital receives.

MONAI Label, MONAI Deploy and monai-nvflare load a model as a MONAI bundle, so a run writes
its final global model and its best evaluated one as bundles, ``<run>/bundle/final/`` and
``<run>/bundle/best/`` (``write_run_bundles``, at the end of server/app.py's run), and
``fedasync export RUN_DIR --version N`` writes one of any version the run kept
(``export``; server/models.py keeps them). A bundle is

- ``configs/metadata.json``: MONAI's metadata (versions of MONAI, torch and numpy, task,
  description, ``network_data_format``), and fedasync's own: the network's definition, the
  training data (each silo's sample and class counts as the silos reported them, never a
  sample id), the run's config hash, the model's version and SHA-256, its evaluation, and
  the erasure requests the model honours (those applied at or before its version) and those
  applied after it;
- ``configs/inference.json``: ``network_def`` with MONAI and torch targets only
  (medical_data/bundle_config.py), ``network``, ``preprocessing``, ``inferer``,
  ``postprocessing``, so that ``monai.bundle.ConfigParser`` alone loads it;
- ``configs/train.json`` (an image benchmark's run): the model-zoo style training config
  (``medical_data.bundle_config.train_config``: the network, the run's loss, SGD with its
  silos' settings, the transforms, a datalist at ``<bundle>/data/dataset.json``), so the
  bundle trains again, ``fedasync simulate task.bundle=DIR``, from its weights; a bundle
  task's run copies that bundle's own configs instead;
- ``models/model.pt``: the state_dict.

What a bundle says of the run that is known only while it runs (the silos' counts, the
benchmark's shapes as its data gave them, the config) is written when it starts,
``<run>/models/run.json`` (``describe_run``), so a version can be exported after the run.
A bundle is written whole in a folder beside its place and then renamed into it: a reader
never sees half of one. The config hash is the SHA-256 of the run's config as canonical JSON
(every key, sorted, no spaces: ``config_sha256``); a resumed run's is its own config's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import uuid
from importlib import metadata as packages
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedasync.errors import CheckpointError
from fedasync.fetch import sha256_file
from medical_data.bundle_config import (
    inferer,
    network_data_format,
    network_entries,
    plain,
    postprocessing,
    preprocessing,
    train_config,
)
from medical_data.registry import BenchmarkSpec
from protocol.config import ClientConfig
from runkit.configload import bounded
from runkit.folder import write_json
from server.config import FedAsyncConfig
from server.models import MODELS_DIR
from server.unlearning.attest import model_sha256

if TYPE_CHECKING:
    from fedasync import Params
    from server.erasure.store import ErasureStore

log = logging.getLogger("fedasync.server")

BUNDLE_DIR = "bundle"
"""The bundles' folder in the run folder: ``final/``, ``best/``, ``version-<N>/``."""
RUN_INFO = "run.json"
"""What a bundle says of the run, in the snapshots' folder (``describe_run``)."""
RUN_INFO_FORMAT = 1
META_SCHEMA = (
    "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/"
    "meta_schema_20240725.json"
)


def config_sha256(cfg: FedAsyncConfig) -> str:
    """SHA-256 of ``cfg`` as canonical JSON: every key, sorted, compact separators."""
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


TRAINING = ("lr", "momentum", "weight_decay", "batch_size")
"""The silos' training settings a run's bundles train again with (``train.json``)."""
TRAINING_DEFAULTS = {k: getattr(ClientConfig(), k) for k in TRAINING}
"""What a run description written before they were recorded is read with."""


def describe_run(
    cfg: FedAsyncConfig,
    spec: BenchmarkSpec,
    reports: dict[int, Any],
    *,
    evaluation_on: str,
    test_samples: int | None,
    bundle: Any = None,
) -> dict[str, Any]:
    """What every bundle of this run says of it: the benchmark (its spec as the data sized
    it), the network, the silos' sample and class counts (``reports``: the roster's replies),
    how the model is evaluated, and the config's hash; for a bundle task (``bundle``, a
    ``medical_data.monai_bundle.MonaiBundle``) its folder and ``network_def``."""
    own = {} if bundle is None else {"bundle_root": str(bundle.root), **bundle.network_def()}
    return {
        **own,
        "format": RUN_INFO_FORMAT,
        "run": cfg.run.name,
        "mode": cfg.server.mode,
        "seed": cfg.run.seed,
        "config_sha256": config_sha256(cfg),
        "spec": plain(dataclasses.asdict(spec)),
        "network": cfg.data.network or spec.network,
        "partition": cfg.data.partition,
        "silos": {
            str(s): {"num_samples": int(r.num_samples), "class_counts": list(r.class_counts)}
            for s, r in sorted(reports.items())
        },
        "excluded_silos": sorted(cfg.lab.exclude),
        "training": {k: getattr(cfg.client, k) for k in TRAINING},
        "evaluation": {
            "on": evaluation_on,
            "samples": test_samples,
            "metric": "accuracy" if spec.task == "classification" else "dice",
        },
    }


def write_run_info(run_dir: Path, info: dict[str, Any]) -> None:
    """Write ``info`` (``describe_run``) to ``<run>/models/run.json``, atomically."""
    write_json(run_dir / MODELS_DIR / RUN_INFO, info)


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """``<run>/models/run.json``; CheckpointError when it is missing or not one."""
    path = run_dir / MODELS_DIR / RUN_INFO
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{bounded(path, 200)} cannot be read ({type(e).__name__}): not the folder of a fedasync run "
            "that keeps its models (runs write it when they start)"
        ) from e
    if not isinstance(info, dict) or info.get("format") != RUN_INFO_FORMAT:
        raise CheckpointError(
            f"{bounded(path, 200)} is not a run description of this fedasync's format"
        )
    return info


def spec_of(info: dict[str, Any]) -> BenchmarkSpec:
    """The benchmark spec a run description holds."""
    s = dict(info["spec"])
    s["image_size"] = tuple(s["image_size"])
    s["class_names"] = tuple(s["class_names"])
    if s.get("patch") is not None:
        s["patch"] = tuple(s["patch"])
    return BenchmarkSpec(**s)


def erasures_at(store: ErasureStore | None, version: int) -> dict[str, list[dict[str, Any]]]:
    """The erasure requests a model of ``version`` honours (applied at or before it:
    ``honoured``) and those applied after it (``applied_later``; an older model does not
    honour them), from the erasure store; never a sample id."""
    out: dict[str, list[dict[str, Any]]] = {"honoured": [], "applied_later": []}
    if store is None:
        return out
    for r in store.list():
        if r.boundary_version < 0:
            continue  # not (yet) applied: not in any model
        row = {
            "request": r.id,
            "silo": r.silo,
            "scope": "whole silo" if r.whole_silo else "samples",
            "samples": len(r.sample_ids),
            "boundary_version": r.boundary_version,
            "state": r.state.value,
        }
        out["honoured" if r.boundary_version <= version else "applied_later"].append(row)
    return out


def write_bundle(
    folder: Path,
    params: dict[str, torch.Tensor],
    version: int,
    info: dict[str, Any],
    *,
    selected: str,
    evaluation: dict[str, Any] | None,
    erasures: dict[str, list[dict[str, Any]]],
    network: dict[str, Any] | None = None,
) -> Path:
    """Write the bundle of ``params`` (global model version ``version``) to ``folder``,
    replacing what is there whole; ``selected``: why this version (final, best, export);
    ``evaluation``: the run's evaluation of it (None: not evaluated); ``network``: the run's
    `network_def` entries when the caller has them (`network_of`)."""
    spec = spec_of(info)
    if network is None:
        network = network_of(info)
    weights = {k: v.detach().to("cpu").clone().contiguous() for k, v in params.items()}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        (tmp / "models").mkdir(parents=True)
        torch.save(weights, tmp / "models" / "model.pt")
        model_sha = sha256_file(tmp / "models" / "model.pt")
        meta = _metadata(
            info, spec, network, weights, version, model_sha, selected, evaluation, erasures
        )
        if info.get("bundle_root"):  # a bundle task: its own configs, trained weights
            meta = _bundle_metadata(Path(info["bundle_root"]), tmp / "configs", meta)
        else:
            write_json(tmp / "configs" / "inference.json", _inference(spec, network))
            train = train_config(spec, network, **{**TRAINING_DEFAULTS, **info.get("training", {})})
            if train is not None:  # trains again on <bundle>/data/dataset.json
                write_json(tmp / "configs" / "train.json", train)
        write_json(tmp / "configs" / "metadata.json", meta)
        _replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _replace_dir(new: Path, dest: Path) -> None:
    """``new`` renamed to ``dest``, what was there removed after."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        dest.rename(old)
    new.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _versions() -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return packages.version(name)
        except packages.PackageNotFoundError:
            return "not installed"

    return {n: version(n) for n in ("monai", "torch", "numpy", "nibabel", "fedasync")}


def _metadata(
    info: dict[str, Any],
    spec: BenchmarkSpec,
    network: dict[str, Any],
    weights: dict[str, torch.Tensor],
    version: int,
    model_sha: str,
    selected: str,
    evaluation: dict[str, Any] | None,
    erasures: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    v = _versions()
    silos = info["silos"]
    semver = f"{version}.0.0"
    scored = (
        f"; {evaluation['metric']} {evaluation['score']:.4f} on the {evaluation['on']}"
        if evaluation is not None and evaluation.get("score") is not None
        else ""
    )
    return {
        "schema": META_SCHEMA,
        "version": semver,
        "changelog": {semver: f"global model version {version} of run {info['run']} ({selected})"},
        "monai_version": v["monai"],
        "pytorch_version": v["torch"],
        "numpy_version": v["numpy"],
        "required_packages_version": {},
        "optional_packages_version": {"nibabel": v["nibabel"]},
        "name": f"{spec.name} {info['network']} (fedasync {info['run']}, version {version})",
        "task": f"{spec.task} of {spec.modality}: {', '.join(spec.class_names)}",
        "description": (
            f"The global model at version {version} ({selected}) of a federated run "
            f"(fedasync {v['fedasync']}, server.mode={info['mode']}) of {info['network']} on "
            f"{spec.name}, trained by {len(silos)} silos that kept their data{scored}."
        ),
        "authors": f"the {len(silos)} silos of federated run {info['run']}, trained with fedasync",
        "copyright": f"the members of federated run {info['run']}",
        "intended_use": "research; not for diagnostic use",
        "data_source": spec.description,
        "data_type": (
            "3D volumes as float32 arrays (N, C, D, H, W), at each silo"
            if len(spec.image_size) == 3
            else "2D images (or feature rows) as float32 arrays (N, C, H, W), at each silo"
        ),
        "network_data_format": {} if info.get("bundle_root") else network_data_format(spec),
        "fedasync": {
            "model_version": version,
            "selected_as": selected,
            "model_sha256": model_sha,
            "weights_sha256": model_sha256(weights),  # as the erasure certificate hashes it
            "config_sha256": info["config_sha256"],
            "run": info["run"],
            "mode": info["mode"],
            "seed": info["seed"],
            "fedasync_version": v["fedasync"],
            "network": {
                "name": info["network"],
                "num_parameters": sum(t.numel() for t in weights.values()),
                "definition": network,
            },
            "training_data": {
                "benchmark": spec.name,
                "partition": info["partition"],
                "silos": silos,
                "total_samples": sum(s["num_samples"] for s in silos.values()),
                "excluded_silos": info["excluded_silos"],
            },
            "evaluation": evaluation,
            "erasures": erasures,
        },
    }


def _bundle_metadata(root: Path, configs: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """A bundle task's run: the task bundle's own config files are copied to ``configs``
    (so the model trains again from them, and ``network_def`` is the bundle's), and its
    ``metadata.json`` is kept with this run's version, changelog and ``fedasync`` section."""
    configs.mkdir(parents=True, exist_ok=True)
    for f in sorted((root / "configs").iterdir()):
        if f.is_file():
            shutil.copy2(f, configs / f.name)
    own_file = root / "configs" / "metadata.json"
    own = json.loads(own_file.read_text()) if own_file.is_file() else {}
    keep = ("version", "changelog", "description", "fedasync")
    return {**own, **{k: meta[k] for k in keep}}


def _inference(spec: BenchmarkSpec, network: dict[str, Any]) -> dict[str, Any]:
    entries = dict(network)
    imports = ["$import torch", *entries.pop("imports", [])]
    return {
        "imports": imports,
        "bundle_root": ".",
        "device": "$torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')",
        **entries,
        "network": "$@network_def.to(@device)",
        "checkpoint": "$@bundle_root + '/models/model.pt'",
        "preprocessing": preprocessing(spec),
        "inferer": inferer(spec),
        "postprocessing": postprocessing(spec),
    }


def evaluation_of(
    evals: list[dict[str, Any]], version: int, info: dict[str, Any]
) -> dict[str, Any] | None:
    """The run's last evaluation of ``version`` among ``evals`` (its ``eval`` records), as a
    bundle reports it; None when that version was not evaluated."""
    rec = next((e for e in reversed(evals) if e.get("version") == version), None)
    if rec is None:
        return None
    keep = ("score", "loss", "eval_silos", "eval_samples")
    return {**info["evaluation"], "version": version, **{k: rec[k] for k in keep if k in rec}}


def network_of(info: dict[str, Any]) -> dict[str, Any]:
    """The ConfigParser entries of the run's network (``network_def``; building it to check
    them is what this costs)."""
    if "network_def" in info:  # a bundle task's own
        return {"network_def": info["network_def"]}
    spec = spec_of(info)
    return network_entries(info["network"], spec.in_channels, spec.num_classes, spec.image_size)


def write_run_bundles(
    run_dir: Path,
    info: dict[str, Any],
    final: tuple[int, Params],
    best: tuple[int | None, Params | None],
    evals: list[dict[str, Any]],
    store: ErasureStore | None,
) -> dict[str, str]:
    """At the end of a run: its ``final`` model and its ``best`` evaluated one (server/
    evaluation.py ``BestModel``: version and params; none when no evaluation since the last
    erasure scored) as bundles in ``<run>/bundle/``, with what ``evals`` and the erasure
    ``store`` say of each version; their folders by name."""
    root = run_dir / BUNDLE_DIR
    made = {}
    picks = [("final", *final)]
    if best[0] is not None and best[1] is not None:
        picks.append(("best", best[0], best[1]))
    else:
        shutil.rmtree(root / "best", ignore_errors=True)
    network = network_of(info)
    for name, version, params in picks:
        folder = write_bundle(
            root / name,
            params,
            version,
            info,
            selected=name,
            evaluation=evaluation_of(evals, version, info),
            erasures=erasures_at(store, version),
            network=network,
        )
        made[name] = str(folder)
    return made
