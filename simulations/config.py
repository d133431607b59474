"""Load a run configuration: defaults <- YAML file <- ``key=value`` overrides (omegaconf).

The schema is ``server.config.FedAsyncConfig``: unknown keys, wrong types and values out of
range are errors that name the key, before anything starts (omegaconf catches the first two,
each config section's ``__post_init__`` the rest, as ``OmegaConf.to_object`` builds it; the
inputs, the file and the overrides, are never changed). `load_config` then runs
`preflight`, which checks what needs files (the data, a checkpoint to resume from), so that a
run never reaches Flower's simulation engine (or a deployment) with inputs it cannot use.
Every such error is a ``fedasync.errors.UserError``: the CLI prints it as one line, exit 2.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fedasync.errors import ConfigError
from runkit.configload import bounded, read_layers
from server.config import FedAsyncConfig, build

DEFAULT_CONFIG = "default.yaml"


def default_config_path() -> Path:
    """The packaged default config (simulations/configs/default.yaml)."""
    return Path(str(resources.files("simulations") / "configs" / DEFAULT_CONFIG))


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> FedAsyncConfig:
    """The validated config of a run, its inputs checked by `preflight`; ``path`` None means
    the packaged default. Raises ConfigError, DataError or CheckpointError naming the key or
    file."""
    path = Path(path) if path is not None else default_config_path()
    layers = read_layers(path, overrides, "server.mode=fedbuff", sections_hint="run:, server:, ...")
    return preflight(build(*layers, source=f"config: {bounded(path, 200)}"))


def checkpoint_path(cfg: FedAsyncConfig) -> Path:
    """Where the run's checkpoint lives (and a resumed run reads it)."""
    from server.checkpoint import CHECKPOINT_FILE

    return Path(cfg.run.out_dir) / cfg.run.name / CHECKPOINT_FILE


def preflight(cfg: FedAsyncConfig) -> FedAsyncConfig:
    """Check the inputs a valid config points at, before any engine starts: the data (the
    federation is built here; medical_data caches it, so the launcher's build is free), the
    network (built, and one sample passed through it: its output must fit the task), the
    devices, the erasure service's credentials and TLS files, and, with ``run.resume``, the
    checkpoint (verified, finite, same server mode, same model).

    Raises DataError (a data file missing or not the pinned one), ConfigError (e.g. more
    silos than the data allows, a network that does not fit) or CheckpointError, each naming
    the key or file.
    """
    import torch

    from protocol.config import build_silos
    from server.benchmark import initial_model

    if cfg.task.bundle is not None:
        return _preflight_bundle(cfg)
    spec = build_silos(cfg.data, cfg.silos.count, cfg.run.seed).spec
    name = cfg.data.network or spec.network
    with torch.random.fork_rng(devices=[]):  # initial_model seeds torch's generator
        try:
            model = initial_model(cfg)
        except ValueError as e:  # medical_data.networks: the images do not fit the network
            raise ConfigError(f"data.network={name}: {e}; try data.network={spec.network}") from e
    model.eval()
    with torch.no_grad():
        out = tuple(model(torch.zeros(1, spec.in_channels, *spec.image_size)).shape)
    want: tuple[int, ...] = (1, spec.num_classes)
    if spec.task == "segmentation":
        want = (*want, *spec.image_size)
    if out != want:
        raise ConfigError(
            f"data.network={name} outputs shape {out}, {spec.task} on {spec.name} needs {want}; "
            f"use data.network={spec.network} (the benchmark's default)"
        )
    _check_devices(cfg)
    for key in ("credentials", "tls_certfile", "tls_keyfile"):
        file = getattr(cfg.unlearning, key)
        if file is not None and not Path(file).is_file():
            raise ConfigError(
                f"unlearning.{key}={file} is not a file; give an existing file "
                "(credentials: fedasync erase credentials) or null"
            )
    if cfg.run.resume:
        from server.checkpoint import check_resumable

        check_resumable(checkpoint_path(cfg), cfg.server.mode, model.state_dict())
        if cfg.lab.compare_sync and cfg.server.mode != "sync":  # the baseline resumes too
            from server.checkpoint import CHECKPOINT_FILE
            from simulations.launcher import BASELINE_DIR

            path = checkpoint_path(cfg).parent / BASELINE_DIR / CHECKPOINT_FILE
            check_resumable(path, "sync", model.state_dict())
    return cfg


def _preflight_bundle(cfg: FedAsyncConfig) -> FedAsyncConfig:
    """``preflight`` of a bundle task: the bundle reads, its network builds, its training
    forward is one fedasync drives, and its datalist splits into ``silos.count`` silos (each
    a ConfigError naming the bundle's id or the key). Resuming checks the checkpoint against
    the bundle's network."""
    import torch

    from clients.task import split_items
    from medical_data.monai_bundle import read_bundle
    from server.benchmark import initial_model

    bundle = read_bundle(str(cfg.task.bundle))
    bundle.check_train_inferer()
    bundle.loss()
    with torch.random.fork_rng(devices=[]):
        model = initial_model(cfg)
    try:
        split_items(bundle.items("train"), cfg.silos.count, cfg.data.partition, cfg.run.seed)
    except ValueError as e:
        raise ConfigError(f"task.bundle: {e}") from e
    _check_devices(cfg)
    if cfg.run.resume:
        from server.checkpoint import check_resumable

        check_resumable(checkpoint_path(cfg), cfg.server.mode, model.state_dict())
    return cfg


def _check_devices(cfg: FedAsyncConfig) -> None:
    """The devices the silos are to train on exist on this machine: client.device names one,
    and engine.client_gpus > 0 on a private Ray needs a GPU (or no ClientApp would ever be
    scheduled and the run would wait forever)."""
    import torch

    name = cfg.client.device
    if name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError as e:
            raise ConfigError(
                f"client.device={name!r} is not a device: use auto, cpu, cuda or cuda:N"
            ) from e
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(
                f"client.device={name}: this machine has {torch.cuda.device_count()} CUDA "
                "device(s); use client.device=auto (CUDA when present, else CPU) or cpu"
            )
    gpus = cfg.engine.client_gpus
    if gpus > 0 and cfg.engine.ray_address is None and not torch.cuda.is_available():
        raise ConfigError(
            f"engine.client_gpus={gpus} but this machine has no CUDA device, so no silo could "
            "ever be scheduled; set engine.client_gpus=0"
        )


def to_yaml(cfg: FedAsyncConfig) -> str:
    """``cfg`` as YAML (the run folder's config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_container(cfg: FedAsyncConfig) -> dict[str, Any]:
    """``cfg`` as plain dicts (what ``from_container`` takes back)."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]
