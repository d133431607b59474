"""flower_commands.flwr_json: the one place a Control API command (``flwr ls``, ``flwr stop``,
``flwr supernode register``) is run and asked again while a SuperLink that listens cannot answer
yet. The stand-in for ``flwr`` is a shell script (``wrap`` runs it in flwr's place): what is
tested is the retry and the reading of the answer, not Flower."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from fedasync.processes import Processes
from simulations import flower_commands
from simulations.flower_commands import DeployError, flwr_cli, flwr_json, register_nodes


def _stand_in(tmp_path: Path, behaviour: str) -> list[str]:
    """A ``flwr`` stand-in: each call appends its arguments to calls.log; ``behaviour`` (shell)
    decides what it prints, with $N the number of calls with these arguments so far."""
    script = tmp_path / "flwr.sh"
    script.write_text(
        textwrap.dedent(
            f"""\
            log={tmp_path}/calls.log
            echo "$*" >> "$log"
            N=$(grep -cxF -- "$*" "$log")
            {behaviour}
            """
        )
    )
    return ["bash", str(script)]


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls.log").read_text().splitlines()


@pytest.fixture
def procs(tmp_path):
    p = Processes(marker=f"{tmp_path}:flwr-json")
    yield p
    assert p.stop() == []


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch):
    monkeypatch.setattr(flower_commands.time, "sleep", lambda s: None)


def test_a_command_the_superlink_cannot_answer_yet_is_asked_again(tmp_path, procs):
    # Prepare: `ls` is unavailable on its first call; `stop 3` answers at once
    ok = json.dumps({"success": True, "runs": []})
    flwr = _stand_in(
        tmp_path,
        f"""case "$1" in
              ls) if [ "$N" -lt 2 ]; then echo "Connection to the SuperLink is unavailable";
                  else echo 'flwr: {ok}'; fi;;
              *) echo '{ok}';;
            esac""",
    )
    wrap = lambda argv: [*flwr, *argv[1:]]  # noqa: E731
    # Execute
    answers = flwr_json(procs, tmp_path / "cli", {"ls": ["ls"], "stop": ["stop", "3"]}, wrap)
    # Assert: both answered, read past what flwr printed before its JSON; only `ls` ran twice
    assert answers == {"ls": json.loads(ok), "stop": json.loads(ok)}
    calls = _calls(tmp_path)
    assert sum(c.startswith("ls ") for c in calls) == 2
    assert sum(c.startswith("stop 3 ") for c in calls) == 1
    assert all(c.endswith(f"{flower_commands.FEDERATION} --format json") for c in calls)


def test_a_failure_is_not_retried_and_says_what_failed(tmp_path, procs):
    flwr = _stand_in(tmp_path, 'echo "Run 7 not found"; echo \'{"success": false}\'')
    with pytest.raises(DeployError, match=r"flwr stop 7 failed:(.|\n)*Run 7 not found"):
        flwr_cli(procs, tmp_path / "cli", ["stop", "7"], lambda a: [*flwr, *a[1:]])
    assert len(_calls(tmp_path)) == 1


def test_a_superlink_that_never_answers_fails_after_the_tries(tmp_path, procs, monkeypatch):
    monkeypatch.setattr(flower_commands, "REGISTER_TRIES", 3)
    flwr = _stand_in(tmp_path, 'echo "Connection to the SuperLink is unavailable"')
    with pytest.raises(DeployError, match="unavailable"):
        flwr_cli(procs, tmp_path / "cli", ["ls"], lambda a: [*flwr, *a[1:]])
    assert len(_calls(tmp_path)) == 3


def test_register_nodes_reads_each_node_id(tmp_path, procs):
    # Prepare: the id is the key file's name length, the first call of "b" unavailable
    flwr = _stand_in(
        tmp_path,
        """if [ "$5" = b ] && [ "$N" -lt 2 ]; then echo "SuperLink is unavailable"; exit 1; fi
            echo "{\\"success\\": true, \\"node-id\\": ${#3}}\"""",
    )
    keys = {"a": tmp_path / "k.pub", "b": tmp_path / "key.pub"}
    # Execute
    ids = register_nodes(procs, tmp_path / "cli", keys, lambda a: [*flwr, *a[1:]])
    # Assert
    assert ids == {"a": len(str(keys["a"])), "b": len(str(keys["b"]))}
    assert sum(" --name b " in c for c in _calls(tmp_path)) == 2
