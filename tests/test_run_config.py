"""The Flower app's run config (server/run_config.py): every setting a flat key of pyproject's
``[tool.flwr.app.config]`` with the config's default, read through Flower's own parser and
merge (flwr.common.config), built and checked as ``fedasync simulate`` builds its config."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from flwr.common.config import (
    flatten_dict,
    fuse_dicts,
    parse_config_args,
    validate_fields_in_config,
)
from omegaconf import OmegaConf

from fedasync.errors import ConfigError
from runkit.configload import MESSAGE_LIMIT
from server.config import ErasureRequestConfig, FedAsyncConfig, build
from server.config_lab import FaultConfig
from server.run_config import (
    config_from_run_config,
    keys,
    pyproject_block,
    run_config_toml,
    to_run_config,
)
from simulations.config import load_config

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _pyproject_defaults() -> dict:
    """The run config Flower reads from pyproject.toml, flattened as Flower flattens it."""
    project = tomllib.loads(PYPROJECT.read_text())
    return flatten_dict(project["tool"]["flwr"]["app"].get("config", {}))


def _typed(flat: dict) -> dict:
    """``flat`` with each value's type beside it (600 == 600.0, but TOML keeps them apart)."""
    return {k: (type(v).__name__, v) for k, v in flat.items()}


def _flower_run_config(*overrides: str) -> dict:
    """What the ServerApp gets for ``flwr run . <superlink> --run-config OVERRIDE ...``: the
    SuperLink checks the keys (check_keys), then the defaults are fused with the overrides."""
    override = parse_config_args(list(overrides))
    fuse_dicts(_pyproject_defaults(), override, check_keys=True)  # what StartRun checks
    return fuse_dicts(_pyproject_defaults(), override)


def _error(run_config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_run_config(run_config)
    return str(info.value)


# ---------------------------------------------------------------- pyproject.toml


def test_pyproject_declares_every_key_with_the_configs_default():
    # Prepare
    project = tomllib.loads(PYPROJECT.read_text())
    # Execute
    defaults = _pyproject_defaults()
    # Assert: same keys, values and TOML types (a new config field needs its line there:
    # `python -m server.run_config` prints the table)
    assert _typed(defaults) == _typed(to_run_config(FedAsyncConfig()))
    assert set(defaults) == set(keys())
    assert config_from_run_config(defaults) == FedAsyncConfig()
    assert validate_fields_in_config(project)[0]  # Flower accepts the table
    assert _typed(flatten_dict(tomllib.loads(pyproject_block())["tool"]["flwr"]["app"]["config"])) == _typed(defaults)  # fmt: skip


def test_the_keys_are_the_leaves_of_the_schema_fedasync_simulate_overrides():
    # Derived again from omegaconf's schema (what `fedasync simulate key=value` is checked
    # against), not from the type hints server/run_config walks.
    def leaves(node: dict, prefix: str = "") -> list[str]:
        out = []
        for k, v in node.items():
            out += leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
        return out

    schema = OmegaConf.to_container(OmegaConf.structured(FedAsyncConfig))
    assert list(keys()) == leaves(schema)


# ---------------------------------------------------------------- Flower's overrides


@pytest.mark.parametrize(
    ("overrides", "changed"),
    [
        (
            ['server.mode="sync" run.budget_s=30'],
            lambda c: replace(
                c,
                server=replace(c.server, mode="sync"),
                run=replace(c.run, budget_s=30.0),
            ),
        ),
        (
            [
                'server.mode="fedbuff" server.buffer_size=5 server.staleness.fn="hinge" '
                'run.max_versions=40 server.max_staleness="" data.network="resnet18" '
                'lab.exclude="[0, 2]" '
                """lab.faults='[{"kind": "nan", "silo": 1, "at_version": 3}]' """
                "client.dp.target_epsilon=2.5"
            ],
            lambda c: replace(
                c,
                server=replace(
                    c.server,
                    mode="fedbuff",
                    buffer_size=5,
                    staleness=replace(c.server.staleness, fn="hinge"),
                    max_staleness=None,
                ),
                run=replace(c.run, max_versions=40),
                data=replace(c.data, network="resnet18"),
                lab=replace(
                    c.lab, exclude=[0, 2], faults=[FaultConfig(kind="nan", silo=1, at_version=3)]
                ),
                client=replace(c.client, dp=replace(c.client.dp, target_epsilon=2.5)),
            ),
        ),
        ([], lambda c: c),
    ],
    ids=["mode-and-budget", "nested-optional-lists", "none"],
)
def test_flowers_override_strings_give_the_typed_config(overrides, changed):
    # Execute
    cfg = config_from_run_config(_flower_run_config(*overrides))
    # Assert: the values asked for, everything else the default, each of its type
    assert cfg == changed(FedAsyncConfig())
    assert isinstance(cfg.run.budget_s, float) and isinstance(cfg.server.alpha, float)


def test_a_run_config_file_round_trips_through_flowers_parser(tmp_path):
    # Prepare: a config unlike the defaults, lists, nulls and awkward strings included
    cfg = build(
        {
            "run": {"name": 'a "quoted" \\ näme\n\ttab\x7f', "max_versions": 50, "seed": 3},
            "server": {
                "mode": "sync",
                "max_staleness": None,
                "clip_norm": 2.0,
                "dp": {"noise_multiplier": 1e-7, "ledger": "/tmp/l.sqlite"},
                "sample_weighting": False,
                "corrections": {"residual_budget_mb": None},
            },
            "silos": {"count": 4},
            "erasures": [{"silo": 0, "at_s": 12.5, "fraction": 0.25}],
            "data": {"network": "resnet18", "max_samples": 400},
            "engine": {"ray_address": "127.0.0.1:6379"},
            "lab": {
                "exclude": [1, 3],
                "faults": [{"kind": "crash", "silo": 2, "down_s": 5}],
                "backdoor": {"relearn_silo": 1},
            },
        },
        source="test",
    )
    assert cfg.erasures == [ErasureRequestConfig(silo=0, at_s=12.5, fraction=0.25)]
    path = tmp_path / "run-config.toml"
    path.write_text(run_config_toml(cfg), encoding="utf-8")
    # Execute: as `flwr run --run-config FILE` parses it, then merged as the SuperLink does
    parsed = parse_config_args([str(path)])
    back = config_from_run_config(_flower_run_config(str(path)))
    # Assert
    assert _typed(parsed) == _typed(to_run_config(cfg))
    assert back == cfg


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("simulate", "run_config"),
    [
        ("server.mode=bogus", {"server.mode": "bogus"}),
        ("server.alpha=5", {"server.alpha": 5}),
        ("server.alpha=abc", {"server.alpha": "abc"}),
        ("silos.count=0", {"silos.count": 0}),
        ("lab.faults=[{kind: crashx}]", {"lab.faults": '[{"kind": "crashx"}]'}),
        ("run.progress=maybe", {"run.progress": "maybe"}),
    ],
)
def test_a_bad_value_gets_the_error_fedasync_simulate_gives(simulate, run_config):
    # Prepare
    with pytest.raises(ConfigError) as info:
        load_config(None, [simulate])
    want = str(info.value).split(" (config: ")[0]
    # Execute
    got = _error(run_config)
    # Assert: same words naming the same key; omegaconf's say where the values came from
    assert got.split(" (Flower run config)")[0] == want
    assert run_config.popitem()[0] in got


@pytest.mark.parametrize(
    ("run_config", "words"),
    [
        ({"server.mod": "sync"}, "unknown Flower run config key 'server.mod'"),
        ({"server.mod": "sync"}, "did you mean server.mode?"),
        ({"config-json": "{}"}, "unknown Flower run config key 'config-json'"),
        ({"lab.exclude": "[1,"}, "lab.exclude must be a JSON list in a string"),
        ({"lab.exclude": "{}"}, "lab.exclude must be a JSON list"),
        ({"lab.exclude": 3}, "lab.exclude must be a JSON list in a string"),
        ({"lab.exclude": '["a"]'}, "lab.exclude[0]"),
        ({"run.max_versions": "null"}, 'run.max_versions: null is written ""'),
        ({"run.max_versions": None}, "run.max_versions must be a bool, int, float or string"),
        ({"server.alpha": ""}, "bad configuration key server.alpha"),
        ({"lab.faults": '[{"kind": "crash", "silo": 9}]'}, "lab.faults[0].silo=9 is not a silo"),
    ],
)
def test_a_bad_run_config_is_refused_naming_the_key(run_config, words):
    assert words in _error(run_config)


@pytest.mark.parametrize(
    "run_config",
    [
        {"x" * 100_000: 1},
        {"server.mode": "x" * 100_000},
        {"server.alpha": "x" * 100_000},
        {"lab.exclude": "[" * 100_000},
        {"lab.faults": '[{"kind": "' + "x" * 100_000 + '"}]'},
        {"lab.faults": '[{"' + "x" * 100_000 + '": 1}]'},
    ],
    ids=["key", "choice", "number", "json", "entry-choice", "entry-key"],
)
def test_an_error_never_echoes_unbounded_input(run_config):
    assert len(_error(run_config)) < 2 * MESSAGE_LIMIT


# ---------------------------------------------------------------- Flower's parser, as documented


def test_flower_keeps_one_run_config_option_per_first_key_part():
    # docs/configuration.md says to give every override in one --run-config string: Flower
    # 1.42 replaces the whole first-part table with each option's (dict.update before
    # flattening), so separate options sharing a first part keep only the last.
    assert parse_config_args(['server.mode="sync"', "server.alpha=0.5"]) == {"server.alpha": 0.5}
    assert parse_config_args(['server.mode="sync" server.alpha=0.5']) == {
        "server.mode": "sync",
        "server.alpha": 0.5,
    }
