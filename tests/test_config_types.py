"""Config types say what they allow: every choice is a Literal (the core's own where the choice
is a core table), every config dataclass checks itself when built (by omegaconf, by
``dataclasses.replace``, by hand) naming the key, and nothing changes a config once built.

The choice fields are found from the dataclasses' type hints, so a new Literal field of
FedAsyncConfig, RLConfig or PipelineConfig is covered here without being listed.
"""

from __future__ import annotations

import copy
import logging
import typing
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from fedasync.errors import ConfigError
from fedasync.optim import OPTIMIZER_KINDS, OptimizerKind, ServerOptimizer
from fedasync.staleness import WEIGHT_FUNCTIONS, WeightFnName
from server import config as sc
from server import config_erasure as sce
from server.config import FedAsyncConfig, choices, from_container
from server.config_lab import FaultConfig, LabConfig
from trainers.pipeline import config as pc
from trainers.pipeline.config import PipelineConfig, load_pipeline_config
from trainers.rl import config as rc
from trainers.rl.config import RLConfig, load_rl_config

OURS = {
    "server.config",
    "server.config_erasure",
    "server.config_lab",
    "trainers.rl.config",
    "trainers.pipeline.config",
}
"""The modules whose choice fields omegaconf is shown as ``Annotated[str, Literal]``."""


def _choice_fields(cls: type, prefix: str = "") -> list[tuple[str, type, str, tuple[Any, ...]]]:
    """``(key, owner class, field, allowed values)`` of every choice field under ``cls``; an
    entry of a list of sections is ``name[].field``."""
    out = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if typing.get_origin(tp) is list and is_dataclass(typing.get_args(tp)[0]):
            out += _choice_fields(typing.get_args(tp)[0], f"{key}[].")
        elif is_dataclass(tp):
            out += _choice_fields(tp, f"{key}.")
        elif choices(tp):
            out.append((key, cls, f.name, choices(tp)))
    return out


SCHEMAS = {"fed": FedAsyncConfig, "rl": RLConfig, "pipeline": PipelineConfig}
FIELDS = [(name, *row) for name, cls in SCHEMAS.items() for row in _choice_fields(cls)]
IDS = [f"{name}:{key}" for name, key, *_ in FIELDS]

COMPANIONS = {
    ("rl", "rollout.clock", "wall"): ["rollout.backend=ray"],
    ("rl", "policy.kind", "hf"): ["policy.hf_config={n_layer: 1}"],
}
"""Other keys a choice needs to load (a cross-key rule, not the choice's own check)."""


def _nested(key: str, value: Any) -> dict[str, Any]:
    """The container that sets dotted ``key`` (``a[].b``: in a one-entry list) to ``value``."""
    head, _, rest = key.partition(".")
    inner = _nested(rest, value) if rest else value
    if head.endswith("[]"):
        return {head[:-2]: [inner]}
    return {head: inner}


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    """Merge nested dict ``more`` into ``into``."""
    for k, v in more.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _load(schema: str, key: str, value: str) -> Any:
    """The schema's config with ``key=value``, through the loader a user's input goes
    through (omegaconf builds the dataclasses; FedAsyncConfig without preflight's files)."""
    extra = COMPANIONS.get((schema, key, value), [])
    if schema == "fed":
        container = _nested(key, value)
        for pair in extra:
            k, _, v = pair.partition("=")
            _merge(container, _nested(k, v))
        return from_container(container)
    load = load_rl_config if schema == "rl" else load_pipeline_config
    return load(None, [f"{key}={value}", *extra])


def _replaced(cfg: Any, key: str, value: Any) -> Any:
    """``cfg`` with dotted ``key`` set to ``value`` by ``dataclasses.replace`` (``a[].b``:
    ``a`` becomes one default entry with ``b`` set), built inside out as a caller would."""
    head, _, rest = key.partition(".")
    if head.endswith("[]"):
        name = head[:-2]
        (item_cls,) = typing.get_args(typing.get_type_hints(type(cfg))[name])
        return replace(cfg, **{name: [_replaced(item_cls(), rest, value)]})
    if not rest:
        return replace(cfg, **{head: value})
    return replace(cfg, **{head: _replaced(getattr(cfg, head), rest, value)})


def test_the_choice_fields_are_found():
    keys = {f"{name}:{key}" for name, key, *_ in FIELDS}

    assert len(FIELDS) >= 20
    assert {
        "fed:server.mode",
        "fed:server.staleness.fn",
        "fed:server.optimizer.kind",
        "fed:lab.speed.profile",
        "fed:lab.faults[].kind",
        "fed:unlearning.method",
        "fed:lab.erasure.radius_scaling",
        "fed:lab.erasure.signature_dtype",
        "fed:lab.erasure.pre_boundary",
        "rl:rollout.mode",
        "rl:learner.weight_fn",
        "rl:distill.loss",
        "pipeline:pipeline.schedule",
        "pipeline:optim.name",
    } <= keys


@pytest.mark.parametrize(("schema", "key", "owner", "name", "allowed"), FIELDS, ids=IDS)
def test_a_wrong_choice_is_refused_naming_its_key(schema, key, owner, name, allowed):
    shown = key.replace("[]", "[0]")

    with pytest.raises(ConfigError, match=shown.replace("[", r"\[").replace("]", r"\]")):
        _load(schema, key, "not-a-choice")
    with pytest.raises(ConfigError, match=shown.replace("[", r"\[").replace("]", r"\]")):
        _replaced(SCHEMAS[schema](), key, "not-a-choice")  # replace() checks too


@pytest.mark.parametrize(("schema", "key", "owner", "name", "allowed"), FIELDS, ids=IDS)
def test_every_allowed_choice_loads(schema, key, owner, name, allowed):
    for value in allowed:
        cfg = _load(schema, key, value)

        got = cfg
        for part in key.split("."):
            got = getattr(got, part[:-2])[0] if part.endswith("[]") else getattr(got, part)
        assert got == value


@pytest.mark.parametrize(("schema", "key", "owner", "name", "allowed"), FIELDS, ids=IDS)
def test_omegaconf_sees_a_str_so_the_message_is_the_sections(schema, key, owner, name, allowed):
    if owner.__module__ not in OURS:
        pytest.skip(f"{owner.__module__} is not one of the modules with that convention")

    plain = typing.get_type_hints(owner)[name]  # what omegaconf reads
    full = typing.get_type_hints(owner, include_extras=True)[name]

    assert plain is str
    assert typing.get_origin(full) is typing.Annotated
    node = OmegaConf.structured(owner)._get_node(name)
    assert type(node).__name__ == "StringNode"


def test_the_core_tables_are_their_literals():
    assert tuple(WEIGHT_FUNCTIONS) == typing.get_args(WeightFnName)
    assert OPTIMIZER_KINDS == typing.get_args(OptimizerKind)
    assert typing.get_type_hints(ServerOptimizer)["kind"] == OptimizerKind
    hints = {f"{s}:{k}": a for s, k, _, _, a in FIELDS}
    assert hints["fed:server.staleness.fn"] == typing.get_args(WeightFnName)
    assert hints["rl:learner.weight_fn"] == typing.get_args(WeightFnName)
    assert hints["fed:server.optimizer.kind"] == typing.get_args(OptimizerKind)


def test_the_other_tables_equal_the_literals_that_name_them():
    from fedasync.unlearning import SHARE_RULES
    from trainers.pipeline.optim import OPTIMIZERS
    from trainers.pipeline.schedule import SCHEDULES
    from trainers.rl.tasks import TASKS

    assert choices(sce.RadiusScaling) == tuple(SHARE_RULES)
    assert rc.TASK_NAMES == TASKS
    assert choices(pc.Schedule) == tuple(SCHEDULES)
    assert pc.OPTIMIZERS == OPTIMIZERS


def test_a_parse_leaves_its_input_untouched(tmp_path):
    # Prepare
    data = {
        "server": {"mode": "fedbuff", "staleness": {"fn": "hinge"}},
        "silos": {"count": 4},
        "lab": {"exclude": [1], "faults": [{"kind": "nan", "silo": 2}]},
    }
    before = copy.deepcopy(data)
    path = tmp_path / "rl.yaml"
    path.write_text("rollout:\n  mode: async\n")
    overrides = ["rollout.workers=4", "learner.correction=tis"]

    # Execute
    cfg = from_container(data)
    rl = load_rl_config(path, overrides)
    pipe_overrides = ["pipeline.schedule=2bw"]
    pipe = load_pipeline_config(None, pipe_overrides)

    # Assert
    assert data == before
    assert cfg.lab.exclude == [1] and cfg.lab.exclude is not data["lab"]["exclude"]
    assert path.read_text() == "rollout:\n  mode: async\n"
    assert overrides == ["rollout.workers=4", "learner.correction=tis"]
    assert pipe_overrides == ["pipeline.schedule=2bw"] and pipe.pipeline.schedule == "2bw"
    assert (rl.rollout.mode, rl.rollout.workers, rl.learner.correction) == ("async", 4, "tis")


def test_the_rl_backend_fallback_returns_a_new_config(monkeypatch, caplog):
    # Prepare: no Ray
    import trainers.rl.ray_backend as rb
    from trainers.rl.cli import make_backend, with_backend

    monkeypatch.setattr(rb, "ray_available", lambda: "no ray in this test")
    cfg = load_rl_config(None, ["rollout.backend=ray", "rollout.clock=wall"])
    before = copy.deepcopy(cfg)

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedasync.rl"):
        used, backend = with_backend(cfg)
        again = make_backend(cfg)

    # Assert
    assert cfg == before
    assert backend is None and again is None
    assert (used.rollout.backend, used.rollout.clock) == ("local", "virtual")
    assert replace(used, rollout=before.rollout) == before  # nothing else differs


def test_deploy_prepare_returns_a_new_config(tmp_path, monkeypatch):
    # Prepare: a relative out_dir, the erasure service on
    from simulations.coordinator import write_run_config
    from simulations.deploy import prepare

    monkeypatch.chdir(tmp_path)
    cfg = from_container(
        {
            "run": {"out_dir": "runs", "name": "t", "progress": True},
            "silos": {"count": 2},
            "unlearning": {"service": True},
        }
    )
    before = copy.deepcopy(cfg)

    # Execute
    used, run_dir, paths, _ = prepare(cfg, None)
    write_run_config(cfg, tmp_path / "run-config.toml")

    # Assert
    assert cfg == before
    assert used.run.out_dir == str(Path("runs").resolve()) and run_dir.is_absolute()
    u = used.unlearning
    assert (u.tls_certfile, u.tls_keyfile) == (str(paths.server_cert), str(paths.server_key))
    assert u.credentials == str(run_dir / "deploy" / "erasure" / "credentials.json")
    assert f"out_dir: {used.run.out_dir}" in (run_dir / "config.yaml").read_text()


def test_a_config_built_by_hand_is_checked_too():
    with pytest.raises(ConfigError, match="server.alpha"):
        sc.ServerConfig(alpha=0.0)
    with pytest.raises(ConfigError, match=r"faults\[1\]\.silo"):
        FedAsyncConfig(lab=LabConfig(faults=[FaultConfig(), FaultConfig(silo=99)]))
    with pytest.raises(ConfigError, match="learner.minibatches"):
        RLConfig(learner=rc.LearnerSection(minibatches=1000))
    with pytest.raises(ConfigError, match="pipeline.micro"):
        replace(PipelineConfig(), data=pc.DataSection(batch=10))


@pytest.mark.parametrize("override", ["rollout.mode={a", "policy.hf_config={n_layer: 2", "x=[1"])
def test_an_override_that_is_not_yaml_is_one_line_naming_it(override):
    from trainers.rl.config import load_rl_config

    with pytest.raises(ConfigError, match="is not valid YAML") as e:
        load_rl_config(None, [override + "x" * 5000])
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and override[:10] in msg


def test_trigger_patterns_of_the_config_are_the_backdoors():
    from medical_data.backdoor import PATTERNS
    from server.config_lab import TRIGGER_PATTERNS

    assert TRIGGER_PATTERNS == PATTERNS
