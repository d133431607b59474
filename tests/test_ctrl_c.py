"""One Ctrl-C ends every command: a few moments of ``tests/ctrl_c_sweep.py`` in the suite.

The sweep itself sends SIGINT at 20 moments of each command (``python tests/ctrl_c_sweep.py``,
minutes per command); here the moments that differ in kind, cheaply:

- during the imports (torch, MONAI and Flower load for seconds before any command starts):
  every command, one line and exit 130, no traceback;
- ``deploy local`` while training (its SuperLink, SuperNodes, warm workers and ServerApp);
- ``simulate`` while its sync baseline runs (after the main run finished, before the plots).

Ctrl-C during training is also ``tests/test_run_ending.py``'s (simulate, with resume) and
``tests/test_trainers_ending.py``'s (rl, pipeline, market).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ctrl_c_sweep import COMMANDS, _any_event, one_moment


def _check(result: dict) -> None:
    assert result["ok"], f"{result['problems']}\n{result.get('stderr_tail', '')}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_ctrl_c_while_the_command_imports(name, tmp_path):
    # Execute: 0.5 s in, once the interpreter is loading torch (simulations.cli's imports:
    # torch, MONAI, Flower)
    result = one_moment(COMMANDS[name], tmp_path, 0, at_s=0.5, importing=True)
    # Assert
    _check(result)
    assert result["rc"] == 130 and not result["trained"]
    assert result["line"].startswith("fedasync")


@pytest.mark.slow
def test_ctrl_c_while_a_deployment_trains_names_its_checkpoint(tmp_path):
    def checkpointed(out: Path) -> bool:
        return _any_event(out / "r", {"checkpoint"})

    result = one_moment(COMMANDS["deploy"], tmp_path, 0, at_s=0.0, until=checkpointed)
    _check(result)
    assert result["rc"] == 130 and result["trained"]
    assert "resume with: fedasync deploy local --config" in result["line"]
    assert "run.resume=true" in result["line"]


@pytest.mark.slow
def test_ctrl_c_while_the_sync_baseline_runs(tmp_path):
    def baseline(out: Path) -> bool:
        return _any_event(out / "r" / "baseline-sync", {"update"})

    result = one_moment(COMMANDS["simulate"], tmp_path, 0, at_s=0.0, until=baseline)
    _check(result)
    assert result["rc"] == 130 and result["trained"]
    assert "run.resume=true" in result["line"]
