"""The one config loader of the tree: a typed config from its defaults <- a YAML file <-
``key=value`` overrides (or any other layers, such as a Flower run config).

``fedasync simulate`` and the Flower app (server.config), ``fedasync rl``, ``fedasync pipeline``
and ``fedasync market`` all build their configs here, on the same omegaconf conventions: an
unknown key, a wrong type or a malformed file is a ``fedasync.errors.ConfigError`` (one line,
exit 2) that names the key or the file, bounded in length (an error never echoes unbounded
input). Ranges, choices and cross-key rules are each config section's own ``__post_init__``
(with `check`, `check_ranges` and `choices`), run as ``OmegaConf.to_object`` builds the
sections; the config class's own ``__post_init__`` checks the keys of different sections that
must agree. A config is never changed once built: derive another with ``dataclasses.replace``.

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

__all__ = [
    "MESSAGE_LIMIT",
    "bounded",
    "build",
    "check",
    "check_ranges",
    "choices",
    "load_structured",
    "read_layers",
    "recheck",
    "to_container",
]

T = TypeVar("T")

MESSAGE_LIMIT = 300
"""Characters an error message may take from its input (`bounded`)."""


def bounded(text: object, limit: int = MESSAGE_LIMIT) -> str:
    """``str(text)`` cut to ``limit`` characters: an error never echoes unbounded input."""
    s = str(text)
    return s if len(s) <= limit else s[:limit] + "..."


def build(schema_cls: type[T], *layers: Any, source: str | None = None) -> T:
    """The config that ``schema_cls``'s defaults, overlaid with ``layers`` in turn (plain dicts
    or omegaconf containers), describe, checked as it is built; ``layers`` are left as they
    were. Raises ConfigError naming the key: omegaconf's (unknown key, wrong type), with
    ``source`` (where the values came from) appended when given, or a section's own check;
    every message is bounded."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    where = f" ({source})" if source else ""
    from runkit.keys import tracker_layers

    layers = tuple(tracker_layers(list(layers)))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema_cls), *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = bounded(getattr(e, "full_key", None) or "?", 100)
        lines = str(e).splitlines()
        first = bounded(lines[0] if lines else type(e).__name__)
        raise ConfigError(f"bad configuration key {key}: {first}{where}") from e
    except ValueError as e:  # a config dataclass's own check (ConfigError), or a plain one
        msg = str(e)
        if isinstance(e, UserError) and len(msg) <= MESSAGE_LIMIT:
            raise
        raise ConfigError(bounded(msg)) from e
    assert isinstance(cfg, schema_cls)
    return cfg


def read_layers(
    path: str | Path | None,
    overrides: list[str] | None,
    example_override: str,
    *,
    sections_hint: str = "",
) -> list[Any]:
    """The layers a command line gives: the YAML file at ``path`` (None: none), then the
    ``key=value`` overrides, each checked for form (a file that exists, parses and maps keys to
    values; an override with ``=`` whose value parses). ``example_override`` is shown to a user
    who writes an override without ``=``; ``sections_hint`` (e.g. ``run:, server:, ...``) to
    one whose file holds a list. Neither the file nor ``overrides`` is changed."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers: list[Any] = []
    if path is not None:
        path = Path(path)
        name = bounded(path, 200)
        if not path.is_file():
            raise ConfigError(f"config file {name} does not exist (--config)")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # YAML syntax (yaml.YAMLError), or an unreadable file
            raise ConfigError(f"config file {name} is not valid YAML: {bounded(e)}") from e
        if not isinstance(loaded, DictConfig):
            hint = f" ({sections_hint}), not hold a list" if sections_hint else ""
            raise ConfigError(f"config file {name} must map keys to values{hint}")
        layers.append(loaded)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item[:60]!r} is not key=value (e.g. {example_override})")
        try:
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as e:
            why = str(e).splitlines()[0][:120]
            raise ConfigError(f"override {item[:60]!r}: its value is not valid YAML ({why})") from e
        except OmegaConfBaseException as e:
            key = bounded(getattr(e, "full_key", None) or "?", 100)
            first = bounded(str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise ConfigError(f"bad configuration key {key}: {first}") from e
    layers.append(OmegaConf.from_dotlist(list(overrides or [])))
    return layers


def load_structured(
    schema_cls: type[T],
    path: str | Path | None,
    overrides: list[str] | None,
    example_override: str,
    *,
    sections_hint: str = "",
) -> T:
    """An instance of the dataclass ``schema_cls``: its defaults <- YAML ``path`` (None: none)
    <- ``key=value`` overrides (`read_layers`), each section checked as it is built (its
    ``__post_init__``), the whole last (`build`)."""
    layers = read_layers(path, overrides, example_override, sections_hint=sections_hint)
    source = f"config: {bounded(path, 200)}" if path is not None else None
    return build(schema_cls, *layers, source=source)


def to_container(cfg: Any) -> dict[str, Any]:
    """A config dataclass instance as plain dicts (for metrics.jsonl and checkpoints)."""
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]
