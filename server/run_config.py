"""The Flower app's run config: every fedasync setting as one flat key, as Flower wants it.

``flwr run`` gives the ServerApp a *run config*: the keys of pyproject.toml's
``[tool.flwr.app.config]`` (nested tables and dotted keys flattened to ``"a.b"`` keys), each
replaced by the ``--run-config`` override of the same key (a SuperLink refuses an override of
a key pyproject does not declare). So every fedasync setting is a key there, named as
``fedasync simulate`` names it (``server.mode``, ``run.budget_s``, ``data.benchmark``...),
with the config's default, and a Flower user tunes a run with Flower's own command::

    flwr run . <superlink> --run-config 'server.mode="fedbuff" run.budget_s=120'

A run config holds only bool, int, float and str values (Flower refuses a TOML list, and
TOML has no null). So:

- ``""`` is null for a key that allows null (``run.max_versions``, ``server.clip_norm``,
  ``data.network``...): off, none, or the default it documents;
- a list (``lab.exclude``, ``lab.faults``, ``erasures``) is a JSON list in a string:
  ``lab.exclude="[0, 2]"``, ``lab.faults='[{"kind": "crash", "silo": 1}]'``.

Everything else is the value itself; a string is quoted on Flower's command line
(``server.mode="sync"``; unquoted, Flower refuses it). `config_from_run_config` decodes those
two encodings and builds the config by ``server.config.build``, the code ``fedasync simulate``
builds its config by, so a bad value gets the error it gets there, naming the key; an unknown
key is refused. `run_config_toml` writes a ``--run-config`` file (``fedasync deploy local``),
`pyproject_block` the ``[tool.flwr.app.config]`` table (``python -m server.run_config``
prints it; tests/test_run_config.py checks that pyproject.toml holds every key with its
default).

No paper: Flower's run config (flwr.common.config in Flower 1.42).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Union, get_args, get_origin, get_type_hints

from fedasync.errors import ConfigError
from runkit.configload import bounded
from server.config import FedAsyncConfig, build

RunConfigValue = bool | int | float | str
"""What a Flower run config can hold (flwr.app.user_config.UserConfigValue)."""

SOURCE = "Flower run config"
"""Where the values came from, in omegaconf's errors (``server.config.build``)."""


@dataclass(frozen=True)
class Key:
    """One flat run-config key: a leaf field of FedAsyncConfig."""

    name: str
    """The dotted name (``server.staleness.fn``), as ``fedasync simulate`` takes it."""
    path: tuple[str, ...]
    """The attribute path from FedAsyncConfig to the field."""
    type: type
    """bool, int, float or str; for a list key, the list itself."""
    optional: bool
    """None allowed (written ``""``)."""
    is_list: bool
    """A list, written as a JSON string."""


def _leaf_type(name: str, tp: Any) -> tuple[type, bool, bool]:
    """(type, optional, is_list) of the annotation ``tp`` of key ``name``."""
    optional = False
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"{name}: a run config key cannot be {tp}")
        optional, tp = type(None) in get_args(tp), args[0]
    if get_origin(tp) is list:
        return list, optional, True
    if tp in (bool, int, float, str):
        return tp, optional, False
    raise TypeError(f"{name}: a run config key cannot be {tp}")  # a new kind of field


def _walk(cls: type, path: tuple[str, ...]) -> Iterator[Key]:
    """The leaf keys of the config dataclass ``cls`` at ``path``, in field order."""
    hints = get_type_hints(cls)  # Annotated[str, Literal[...]] comes back as str
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        sub = (*path, f.name)
        if dataclasses.is_dataclass(tp):
            yield from _walk(tp, sub)  # type: ignore[arg-type]
        else:
            kind, optional, is_list = _leaf_type(".".join(sub), tp)
            yield Key(".".join(sub), sub, kind, optional, is_list)


@lru_cache(maxsize=1)
def keys() -> dict[str, Key]:
    """Every flat key of the run config, in FedAsyncConfig's field order."""
    return {k.name: k for k in _walk(FedAsyncConfig, ())}


def _value(cfg: object, path: tuple[str, ...]) -> Any:
    """The field at ``path`` of ``cfg``."""
    for part in path:
        cfg = getattr(cfg, part)
    return cfg


def to_run_config(cfg: FedAsyncConfig) -> dict[str, RunConfigValue]:
    """``cfg`` as a flat run config: None as ``""``, lists as JSON strings, floats as floats."""
    out: dict[str, RunConfigValue] = {}
    for name, key in keys().items():
        value = _value(cfg, key.path)
        if value is None:
            out[name] = ""
        elif key.is_list:
            items = [
                dataclasses.asdict(v)
                if dataclasses.is_dataclass(v) and not isinstance(v, type)
                else v
                for v in value
            ]
            out[name] = json.dumps(items)
        elif key.type is float:
            out[name] = float(value)
        else:
            out[name] = value
    return out


def _decode(key: Key, value: object) -> Any:
    """The value of ``key`` that omegaconf is given for the run config's ``value``."""
    if not isinstance(value, bool | int | float | str):
        raise ConfigError(
            f"{key.name} must be a bool, int, float or string in the {SOURCE}, "
            f"got a {type(value).__name__}"
        )
    if key.optional and value == "":
        return None
    if key.optional and key.type is not str and value in ("null", "None", "none"):
        raise ConfigError(f'{key.name}: null is written "" in the {SOURCE} ({key.name}="")')
    if key.is_list:
        example = '[{"kind": "crash", "silo": 1}]' if key.name == "lab.faults" else "[0, 2]"
        if not isinstance(value, str):
            raise ConfigError(f"{key.name} must be a JSON list in a string, e.g. '{example}'")
        try:
            items = json.loads(value)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise ConfigError(
                f"{key.name} must be a JSON list in a string, e.g. '{example}': "
                f"{bounded(e, 100)} in {bounded(repr(value), 100)}"
            ) from e
        if not isinstance(items, list):
            raise ConfigError(
                f"{key.name} must be a JSON list, e.g. '{example}', got {bounded(repr(value), 100)}"
            )
        return items
    return value


def config_from_run_config(run_config: Mapping[str, Any]) -> FedAsyncConfig:
    """The config a Flower run config describes, checked as ``fedasync simulate`` checks its
    own (``server.config.build``). Flat keys as in pyproject.toml's ``[tool.flwr.app.config]``;
    a key left out keeps the config's default; ``""`` is null where a key allows null; lists
    are JSON strings. Raises ConfigError naming the key (an unknown key, a value of the wrong
    type or out of range), its message bounded. ``run_config`` is left as it was."""
    known = keys()
    nested: dict[str, Any] = {}
    for name, value in run_config.items():
        key = known.get(name)
        if key is None:
            near = difflib.get_close_matches(str(name), list(known), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ConfigError(
                f"unknown {SOURCE} key {bounded(repr(name), 100)}: the keys are those of "
                f"[tool.flwr.app.config] in pyproject.toml (docs/configuration.md){hint}"
            )
        node = nested
        for part in key.path[:-1]:
            node = node.setdefault(part, {})
        node[key.path[-1]] = _decode(key, value)
    return build(nested, source=SOURCE)


def _toml_value(value: RunConfigValue) -> str:
    """``value`` as a TOML value that tomli reads back as equal (nan as nan)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value)  # 0.3, 1e-05, inf, -inf: each valid TOML
    # A JSON string is a TOML basic string but for DEL, which TOML wants escaped; non-ASCII
    # stays as it is (a \\ud83d surrogate escape, which JSON writes for astral characters,
    # is refused by TOML).
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def run_config_toml(cfg: FedAsyncConfig) -> str:
    """The text of a ``flwr run --run-config FILE`` file holding ``cfg`` as flat keys
    (``key = value``, one a line): Flower's parser reads it back to `to_run_config`'s dict,
    which `config_from_run_config` turns back into ``cfg``."""
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in to_run_config(cfg).items())


def pyproject_block(cfg: FedAsyncConfig | None = None) -> str:
    """pyproject.toml's ``[tool.flwr.app.config]`` table: every key with its value in ``cfg``
    (None: the config's defaults), a commented group per section."""
    flat = to_run_config(cfg if cfg is not None else FedAsyncConfig())
    lines = [
        "[tool.flwr.app.config]",
        "# Every fedasync setting as a flat key, named and checked as in `fedasync simulate`",
        "# (docs/configuration.md); the defaults are server.config.FedAsyncConfig's. Override:",
        "#   flwr run . <superlink> --run-config 'server.mode=\"fedbuff\" run.budget_s=120'",
        '# "" is null where a key allows it; lab.exclude, lab.faults and erasures are JSON lists',
        "# in a string. Written by `python -m server.run_config` (server/run_config.py).",
    ]
    section = ""
    for name, value in flat.items():
        head = name.split(".", 1)[0]
        if head != section:
            section = head
            doc = _section_doc(head)
            lines += ["", f"# {head}: {doc}" if doc else f"# {head}"]
        lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _section_doc(head: str) -> str:
    """A comment on FedAsyncConfig's top-level field ``head``: its class's docstring's first
    line, or for a list of entries an entry with every field at its default."""
    tp = get_type_hints(FedAsyncConfig)[head]
    if get_origin(tp) is list:
        entry = json.dumps(dataclasses.asdict(get_args(tp)[0]()))
        return f"a JSON list of entries like {entry}"
    doc = (tp.__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


if __name__ == "__main__":
    print(pyproject_block(), end="")
