"""Load a run configuration: defaults <- YAML file <- ``key=value`` overrides (omegaconf).

The schema is ``server.config.FedAsyncConfig``: unknown keys and wrong types are errors that
name the key, before anything starts.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from server.config import FedAsyncConfig, validate

DEFAULT_CONFIG = "default.yaml"


def default_config_path() -> Path:
    return Path(str(resources.files("simulations") / "configs" / DEFAULT_CONFIG))


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> FedAsyncConfig:
    """The validated config of a run; ``path`` None means the packaged default."""
    schema = OmegaConf.structured(FedAsyncConfig)
    path = Path(path) if path is not None else default_config_path()
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        merged = OmegaConf.merge(
            schema, OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides or []))
        )
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(e).splitlines()[0]
        raise ValueError(f"bad configuration key {key}: {first} (defaults: {path})") from e
    assert isinstance(cfg, FedAsyncConfig)
    return validate(cfg)


def to_yaml(cfg: FedAsyncConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_container(cfg: FedAsyncConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]
