"""Configuration: defaults, overrides, and clear errors for bad keys and values."""

import dataclasses
import re
import typing

import pytest

from fedasync.errors import ConfigError
from fedasync.ranges import Range
from server.config import RANGES, FedAsyncConfig
from simulations.cli import main
from simulations.config import load_config


def test_default_config_is_valid():
    cfg = load_config()
    assert cfg.server.mode == "fedasync"
    assert cfg.data.benchmark == "brain-tissue"
    assert cfg.lab.compare_sync is False  # a run runs once; make demo asks for the baseline


def test_overrides_apply_with_types():
    cfg = load_config(
        None,
        [
            "server.mode=fedbuff",
            "server.buffer_size=4",
            "silos.count=10",
            "server.max_staleness=null",
        ],
    )
    assert (cfg.server.mode, cfg.server.buffer_size, cfg.silos.count, cfg.server.max_staleness) == (
        "fedbuff",
        4,
        10,
        None,
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("server.mode=gossip", "server.mode"),
        ("server.nonsense=1", "nonsense"),
        ("silos.count=abc", "count"),
        ("lab.speed.profile=fast", "lab.speed.profile"),
        ("lab.faults=[{kind: meteor, silo: 0}]", "lab.faults[0].kind"),
        ("lab.faults=[{kind: crash, silo: 99}]", "lab.faults[0].silo"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_cli_reports_bad_config(capsys):
    assert main(["simulate", "server.mode=gossip"]) == 2
    assert "server.mode" in capsys.readouterr().err


def _numeric_keys(cls, prefix: str = "") -> dict[str, type]:
    """Every numeric key of a config dataclass with its type (int or float, maybe | None),
    lists of dataclasses as ``name[].key`` and lists of numbers as ``name[]``."""
    keys: dict[str, type] = {}
    for name, tp in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            if dataclasses.is_dataclass(item):
                keys |= _numeric_keys(item, f"{prefix}{name}[].")
            elif item in (int, float):
                keys[f"{prefix}{name}[]"] = item
        elif dataclasses.is_dataclass(tp):
            keys |= _numeric_keys(tp, f"{prefix}{name}.")
        elif len(args) == 1 and args[0] in (int, float):
            keys[f"{prefix}{name}"] = args[0]
    return keys


NUMERIC = _numeric_keys(FedAsyncConfig)


def test_every_numeric_key_has_a_declared_range():
    # Prepare
    keys = set(NUMERIC)

    # Assert: none missing (a new key must say its range, or UNBOUNDED), none stale
    assert len(keys) > 60
    assert sorted(keys - set(RANGES)) == []
    assert sorted(set(RANGES) - keys) == []


def _outside(rng: Range, tp: type) -> list[float]:
    out = [float("nan"), float("inf")] if tp is float else []
    if rng.lo is not None:
        out.append(rng.lo if rng.lo_open else rng.lo - 1)
    if rng.hi is not None:
        out.append(rng.hi if rng.hi_open else rng.hi + 1)
    return out


def _override(key: str, value) -> str:
    """The override that sets ``key`` (``a[].b`` in a one-entry list) to ``value``."""
    if "[]" not in key:
        return f"{key}={value}"
    head, _, field = key.partition("[]")
    if not field:
        return f"{head}=[{value}]"
    return f"{head}=[{{{field.lstrip('.')}: {value}}}]"


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_range_is_enforced_naming_the_key(key):
    # Prepare: each value just outside the key's range (and NaN, inf)
    shown = key.replace("[]", "[0]")

    for value in _outside(RANGES[key], NUMERIC[key]):
        # Execute / Assert
        with pytest.raises(ConfigError, match=re.escape(shown)):
            load_config(None, [_override(key, value)])


def test_in_range_values_at_the_bounds_are_accepted():
    cfg = load_config(
        None,
        [
            "server.alpha=1.0",
            "lab.speed.jitter=0.0",
            "lab.speed.straggler_fraction=1.0",
            "server.checkpoint_every=0",
            "unlearning.steps=0",
            "lab.target_accuracy=1.0",
        ],
    )
    assert (cfg.server.alpha, cfg.lab.speed.straggler_fraction) == (1.0, 1.0)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("client.lr=-1", "client.lr"),
        ("server.staleness.fn=cubic", "server.staleness.fn"),
        ("data.benchmark=mnist", "data.benchmark"),
        ("data.partition=random", "data.partition"),
        ("data.network=vgg", "data.network"),
        ("lab.exclude=[7]", "lab.exclude[0]"),
        ("lab.soft_staleness=200", "lab.soft_staleness"),
    ],
)
def test_names_and_cross_checks_are_config_errors(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, [override])


def test_range_text():
    assert str(Range(0, lo_open=True)) == "> 0"
    assert str(Range(0, 1, hi_open=True)) == "in [0, 1)"
    assert 0.5 in Range(0, 1) and 1 not in Range(0, 1, hi_open=True)
    assert float("nan") not in Range() and True not in Range()


# ---------------------------------------------------------------- keys under earlier names


def test_a_config_saved_under_the_earlier_names_loads_as_today(tmp_path):
    # Prepare: a run folder's config.yaml as an earlier fedasync wrote it (moved keys and
    # settled constants at their values)
    saved = tmp_path / "config.yaml"
    saved.write_text(
        "run: {target_accuracy: 0.8}\n"
        "server: {soft_staleness: 3, soft_factor: 0.25, poll_interval_s: 0.05,"
        " reply_stall_s: 30.0, norm_outlier_factor: 10.0,"
        " corrections: {delay_compensation: 0.1, error_feedback_topk: 1.0,"
        " residual_budget_mb: 2048.0, max_snapshots: 64}, dp: {delta: 1.0e-05}}\n"
        "silos: {straggler_fraction: 0.5, jitter: 0.0}\n"
        "engine: {client_cpus: 1}\n"
        "unlearning: {stop_alpha: 0.05, stop_probe: 128, max_attempts: 3, stop_every: 2,"
        " signature_dtype: float16, sketch_rank: 8, relearn_versions: 5}\n"
    )
    # Execute
    cfg = load_config(saved)
    # Assert
    lab = cfg.lab
    assert (lab.target_accuracy, lab.soft_staleness, lab.soft_factor) == (0.8, 3, 0.25)
    assert lab.corrections.delay_compensation == 0.1
    assert (lab.speed.straggler_fraction, lab.speed.jitter) == (0.5, 0.0)
    e = lab.erasure
    assert (e.stop_every, e.signature_dtype, e.sketch_rank, e.relearn_versions) == (
        2,
        "float16",
        8,
        5,
    )


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("server.poll_interval_s=0.2", "server.poll_interval_s=0.2 is no longer a setting"),
        ("unlearning.max_attempts=1", "fixed at 3"),
        ("engine.client_cpus=2", "engine.client_cpus"),
    ],
)
def test_a_settled_key_at_another_value_is_a_one_line_error(override, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as info:
        load_config(None, [override])
    assert "\n" not in str(info.value)


def test_a_key_under_both_names_must_agree():
    with pytest.raises(ConfigError, match="silos.jitter is now lab.speed.jitter"):
        load_config(None, ["silos.jitter=0.2", "lab.speed.jitter=0.3"])
    assert load_config(None, ["silos.jitter=0.2"]).lab.speed.jitter == 0.2


def test_the_second_round_of_earlier_names_loads_as_today(tmp_path):
    # Prepare: a run folder's config.yaml of the round before (every key written, as a run
    # writes it), then overrides under the earlier names in a later layer
    saved = tmp_path / "config.yaml"
    saved.write_text(
        "run: {plots: true, tensorboard: true, mlflow: false, compare_sync: true}\n"
        "server: {offline_retry_s: 4.0}\n"
        "silos: {count: 4, speed_profile: lognormal}\n"
        "client: {dp: {delta: 1.0e-05, accountant: rdp}}\n"
        "data: {test_fraction: 0.2}\n"
        "unlearning: {radius: 1.5, service: false, address: '127.0.0.1:50151'}\n"
    )
    # Execute / Assert: the saved config alone
    cfg = load_config(saved)
    assert cfg.run.trackers == ["plots", "tensorboard"] and cfg.lab.offline_retry_s == 4.0
    assert (cfg.lab.compare_sync, cfg.lab.speed.profile) == (True, "lognormal")
    assert (cfg.lab.erasure.radius, cfg.unlearning.address, cfg.unlearning.service) == (
        1.5,
        None,
        False,
    )
    # the service turned on in a later layer, at the address the saved config named
    cfg = load_config(saved, ["unlearning.service=true", "run.plots=false"])
    assert cfg.unlearning.address == "127.0.0.1:50151" and cfg.run.trackers == ["tensorboard"]
    # today's form in a later layer
    cfg = load_config(saved, ["unlearning.address=127.0.0.1:0", "run.trackers=[mlflow]"])
    assert cfg.unlearning.address == "127.0.0.1:0" and cfg.run.trackers == ["mlflow"]
    assert load_config(None, ["unlearning.service=true"]).unlearning.address == "127.0.0.1:50151"
    # DP-SGD turned on the earlier way: at the noise given, else 1.0; or the target epsilon
    dp = load_config(saved, ["client.dp.enabled=true"]).client.dp
    assert (dp.enabled, dp.noise_multiplier, dp.target_epsilon) == (True, 1.0, None)
    dp = load_config(None, ["client.dp.enabled=true", "client.dp.target_epsilon=2.0"]).client.dp
    assert (dp.noise_multiplier, dp.target_epsilon) == (None, 2.0)
    assert not load_config(saved).client.dp.enabled
    for old in ("client.dp.delta=1e-6", "client.dp.accountant=prv", "data.test_fraction=0.3"):
        with pytest.raises(ConfigError, match="is no longer a setting"):
            load_config(None, [old])
