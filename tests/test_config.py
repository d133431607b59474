"""Configuration: defaults, overrides, and clear errors for bad keys and values."""

import pytest

from simulations.cli import main
from simulations.config import load_config


def test_default_config_is_valid():
    cfg = load_config()
    assert cfg.server.mode == "fedasync"
    assert cfg.data.benchmark == "brain-tissue"
    assert cfg.run.compare_sync is True


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
        ("silos.speed_profile=fast", "speed_profile"),
        ("faults=[{kind: meteor, silo: 0}]", "faults[0].kind"),
        ("faults=[{kind: crash, silo: 99}]", "faults[0].silo"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_cli_reports_bad_config(capsys):
    assert main(["simulate", "server.mode=gossip"]) == 2
    assert "server.mode" in capsys.readouterr().err
