"""Loading a trainer's typed config: defaults <- YAML file <- ``key=value`` overrides.

Shared by the trainers' configs (``fedasync rl``, ``fedasync pipeline``), on the same omegaconf
conventions as ``fedasync simulate``: an unknown key, a wrong type or a malformed file is a
``fedasync.errors.ConfigError`` (one line, exit 2) that names the key or the file. Ranges and
cross-key rules are each config's own ``validate``, run on what this returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from fedasync.errors import ConfigError, UserError

T = TypeVar("T")


def load_structured(
    schema_cls: type[T],
    path: str | Path | None,
    overrides: list[str] | None,
    example_override: str,
) -> T:
    """An instance of the dataclass ``schema_cls``: its defaults <- YAML ``path`` (None: none)
    <- ``key=value`` overrides, not yet validated. ``example_override`` is shown to a user who
    writes an override without ``=``."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(schema_cls)
    layers: list[Any] = [schema]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)[:200]} does not exist (--config)")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:
            raise ConfigError(f"config file {str(path)[:200]} is not valid YAML: {e}") from e
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file {str(path)[:200]} must map keys to values")
        layers.append(loaded)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item[:60]!r} is not key=value (e.g. {example_override})")
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides or [])))
        cfg = OmegaConf.to_object(OmegaConf.merge(*layers))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"bad configuration key {key}: {str(e).splitlines()[0][:200]}") from e
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise ConfigError(str(e)[:300]) from e
    assert isinstance(cfg, schema_cls)
    return cfg


def to_container(cfg: Any) -> dict[str, Any]:
    """A config dataclass instance as plain dicts (for metrics.jsonl and checkpoints)."""
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]
