"""The metrics sinks (runkit.sinks): real runs read back from their TensorBoard event files
(TensorBoard's own EventAccumulator) and checked against their metrics.jsonl, tag by tag; the
docs' tag table against the code's; the tail of a live log; a sink that fails."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedasync.errors import ConfigError
from fedasync.events import EventLog, read_events
from runkit.keys import RunKeys
from runkit.sinks import follow, tags, tensorboard_sink
from runkit.sinks.follow import Follower, start_following
from runkit.tail import EventTail

ROOT = Path(__file__).resolve().parent.parent


def _board(logdir: Path) -> tuple[dict[str, list[tuple[int, float, float]]], list[str]]:
    """Every scalar of the TensorBoard run in ``logdir`` as (step, value, wall time), and its
    image tags."""
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    scalars = {
        t: [(s.step, s.value, s.wall_time) for s in ea.Scalars(t)] for t in ea.Tags()["scalars"]
    }
    return scalars, sorted(ea.Tags()["images"])


def _values(board: dict, tag: str) -> list[tuple[int, float]]:
    return [(step, value) for step, value, _ in board[tag]]


def _as_logged(family: str, events: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What the table makes of ``events``, by tag: what the event files must hold."""
    out: dict[str, list[tuple[int, float]]] = {}
    stream = follow.Stream("", EventTail(Path("unused")))
    for tag, value, step, _ in stream.rows(family, events, 0.0):
        out.setdefault(tag, []).append((step, value))
    return out


def _same(board: dict, expected: dict[str, list[tuple[int, float]]]) -> None:
    """The event files hold exactly ``expected`` (float32 in TensorBoard's files)."""
    assert sorted(board) == sorted(expected)
    for tag, rows in expected.items():
        got = _values(board, tag)
        assert [s for s, _ in got] == [s for s, _ in rows], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in rows], rel=1e-6), tag


def _all_in_table(board: dict, family: str) -> None:
    unknown = [t for t in board if tags.match(t, family) is None]
    assert unknown == [], f"tags not in runkit.sinks.tags.TAGS: {unknown}"


@pytest.fixture
def sink_warnings():
    """The warnings the sinks log (fedasync.sinks), whatever a run did to the fedasync logger."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("fedasync.sinks")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


# ------------------------------------------------------------------- the table and its docs


def test_the_docs_tag_table_is_the_codes():
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert tags.markdown() in page, "docs/metrics.md: paste `python -m runkit.sinks`'s table"


def test_every_tag_name_fits_its_own_pattern_and_no_other_familys():
    for row in tags.TAGS:
        example = row.tag.replace("<", "").replace(">", "")
        assert tags.match(example, row.family) is not None, row.tag
    assert tags.match("fed/score", "rl") is None
    assert (
        tags.match("fed/updates/rejected/too_stale", "fed").tag == "fed/updates/rejected/<reason>"
    )


# ------------------------------------------------------------------- a live log's tail


def test_the_tail_waits_for_a_torn_line_and_skips_a_bad_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = EventTail(path)
    assert tail.poll() == []
    path.write_bytes(b'{"event": "a"}\nnot json\n{"event": "b", "x": 1')
    assert [e["event"] for e in tail.poll()] == ["a"]  # the bad line skipped, "b" still coming
    with open(path, "ab") as f:
        f.write(b"}\n")
    assert [e["event"] for e in tail.poll()] == ["b"]
    assert tail.generation == 0


def test_the_tail_follows_a_log_cut_back_and_regrown_past_where_it_was(tmp_path):
    # Prepare: a resumed run cuts its log back to the checkpoint and writes on, past the
    # offset the tail had reached, before the tail looks again
    path = tmp_path / "metrics.jsonl"
    log = EventLog(path)
    for v in range(4):
        log.write("eval", version=v, score=0.1 * v)
    tail = EventTail(path)
    assert len(tail.poll()) == 4
    log.truncate(len(path.read_bytes().split(b"\n")[0]) + 1)  # back to the first event
    for v in range(1, 8):
        log.write("eval", version=v, score=0.5 + v)
    log.close()

    # Execute
    new = tail.poll()

    # Assert: the log read again from its start, once
    assert tail.generation == 1
    assert [e["version"] for e in new] == list(range(8))
    assert tail.poll() == []


# ------------------------------------------------------------------- simulate, in process


def _in_process(cfg, run_dir):
    """`launcher.run_engine` without Ray: the real server loop and ClientApp in this process."""
    from inprocess import InProcessGrid

    from clients.app import app as client_app
    from server.app import run_server

    return run_server(InProcessGrid(client_app, cfg.silos.count), cfg, run_dir)


def test_a_simulate_run_and_its_baseline_in_tensorboard(small_cfg, tmp_path, monkeypatch, capsys):
    # Prepare: a short run with a fault (a rejection), an erasure and its sync baseline, the
    # silos' own node logs on (as `fedasync node` sets them)
    from clients.node_log import NODE_EVENTS_ENV
    from simulations import launcher

    monkeypatch.setattr(launcher, "run_engine", _in_process)
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    monkeypatch.setenv(NODE_EVENTS_ENV, str(node_dir / "metrics.jsonl"))
    cfg = small_cfg(
        "run.max_versions=12",
        "lab.compare_sync=true",
        "server.evaluate_silos=true",
        "lab.faults=[{kind: nan, silo: 1, at_version: 2}]",
        "erasures=[{silo: 0, at_s: 5}]",
    )
    run_dir = tmp_path / "t"

    # Execute
    launcher.simulate(cfg)

    # Assert: the start line, then the run's own TensorBoard run against its metrics.jsonl
    out = capsys.readouterr().out
    board_dir = run_dir / "tensorboard"
    assert f"TensorBoard: {board_dir} (live); view with: tensorboard --logdir {board_dir}" in out
    events = read_events(run_dir / "metrics.jsonl")
    board, images = _board(board_dir)
    _all_in_table(board, "fed")
    _same(board, _as_logged("fed", events))
    evals = [e for e in events if e["event"] == "eval"]
    updates = [e for e in events if e["event"] == "update"]
    rejects = [e for e in events if e["event"] == "reject"]
    erasures = [e for e in events if e["event"] == "erasure"]
    assert _values(board, "fed/score") == [(e["version"], pytest.approx(e["score"])) for e in evals]
    assert _values(board, "fed/staleness") == [(e["version"], e["staleness"]) for e in updates]
    assert board["fed/updates/accepted"][-1][1] == len(updates)
    assert rejects and board["fed/updates/rejected/non_finite"][-1][1] == len(rejects)
    for silo in {e["silo"] for e in updates}:
        weight = sum(e["weight"] for e in updates if e["silo"] == silo)
        assert board[f"fed/silo/{silo}/contribution"][-1][1] == pytest.approx(weight, rel=1e-6)
    assert erasures and [v for _, v in _values(board, "fed/silo/0/erasure_state")] == [
        tags.ERASURE_STATES[e["state"]] for e in erasures
    ]
    assert len(board["fed/silo/2/score"]) == 1  # the final model on silo 2's own data
    # wall time: the run's start plus its (virtual) clock, so relative time is the run's clock
    walls = [w for _, _, w in board["fed/score"]]
    assert [w - walls[0] for w in walls] == pytest.approx([e["t"] for e in evals], abs=1e-3)
    assert images == [
        "images/accuracy_vs_time",
        "images/silo_contribution",
        "images/staleness_hist",
    ]
    # the sync baseline: a TensorBoard run of its own
    baseline = read_events(run_dir / "baseline-sync" / "metrics.jsonl")
    bboard, _ = _board(board_dir / "baseline-sync")
    _same(bboard, _as_logged("fed", baseline))
    assert len(bboard["fed/score"]) == sum(e["event"] == "eval" for e in baseline) > 1
    # the silos' own logs (one process here, so one file), followed as a node follows its own
    trains = [e for e in read_events(node_dir / "metrics.jsonl") if e["event"] == "train"]
    start_following(RunKeys(), "node", node_dir, fresh=False, echo=lambda s: None).close()
    nboard, _ = _board(node_dir / "tensorboard")
    _all_in_table(nboard, "node")
    ran = {(e["silo"], e["job"], e["version"], e["train_loss"]) for e in trains}
    for e in updates:  # every update the server took is a job its silo logged, loss and all
        assert (e["silo"], e["job"], e["version"] - e["staleness"], e["train_loss"]) in ran
    assert [v for _, v in _values(nboard, "node/train_loss")] == pytest.approx(
        [e["train_loss"] for e in trains], rel=1e-6
    )
    assert nboard["node/jobs"][-1][1] == len(trains)


# ------------------------------------------------------------------- trainers


RL_TINY = [
    "policy.d_model=32",
    "policy.n_layers=1",
    "policy.n_heads=2",
    "policy.warm_start_steps=40",
    "rollout.workers=2",
    "rollout.group_size=4",
    "rollout.batch_groups=2",
    "run.max_steps=4",
    "run.eval_every=2",
    "run.eval_prompts=8",
    "run.progress=false",
    "clock.gen_token_s=0.01",
    "clock.learn_token_s=0.002",
    "task.max_len=6",
]


def test_an_rl_run_in_tensorboard(tmp_path, capsys):
    from simulations.cli import main

    # Execute: the command, its plots on
    assert main(["rl", *RL_TINY, f"run.out_dir={tmp_path}", "run.name=r"]) == 0

    # Assert
    run_dir = tmp_path / "r"
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in capsys.readouterr().out
    events = read_events(run_dir / "metrics.jsonl")
    board, images = _board(run_dir / "tensorboard")
    _all_in_table(board, "rl")
    _same(board, _as_logged("rl", events))
    steps = [e for e in events if e["event"] == "step"]
    assert _values(board, "rl/reward") == [
        (e["version"], pytest.approx(e["reward"])) for e in steps
    ]
    assert _values(board, "rl/kl_behav") == [
        (e["version"], pytest.approx(e["kl_behav"], abs=1e-12)) for e in steps
    ]
    means = [
        sum(int(k) * n for k, n in e["staleness_hist"].items()) / sum(e["staleness_hist"].values())
        for e in steps
    ]
    assert [v for _, v in _values(board, "rl/staleness_mean")] == pytest.approx(means)
    assert [s for s, _ in _values(board, "rl/accuracy")] == [
        e["version"] for e in events if e["event"] == "eval"
    ]
    assert images == sorted(f"images/{p.stem}" for p in run_dir.glob("*.png")) != []


def test_a_pipeline_run_in_tensorboard_with_its_bubble(tmp_path):
    from simulations.cli import main

    argv = ["pipeline", "pipeline.backend=emulate", "model.d_model=32", "model.n_layers=2"]
    argv += ["model.n_heads=2", "model.context=32", "data.batch=8", "pipeline.micro=2"]
    argv += ["run.eval_batches=2", "run.progress=false", "run.steps=4", "run.eval_every=2"]
    argv += ["run.checkpoint_every=0", "run.plots=false", f"run.out_dir={tmp_path}", "run.name=p"]
    assert main(argv) == 0

    events = read_events(tmp_path / "p" / "metrics.jsonl")
    board, _ = _board(tmp_path / "p" / "tensorboard")
    _all_in_table(board, "pipeline")
    _same(board, _as_logged("pipeline", events))
    steps = [e for e in events if e["event"] == "step"]
    assert _values(board, "pipeline/loss") == [(e["step"], pytest.approx(e["loss"])) for e in steps]
    (measured,) = [e for e in events if e["event"] == "measured"]
    assert _values(board, "pipeline/bubble") == [(4, pytest.approx(measured["bubble_fraction"]))]
    summary = (tmp_path / "p" / "summary.json").read_text()
    assert str(measured["bubble_fraction"]) in summary  # the summary's own figure


def test_a_market_run_has_a_tensorboard_run_per_seed(tmp_path):
    from simulations.cli import main

    argv = ["market", "run.horizon=30", "run.window=10", "run.deviation_span=6", "run.seeds=2"]
    argv += ["run.workers=1", "run.progress=false", "run.plots=false", "agent.hidden=8"]
    argv += ["agent.warmup=8", "agent.batch_size=8", f"run.out_dir={tmp_path}", "run.name=m"]
    assert main(argv) == 0

    logs = sorted((tmp_path / "m").glob("*/seed-*/metrics.jsonl"))
    assert len(logs) == 2
    for log in logs:
        stream = log.parent.relative_to(tmp_path / "m")
        board, _ = _board(tmp_path / "m" / "tensorboard" / stream)
        events = read_events(log)
        _all_in_table(board, "market")
        _same(board, _as_logged("market", events))
        windows = [e for e in events if e["event"] == "window"]
        assert [v for _, v in _values(board, "market/price/1")] == pytest.approx(
            [e["prices"][1] for e in windows]
        )
        assert "market/delta" in board and "market/final_delta" in board


# ------------------------------------------------------------------- a recipe, MLflow, failures


class _Recipe:
    """A trainer on runkit.recipe.drive that writes a few events and a PNG."""

    def setup(self, folder):
        self.folder, self.steps = folder, 0

    def run(self, stop):
        from PIL import Image

        for step in range(1, 6):
            self.folder.events.write("step", step=step, loss=1.0 / step, note="text")
            self.steps = step
            time.sleep(0.01)
        Image.new("RGB", (8, 6), "red").save(self.folder.path / "loss.png")

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]

    def summary(self):
        return {"steps": self.steps}


def _drive(tmp_path, **keys):
    from runkit.recipe import drive

    k = RunKeys(name="toy", out_dir=str(tmp_path), **keys)
    return drive(_Recipe(), k, {"run": {"name": "toy"}, "model": {"width": 4}})


def test_a_trainer_on_the_recipe_gets_every_number_of_its_events(tmp_path, capsys):
    assert _drive(tmp_path) == {"steps": 5}

    board, images = _board(tmp_path / "toy" / "tensorboard")
    assert _values(board, "step/loss") == [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    _all_in_table(board, "trainer")
    assert images == ["images/loss"]


def test_mlflow_read_back_with_its_client(tmp_path, capsys):
    pytest.importorskip("mlflow.tracking", reason="mlflow is not installed: fedasync[mlflow]")
    from mlflow.tracking import MlflowClient

    # Execute: the default, a local store in the run folder
    _drive(tmp_path, trackers=["plots", "tensorboard", "mlflow"])

    # Assert
    run_dir = tmp_path / "toy"
    uri = f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    assert f"MLflow: run 'toy' in experiment 'fedasync trainer' at {uri}" in capsys.readouterr().out
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedasync trainer").experiment_id])
    assert run.info.run_name == "toy" and run.info.status == "FINISHED"
    assert run.data.params["model.width"] == "4"
    history = client.get_metric_history(run.info.run_id, "step/loss")
    assert [(m.step, m.value) for m in history] == [
        (s, pytest.approx(1.0 / s)) for s in range(1, 6)
    ]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/loss.png"]


def test_a_sink_that_fails_is_logged_once_and_the_run_goes_on(tmp_path, sink_warnings):
    # Prepare: the TensorBoard folder cannot be made (a file is in its way: as a full disk)
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "tensorboard").write_text("in the way")

    # Execute
    summary = _drive(tmp_path)

    # Assert: the run finished and wrote everything of its own; one line said why
    assert summary == {"steps": 5}
    assert (tmp_path / "toy" / "summary.json").exists()
    assert len(read_events(tmp_path / "toy" / "metrics.jsonl")) == 7  # start, 5 steps, end
    assert len(sink_warnings) == 1 and "TensorBoard" in sink_warnings[0].getMessage()


def test_a_sink_failing_midway_is_dropped_and_the_others_go_on(tmp_path, sink_warnings):
    class Broken:
        name = "Broken"

        def open(self):
            pass

        def scalars(self, stream, rows):
            raise OSError(28, "No space left on device")

    log = EventLog(tmp_path / "metrics.jsonl")
    board = tensorboard_sink.TensorBoardSink(tmp_path / "tensorboard")
    f = Follower(tmp_path, "rl", [Broken(), board], poll_s=0.05).start()
    for v in range(1, 4):
        log.write("step", version=v, reward=0.25 * v)
        time.sleep(0.1)  # polled between writes: every poll would fail again
    f.close()

    assert len(sink_warnings) == 1 and "No space left" in sink_warnings[0].getMessage()
    scalars, _ = _board(tmp_path / "tensorboard")
    assert _values(scalars, "rl/reward") == [(1, 0.25), (2, 0.5), (3, 0.75)]


def test_tensorboard_not_installed_is_said_once_and_the_run_goes_on(
    tmp_path, monkeypatch, sink_warnings
):
    monkeypatch.setattr(tensorboard_sink, "available", lambda: "ImportError: no tensorboard")

    assert _drive(tmp_path) == {"steps": 5}

    assert not (tmp_path / "toy" / "tensorboard").exists()
    assert len(sink_warnings) == 1 and "pip install tensorboard" in sink_warnings[0].getMessage()


def test_an_unreachable_mlflow_server_is_said_once_and_the_run_goes_on(tmp_path, sink_warnings):
    pytest.importorskip("mlflow.tracking", reason="mlflow is not installed: fedasync[mlflow]")

    assert _drive(
        tmp_path, trackers=["plots", "tensorboard", "mlflow"], mlflow_uri="http://127.0.0.1:9"
    ) == {"steps": 5}

    assert len(sink_warnings) == 1 and "MLflow" in sink_warnings[0].getMessage()
    assert _board(tmp_path / "toy" / "tensorboard")[0]["step/loss"]  # TensorBoard went on


def test_a_fresh_run_leaves_an_earlier_runs_log_alone_until_it_replaces_it(tmp_path):
    # Prepare: an earlier run's log
    old = EventLog(tmp_path / "metrics.jsonl")
    old.write("step", version=1, reward=9.0)
    old.close()
    board = tensorboard_sink.TensorBoardSink(tmp_path / "tensorboard")
    f = Follower(tmp_path, "rl", [board], fresh=True)

    # Execute: nothing read while it is there; the new run's log replaces it
    assert f.poll() == 0
    (tmp_path / "metrics.jsonl").unlink()
    new = EventLog(tmp_path / "metrics.jsonl")
    new.write("step", version=1, reward=0.5)
    new.close()
    f.close()

    # Assert
    assert _values(_board(tmp_path / "tensorboard")[0], "rl/reward") == [(1, 0.5)]


# ------------------------------------------------------------------- the keys, the commands


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        (
            {"trackers": ["mlflow"], "mlflow_uri": "http://a b"},
            "run.mlflow_uri='http://a b': a tracking URI",
        ),
        ({"trackers": ["mlflow"], "mlflow_uri": ""}, "run.mlflow_uri='': a tracking URI"),
        (
            {"mlflow_uri": "http://host:5000"},
            "run.mlflow_uri is set but run.trackers has no mlflow",
        ),
    ],
)
def test_the_sink_keys_are_checked(keys, words):
    with pytest.raises(ConfigError, match=words):
        RunKeys(**keys)


def test_every_run_kind_has_the_keys():
    from simulations.config import load_config
    from trainers.market.config import load_market_config
    from trainers.pipeline.config import load_pipeline_config
    from trainers.rl.config import load_rl_config

    for load in (load_config, load_rl_config, load_pipeline_config, load_market_config):
        cfg = load(None, ["run.mlflow=true", "run.mlflow_uri=http://host:5000"])
        assert (cfg.run.tensorboard, cfg.run.mlflow, cfg.run.mlflow_uri) == (
            True,
            True,
            "http://host:5000",
        )
        with pytest.raises(ConfigError, match="run.mlflow_uri"):
            load(None, ["run.mlflow_uri=http://host:5000"])
        # run.trackers, and the three booleans it replaced merged across layers
        cfg = load(None, ["run.trackers=[mlflow]", "run.mlflow_uri=http://host:5000"])
        assert (cfg.run.plots, cfg.run.tensorboard, cfg.run.mlflow) == (False, False, True)
        cfg = load(None, ["run.plots=false", "run.mlflow=true", "run.tensorboard=false"])
        assert cfg.run.trackers == ["mlflow"]
        with pytest.raises(ConfigError, match="run.trackers"):
            load(None, ["run.trackers=[png]"])


def test_fedasync_node_refuses_a_bad_mlflow_uri_in_one_line(tmp_path, capsys):
    from simulations.cli import main

    argv = ["node", "--superlink", "127.0.0.1:1", "--root-certificates", "ca.pem"]
    argv += ["--auth-key", "k", "--home", str(tmp_path / "n"), "--mlflow-uri", "a b"]
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--mlflow-uri" in err[0]
    assert not (tmp_path / "n").exists()  # refused before anything started


def test_fedasync_node_follows_the_hospitals_own_log(tmp_path, monkeypatch, capsys):
    # Prepare: the SuperNode replaced by a process that logs one job as the node's ClientApp
    # would, through the variable `fedasync node` gives its processes
    import sys

    from simulations import node
    from simulations.cli import main

    job = "import json, os; open(os.environ['FEDASYNC_NODE_EVENTS'], 'a').write(json.dumps("
    job += "{'event': 'train', 'wall': 1.0, 'version': 3, 'train_loss': 0.25}) + chr(10))"
    monkeypatch.setattr(node, "supernode_args", lambda *a, **k: [sys.executable, "-c", job])
    home = tmp_path / "hospital"

    # Execute
    argv = ["node", "--superlink", "127.0.0.1:1", "--root-certificates", "ca.pem"]
    code = main([*argv, "--auth-key", "k", "--workers", "flower", "--home", str(home)])

    # Assert
    assert code == 0
    assert f"TensorBoard: {home / 'tensorboard'} (live)" in capsys.readouterr().out
    board, _ = _board(home / "tensorboard")
    assert _values(board, "node/train_loss") == [(3, 0.25)]


def test_deploy_local_is_followed_live_from_its_own_process(tmp_path, monkeypatch):
    # Prepare: the deployment's processes faked (what is tested is the CLI's follower): its
    # ServerApp writes the run folder's events; the follower must see them while it "runs"
    from simulations import deploy
    from simulations.cli import main

    seen: list[bool] = []

    def fake_deploy_local(cfg, **kwargs):
        run_dir = Path(cfg.run.out_dir).resolve() / cfg.run.name
        log = EventLog(run_dir / "metrics.jsonl")
        for v in range(3):
            log.write("eval", t=2.0 * v, version=v, loss=1.0, score=0.3 + 0.1 * v)
        log.close()
        board, deadline = run_dir / "tensorboard", time.monotonic() + 10
        while time.monotonic() < deadline:
            if board.is_dir() and "fed/score" in _board(board)[0]:
                seen.append(True)
                break
            time.sleep(0.2)
        raise deploy.DeployError("the fake deployment ends here")

    from simulations import deploy_cli

    monkeypatch.setattr(deploy_cli, "deploy_local", fake_deploy_local)

    # Execute
    code = main(["deploy", "local", f"run.out_dir={tmp_path}", "run.name=d", "run.progress=false"])

    # Assert: seen while running, and all of it at the end
    assert code == 1 and seen == [True]
    board, _ = _board(tmp_path / "d" / "tensorboard")
    assert _values(board, "fed/score") == [
        (0, pytest.approx(0.3)),
        (1, pytest.approx(0.4)),
        (2, pytest.approx(0.5)),
    ]
