"""A fourth trainer, written as docs/architecture.md tells a newcomer to: a config that extends
the run kit's common keys, a Recipe of about forty lines, and runkit.recipe.drive. It runs,
checkpoints, resumes to the same weights as a run never stopped, and writes its summary."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import pytest
import torch

from fedasync.errors import CheckpointError, ConfigError
from fedasync.events import read_events
from fedasync.interrupt import DeferredStop, Interrupted
from fedasync.seeds import torch_seed
from runkit.configload import load_structured, to_container
from runkit.folder import RunFolder
from runkit.keys import TrainerKeys
from runkit.recipe import drive


# ---- the toy trainer: fit y = 3x + 1 by SGD --------------------------------------------------
@dataclass
class ToyRun(TrainerKeys):
    name: str = "toy"
    steps: int = 30
    stop_at: int = -1  # the test's own Ctrl-C, at this step


@dataclass
class ToyConfig:
    run: ToyRun = field(default_factory=ToyRun)
    lr: float = 0.1


class Toy:
    def __init__(self, cfg: ToyConfig):
        self.cfg, self.step = cfg, 0

    def setup(self, folder: RunFolder) -> None:
        self.folder = folder
        torch.manual_seed(torch_seed(self.cfg.run.seed, "toy.init"))
        self.w = torch.randn(2, requires_grad=True)
        self.opt = torch.optim.SGD([self.w], lr=self.cfg.lr)

    def run(self, stop: DeferredStop) -> None:
        x = torch.linspace(-1, 1, 16)
        while self.step < self.cfg.run.steps:
            loss = ((self.w[0] * x + self.w[1] - (3 * x + 1)) ** 2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.step += 1
            assert self.folder.events is not None
            self.folder.events.write("step", step=self.step, loss=loss.item())
            if self.step == self.cfg.run.stop_at:
                os.kill(os.getpid(), signal.SIGINT)
            stop.check()  # the state is whole here

    def state_dict(self) -> dict:
        return {"w": self.w.detach().clone(), "opt": self.opt.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.w.copy_(state["w"])
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])

    def summary(self) -> dict:
        return {"steps": self.step, "w": self.w.tolist()}


def run_toy(tmp_path, *overrides: str) -> tuple[Toy, dict]:
    cfg = load_structured(ToyConfig, None, [f"run.out_dir={tmp_path}", *overrides], "lr=0.1")
    toy = Toy(cfg)
    return toy, drive(toy, cfg.run, to_container(cfg))


# ---- what the kit must give it ----------------------------------------------------------------
def test_the_toy_trainer_runs_and_writes_its_folder(tmp_path):
    toy, summary = run_toy(tmp_path)

    folder = tmp_path / "toy"
    assert summary["steps"] == 30
    assert abs(summary["w"][0] - 3) < 0.5 and abs(summary["w"][1] - 1) < 0.2  # it learnt
    assert (folder / "summary.json").is_file() and (folder / "checkpoint.pt").is_file()
    events = read_events(folder / "metrics.jsonl")
    assert [e["event"] for e in events[:1] + events[-1:]] == ["start", "end"]
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 31))


def test_a_stopped_toy_run_resumes_to_the_weights_of_one_never_stopped(tmp_path):
    whole, _ = run_toy(tmp_path / "whole")

    with pytest.raises(Interrupted) as stopped:
        run_toy(tmp_path / "cut", "run.stop_at=12")
    assert stopped.value.at_safe_point and stopped.value.checkpoint is not None
    resumed, summary = run_toy(tmp_path / "cut", "run.resume=true")

    assert torch.equal(resumed.w, whole.w)
    events = read_events(tmp_path / "cut" / "toy" / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 31))  # once each
    assert [e["event"] for e in events].count("resume") == 1
    assert summary["steps"] == 30


def test_a_resume_under_another_config_is_refused_by_name(tmp_path):
    with pytest.raises(Interrupted):
        run_toy(tmp_path, "run.stop_at=5")

    with pytest.raises(CheckpointError, match=r"lr \(0.1 there, 0.5 now\)"):
        run_toy(tmp_path, "run.resume=true", "lr=0.5")
    with pytest.raises(CheckpointError, match="does not exist"):
        run_toy(tmp_path / "elsewhere", "run.resume=true")


def test_the_common_run_keys_are_checked_for_every_trainer(tmp_path):
    with pytest.raises(ConfigError, match="run.device"):
        run_toy(tmp_path, "run.device=tpu")
    with pytest.raises(ConfigError, match="run.name"):
        run_toy(tmp_path, "run.name=a/b")
