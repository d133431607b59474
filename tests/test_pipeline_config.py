"""The pipeline trainer's typed config: defaults, YAML and overrides in order, errors that name
the key, the drift rule, and a docstring under every field."""

import ast
import inspect
import textwrap
from dataclasses import fields, is_dataclass

import pytest

from fedasync.errors import ConfigError
from fedasync.ranges import numeric_values
from trainers.pipeline import config as pc
from trainers.pipeline.config import (
    PipelineConfig,
    load_pipeline_config,
    to_container,
)


def test_the_defaults_load_and_validate():
    cfg = load_pipeline_config()

    assert cfg == PipelineConfig()
    assert (cfg.pipeline.schedule, cfg.pipeline.stages, cfg.pipeline.micro) == ("paci", 2, 4)
    assert cfg.pipeline.backend == "processes" and cfg.optim.name == "adamw"
    assert cfg.run.steps == 200 and cfg.data.batch == 16 and cfg.faults.kill_stage == -1
    out = to_container(cfg)
    assert isinstance(out, dict) and out["pipeline"]["schedule"] == "paci"
    assert set(out) == {"run", "model", "data", "pipeline", "optim", "correction", "faults"}


def test_yaml_then_overrides_layer_in_order(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline:\n  schedule: 2bw\n  micro: 8\noptim:\n  name: muon\n  lr: 0.01\n"
        "run:\n  resume: true\n"
    )

    cfg = load_pipeline_config(path, ["optim.lr=0.02", "data.batch=32"])

    assert cfg.pipeline.schedule == "2bw"  # file over default
    assert cfg.pipeline.micro == 8  # file over default
    assert cfg.optim.name == "muon"
    assert cfg.optim.lr == 0.02  # override over file
    assert cfg.data.batch == 32  # override over default
    assert cfg.run.resume is True
    assert cfg.model.d_model == 128  # default kept


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["pipeline.nope=3"], "pipeline.nope"),
        (["nope.x=1"], "nope"),
        (["pipeline.micro=many"], "pipeline.micro"),
        (["run.resume=maybe"], "run.resume"),
        (["pipeline.micro=0"], "pipeline.micro"),
        (["pipeline.stages=0"], "pipeline.stages"),
        (["pipeline.stages=5"], "pipeline.stages"),  # more stages than model.n_layers=4
        (["pipeline.delay=2"], "pipeline.delay"),
        (["pipeline.max_drift=0"], "pipeline.max_drift"),
        (["pipeline.schedule=zb"], "pipeline.schedule"),
        (["pipeline.backend=ray"], "pipeline.backend"),
        (["pipeline.comm=mpi"], "pipeline.comm"),
        (["pipeline.comm=nccl", "run.device=cpu"], "pipeline.comm"),
        (["run.device=tpu"], "run.device"),
        (["run.steps=0"], "run.steps"),
        (["run.threads=0"], "run.threads"),
        (["run.checkpoint_every=-1"], "run.checkpoint_every"),
        (["model.n_heads=3"], "model.n_heads"),
        (["data.val_fraction=0"], "data.val_fraction"),
        (["data.val_fraction=0.6"], "data.val_fraction"),
        (["data.batch=10"], "pipeline.micro"),  # 10 is not divisible by 4
        (["optim.name=sgd"], "optim.name"),
        (["optim.lr=0"], "optim.lr"),
        (["optim.momentum=1"], "optim.momentum"),
        (["optim.weight_decay=-0.1"], "optim.weight_decay"),
        (["optim.warmup=-1"], "optim.warmup"),
        (["optim.muon_dtype=float16"], "optim.muon_dtype"),
        (["optim.muon_dtype=fp32"], "optim.muon_dtype"),
        (["correction.beta=2.5"], "correction.beta"),
        (["faults.kill_stage=-2"], "faults.kill_stage"),
        (["faults.kill_stage=2"], "faults.kill_stage"),  # only stages 0 and 1
        (["faults.kill_stage=1", "pipeline.backend=emulate"], "faults.kill_stage"),
        (["faults.kill_stage=1", "faults.kill_at_step=200"], "faults.kill_at_step"),
        (["faults.kill_at_step=-1"], "faults.kill_at_step"),
    ],
)
def test_a_bad_value_is_a_one_line_config_error_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_pipeline_config(None, overrides)

    assert key in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_an_override_without_equals_sign_shows_an_example():
    with pytest.raises(ConfigError, match=r"is not key=value \(e\.g\. pipeline\.schedule=paci\)"):
        load_pipeline_config(None, ["pipeline.micro"])


def test_a_missing_or_non_mapping_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_pipeline_config(tmp_path / "none.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must map keys to values"):
        load_pipeline_config(listing)


def test_paci_beyond_its_drift_bound_names_the_smallest_micro_that_keeps_it():
    # 4 stages, 1 micro-batch: stage 0 steps ceil(3 / 1) = 3 times between F and B
    with pytest.raises(ConfigError) as e:
        load_pipeline_config(None, ["model.n_layers=4", "pipeline.stages=4", "pipeline.micro=1"])

    msg = str(e.value)
    assert "pipeline.micro" in msg and "pipeline.max_drift=1" in msg
    assert "smallest pipeline.micro that keeps it is 3" in msg

    # with that micro (and a batch it divides) it loads; a looser bound also does
    ok = ["pipeline.stages=4", "pipeline.micro=3", "data.batch=12"]
    assert load_pipeline_config(None, ok).pipeline.micro == 3
    loose = ["pipeline.stages=4", "pipeline.micro=2", "pipeline.max_drift=2"]
    assert load_pipeline_config(None, loose).pipeline.max_drift == 2


def test_the_drift_bound_constrains_only_paci():
    for schedule in ("gpipe", "1f1b", "2bw"):
        cfg = load_pipeline_config(
            None, [f"pipeline.schedule={schedule}", "pipeline.stages=4", "pipeline.micro=1"]
        )
        assert cfg.pipeline.schedule == schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_error_feedback_on_a_synchronous_schedule_is_an_error(schedule):
    with pytest.raises(ConfigError, match="correction.error_feedback") as e:
        load_pipeline_config(
            None, [f"pipeline.schedule={schedule}", "correction.error_feedback=true"]
        )
    assert schedule in str(e.value)


@pytest.mark.parametrize("schedule", ["2bw", "paci"])
def test_error_feedback_on_a_delayed_schedule_loads(schedule):
    cfg = load_pipeline_config(
        None,
        [f"pipeline.schedule={schedule}", "correction.error_feedback=true", "correction.beta=0.5"],
    )
    assert cfg.correction.error_feedback and cfg.correction.beta == 0.5


def test_a_killed_stage_within_the_run_loads():
    cfg = load_pipeline_config(None, ["faults.kill_stage=1", "faults.kill_at_step=10"])
    assert (cfg.faults.kill_stage, cfg.faults.kill_at_step) == (1, 10)


def test_every_numeric_key_has_a_declared_range():
    keys = {rkey for rkey, _, _ in numeric_values(PipelineConfig())}

    assert keys - set(pc.RANGES) == set()
    assert set(pc.RANGES) - keys == set()  # and no range names a key that does not exist


def _sections():
    cfg = PipelineConfig()
    return [type(getattr(cfg, f.name)) for f in fields(cfg) if is_dataclass(getattr(cfg, f.name))]


def _documented_fields(cls) -> set[str]:
    """The fields with a docstring under them, in ``cls`` and the classes it extends
    (a section may extend the run kit's common keys)."""
    documented = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, after in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
                and after.value.value.strip()
            ):
                documented.add(stmt.target.id)
    return documented


def test_every_field_of_every_section_has_a_docstring():
    sections = _sections()
    assert len(sections) == 7

    undocumented = []
    for cls in sections:
        documented = _documented_fields(cls)
        undocumented += [
            f"{cls.__name__}.{f.name}" for f in fields(cls) if f.name not in documented
        ]

    assert undocumented == []


def test_no_string_choice_is_a_yaml_boolean():
    yaml_bools = {"on", "off", "yes", "no", "true", "false", "y", "n"}
    choices = {*pc.BACKENDS, *pc.COMMS, *pc.DEVICES, *pc.OPTIMIZERS, *pc.SCHEDULES, *pc.MUON_DTYPES}

    assert choices & yaml_bools == set()
