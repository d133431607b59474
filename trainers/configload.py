"""Loading a trainer's typed config: defaults <- YAML file <- ``key=value`` overrides.

Shared by the trainers' configs (``fedasync rl``, ``fedasync pipeline``), on the same omegaconf
conventions as ``fedasync simulate``: an unknown key, a wrong type or a malformed file is a
``fedasync.errors.ConfigError`` (one line, exit 2) that names the key or the file. Ranges,
choices and cross-key rules are each config section's own ``__post_init__`` (with `check`,
`check_ranges` and `choices` from here), run as ``OmegaConf.to_object`` builds the sections;
the config class's own ``__post_init__`` checks the keys of different sections that must agree.
A config is never changed once built: derive another with ``dataclasses.replace``.

Choice fields are ``Literal`` types to mypy and, to omegaconf, ``Annotated[str, Literal[...]]``
(each config module rebinds its aliases under ``not TYPE_CHECKING``): omegaconf 2.3 refuses
Literal annotations, and 2.4 would check them itself in its own words before the section does,
changing the messages. `choices` reads the allowed values from either form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from fedasync.errors import ConfigError, UserError
from fedasync.ranges import check, check_ranges, choices, recheck

__all__ = ["check", "check_ranges", "choices", "load_structured", "recheck", "to_container"]

T = TypeVar("T")


def load_structured(
    schema_cls: type[T],
    path: str | Path | None,
    overrides: list[str] | None,
    example_override: str,
) -> T:
    """An instance of the dataclass ``schema_cls``: its defaults <- YAML ``path`` (None: none)
    <- ``key=value`` overrides, each section checked as it is built (its ``__post_init__``),
    the whole last. ``example_override`` is shown to a user who writes an override without
    ``=``. Neither the file nor ``overrides`` is changed."""
    import yaml
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
            why = str(e)[:300]
            raise ConfigError(f"config file {str(path)[:200]} is not valid YAML: {why}") from e
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file {str(path)[:200]} must map keys to values")
        layers.append(loaded)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item[:60]!r} is not key=value (e.g. {example_override})")
        try:
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as e:
            why = str(e).splitlines()[0][:120]
            raise ConfigError(f"override {item[:60]!r}: its value is not valid YAML ({why})") from e
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
