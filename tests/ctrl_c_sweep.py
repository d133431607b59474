"""One Ctrl-C always ends a run: SIGINT at many moments of each command, every outcome checked.

    .venv/bin/python tests/ctrl_c_sweep.py                      # every command, 20 moments each
    .venv/bin/python tests/ctrl_c_sweep.py simulate rl --moments 5

For each command a tiny but real run is timed twice without a signal (the reference: the
faster of the two). Then the
command is started again ``--moments`` times and sent SIGINT to its whole process group (as a
terminal sends Ctrl-C) at moments spread evenly from 2% to 90% of the reference's wall time:
interpreter start-up and imports, Ray or the SuperLink starting, the data loading, training,
the baseline run, the plots, shutdown; and, for moments a time hits only by luck, as soon as a
phase begins (``simulate``: its sync baseline starting, training, its plots). Each time it
checks:

- the process ends within 30 s of the signal, exit code 130 (or 0 when the run had already
  finished, which it then shows: its outputs are all there and it printed no stop line; a
  timed moment whose run finished first is tried once more at the same fraction of that
  run's own wall time, and the result says ``finished_first_at_s``);
- stderr and stdout hold no traceback, and exactly one line ``fedasync[ <cmd>]: stopped by
  SIGINT ...`` saying where it stopped and how to resume;
- when training had started, a checkpoint the line names, which loads;
- no process of the run is left: every process carries a marker variable of this script, and
  anything holding the run's folders counts too (Ray's agents).

``simulate`` alternates the erasure service on and off. The results are printed one line per
moment and written to ``--out``/sweep.json. Exit code 0 when every moment of every command
passed. ``tests/test_ctrl_c.py`` runs three moments of each command within ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from commands import Command as Started  # noqa: E402
from commands import names  # noqa: E402

STOP_WITHIN_S = 30.0
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\w*(Error|Interrupt)\b", re.M)


def _events(path: Path) -> list[dict[str, Any]]:
    from fedasync.events import read_events

    try:
        return read_events(path, skip_bad=True)
    except OSError:
        return []


def _any_event(root: Path, kinds: set[str]) -> bool:
    """Whether a metrics.jsonl under ``root`` has an event of ``kinds``. A folder removed
    while it is walked (a deployment's temp folders come and go under the run folder) makes
    this poll say no; the next one looks again."""
    try:
        files = list(root.rglob("metrics.jsonl"))
    except OSError:
        return False
    return any(e.get("event") in kinds for f in files for e in _events(f))


def _loads(path: Path) -> bool:
    from fedasync.checkpoint import load_checkpoint

    try:
        load_checkpoint(path)
        return True
    except Exception:
        return False


@dataclass
class Command:
    """One command of the sweep: its arguments in a fresh folder, and how to read its outputs."""

    name: str
    args: Callable[[Path, int], list[str]]
    """(output folder, moment index) -> the arguments after ``fedasync``."""
    trained: Callable[[Path], bool]
    """Whether training had started (a checkpoint is then due)."""
    checkpoint_ok: Callable[[Path, str], bool]
    """(output folder, the stop line) -> whether the checkpoint the line names is usable."""
    finished: Callable[[Path], bool]
    """Whether the run finished (its summary is there)."""
    prefix: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    phases: dict[str, Callable[[Path], bool]] = field(default_factory=dict)
    """Late moments a time fraction hits only by luck: a signal as soon as each holds."""


def _named_checkpoint(line: str) -> Path | None:
    m = re.search(r"checkpoint (\S+?\.pt)\b", line)
    return Path(m.group(1)) if m else None


def _checkpoint_file_ok(out: Path, line: str) -> bool:
    path = _named_checkpoint(line)
    return path is not None and path.exists() and _loads(path)


def _simulate_args(out: Path, k: int) -> list[str]:
    service = ["unlearning.service=true", "unlearning.address=127.0.0.1:0"] if k % 2 else []
    return [
        "simulate",
        *(f"run.out_dir={out}", "run.name=r", "lab.compare_sync=true", "run.progress=false"),
        *("run.budget_s=60", "silos.count=2", "lab.speed.profile=uniform"),
        *("client.local_steps=2", "client.batch_size=16", "data.max_samples=300"),
        *("server.eval_every=2", "server.checkpoint_every=0", "server.evaluate_silos=false"),
        "engine.num_cpus=2",
        *service,
    ]


def _rl_args(out: Path, k: int) -> list[str]:
    return ["rl", f"run.out_dir={out}", "run.name=r", "run.max_steps=80", "run.progress=false"]


def _pipeline_args(out: Path, k: int) -> list[str]:
    return [
        "pipeline",
        *(f"run.out_dir={out}", "run.name=r", "run.steps=120", "run.progress=false"),
        *("run.checkpoint_every=10", "run.plots=true"),
    ]


def _market_args(out: Path, k: int) -> list[str]:
    return [
        "market",
        *(f"run.out_dir={out}", "run.name=r", "run.horizon=1000", "run.seeds=4"),
        *("run.workers=2", "run.progress=false", "run.plots=true"),
    ]


def _deploy_args(out: Path, k: int) -> list[str]:
    return [
        "deploy",
        "local",
        *("--silos", "2", f"run.out_dir={out}", "run.name=r", "run.budget_s=40"),
        *("data.max_samples=300", "server.evaluate_silos=false", "client.local_steps=2"),
        "server.checkpoint_every=2",
    ]


def _summary(out: Path) -> bool:
    return (out / "r" / "summary.json").exists()


COMMANDS: dict[str, Command] = {
    "simulate": Command(
        "simulate",
        _simulate_args,
        trained=lambda out: _any_event(out / "r", {"update"}),
        checkpoint_ok=_checkpoint_file_ok,
        finished=_summary,
        phases={
            "baseline starting": lambda out: (out / "r" / "baseline-sync").exists(),
            "baseline training": lambda out: _any_event(out / "r" / "baseline-sync", {"update"}),
            "plots": lambda out: (out / "r" / "baseline-sync" / "summary.json").exists(),
        },
    ),
    "rl": Command(
        "rl",
        _rl_args,
        trained=lambda out: _any_event(out / "r", {"step"}),
        checkpoint_ok=_checkpoint_file_ok,
        finished=_summary,
        prefix="rl",
    ),
    "pipeline": Command(
        "pipeline",
        _pipeline_args,
        trained=lambda out: any((out / "r" / "checkpoints").glob("step*_stage*.pt")),
        checkpoint_ok=lambda out, line: "no checkpoint" in line or "checkpoint" in line,
        finished=_summary,
        prefix="pipeline",
    ),
    "market": Command(
        "market",
        _market_args,
        trained=lambda out: any((out / "r").rglob("result.json")),
        checkpoint_ok=lambda out, line: "resume with" in line,
        finished=_summary,
        prefix="market",
    ),
    "deploy": Command(
        "deploy",
        _deploy_args,
        trained=lambda out: _any_event(out / "r", {"update"}),
        checkpoint_ok=_checkpoint_file_ok,
        finished=_summary,
        prefix="deploy",
    ),
}


def reference(cmd: Command, out: Path, timeout_s: float = 900.0) -> float:
    """The wall time of an uninterrupted run (which must succeed)."""
    run = Started(out, cmd.args(out, 0), env=cmd.extra_env)
    try:
        rc = run.popen.wait(timeout=timeout_s)
        wall = time.monotonic() - run.t0
        if rc != 0:
            raise RuntimeError(
                f"{cmd.name}: the reference run exited {rc}:\n{run.stderr()[-3000:]}"
            )
        return wall
    finally:
        run.kill()


def _loads_torch(pid: int) -> bool:
    """Whether process ``pid`` has mapped torch's files (it is in the command's imports)."""
    try:
        return "/torch/" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def one_moment(
    cmd: Command,
    out: Path,
    k: int,
    at_s: float,
    until: Callable[[Path], bool] | None = None,
    timeout_s: float = 600.0,
    importing: bool = False,
) -> dict[str, Any]:
    """Start ``cmd``, SIGINT its process group ``at_s`` seconds in (or, with ``until``, as
    soon as ``until(out)`` holds), check how it ended. ``importing``: not before the command
    is loading torch, whatever ``at_s`` (a loaded machine can take longer than ``at_s`` for
    the interpreter's own start-up, where a Ctrl-C is Python's traceback, before any code of
    the command runs)."""
    run = Started(out, cmd.args(out, k), env=cmd.extra_env)
    problems: list[str] = []
    result: dict[str, Any] = {"command": cmd.name, "moment": k, "at_s": round(at_s, 2)}
    try:
        while run.popen.poll() is None:
            late = time.monotonic() - run.t0 >= at_s
            if until is None and late and (not importing or _loads_torch(run.popen.pid)):
                break
            if until is not None and (until(out) or time.monotonic() - run.t0 > timeout_s):
                break
            time.sleep(0.02 if until is None else 0.2)
        result["at_s"] = round(time.monotonic() - run.t0, 2)
        ended_first = run.popen.poll() is not None
        trained = cmd.trained(out)
        sent = time.monotonic()
        if not ended_first:
            os.killpg(run.popen.pid, signal.SIGINT)
        try:
            rc = run.popen.wait(timeout=STOP_WITHIN_S)
            result["stop_s"] = round(time.monotonic() - sent, 2)
        except subprocess.TimeoutExpired:
            os.kill(run.popen.pid, signal.SIGABRT)  # faulthandler prints every thread's stack
            rc = None
            problems.append(f"no exit within {STOP_WITHIN_S:g} s")
        time.sleep(0.2)
        err, outs = run.stderr(), run.stdout()
        lead = f"fedasync {cmd.prefix}: stopped by" if cmd.prefix else "fedasync: stopped by"
        stops = [ln for ln in err.splitlines() if "stopped by" in ln]
        result.update(rc=rc, trained=trained, line=stops[0][:2000] if stops else None)
        if rc == 0:
            if not cmd.finished(out):
                problems.append("exit 0 without a finished run")
            if stops:
                problems.append("exit 0 with a stop line")
        elif rc is not None:
            if rc != 130:
                problems.append(f"exit code {rc}, not 130")
            if len(stops) != 1:
                problems.append(f"{len(stops)} stop lines, not one")
            elif not (stops[0].startswith(lead) or stops[0].startswith("fedasync: stopped by")):
                problems.append(f"the stop line does not start {lead!r}")
            elif trained and not cmd.checkpoint_ok(out, stops[0]):
                problems.append("training had started but the line names no usable checkpoint")
        if TRACEBACK.search(err) or TRACEBACK.search(outs):
            problems.append("a traceback or an exception name in the output")
        left = run.gone()
        if left:
            problems.append(f"processes left: {names(left)}")
        if problems:
            result["stderr_tail"] = err[-2000:]
    finally:
        run.kill()
    result["problems"] = problems
    result["ok"] = not problems
    return result


def sweep(name: str, out: Path, moments: int, wall_s: float | None = None) -> list[dict[str, Any]]:
    """Every moment of one command: its phases (``Command.phases``) and the rest at times
    spread from 2% to 90% of ``wall_s``, the reference's wall time (measured if None)."""
    cmd = COMMANDS[name]
    if wall_s is None:
        wall_s = min(reference(cmd, out / f"reference{i}") for i in range(2))
    phases = list(cmd.phases.items())[:moments]
    timed = moments - len(phases)
    fractions = [0.02 + 0.88 * i / max(timed - 1, 1) for i in range(timed)]
    results = []
    for k, f in enumerate(fractions):
        r = one_moment(cmd, out / f"m{k:02d}", k, f * wall_s)
        if r["rc"] == 0 and r["ok"]:
            # it finished before the signal (this run was faster than the reference): once
            # more at the same fraction of the wall time it took, so that the moment is a stop
            again = one_moment(cmd, out / f"m{k:02d}b", k, f * r["at_s"])
            r = {**again, "finished_first_at_s": r["at_s"]}
        results.append(r)
    for j, (label, until) in enumerate(phases):
        k = timed + j
        r = one_moment(cmd, out / f"m{k:02d}", k, 0.0, until=until)
        results.append({**r, "phase": label})
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; 0 when every moment of every command passed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commands", nargs="*", help=f"of {', '.join(COMMANDS)} (default: all)")
    p.add_argument("--moments", type=int, default=20)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "ctrl-c-sweep")
    args = p.parse_args(argv)
    unknown = [c for c in args.commands if c not in COMMANDS]
    if unknown:
        p.error(f"unknown command {unknown[0][:50]!r}; choose from {', '.join(COMMANDS)}")
    all_results: dict[str, Any] = {}
    bad = 0
    for name in args.commands or list(COMMANDS):
        out = args.out / name
        shutil.rmtree(out, ignore_errors=True)
        # the faster of two (the first pays for cold caches: 128 s against 8 s seen for rl)
        wall = min(reference(COMMANDS[name], out / f"reference{i}") for i in range(2))
        print(f"{name}: reference run {wall:.1f} s", flush=True)
        results = sweep(name, out, args.moments, wall)
        for r in results:
            state = "ok" if r["ok"] else "FAIL " + "; ".join(r["problems"])
            print(
                f"  {name} moment {r['moment']:2d} at {r['at_s']:6.1f} s"
                + (f" ({r['phase']})" if "phase" in r else "")
                + f": exit {r['rc']}, "
                f"stopped in {r.get('stop_s', float('nan')):.1f} s, trained {r['trained']}: "
                f"{state}",
                flush=True,
            )
        passed = sum(r["ok"] for r in results)
        bad += len(results) - passed
        print(f"{name}: {passed}/{len(results)} moments passed", flush=True)
        all_results[name] = {"reference_s": wall, "results": results}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep.json").write_text(json.dumps(all_results, indent=1) + "\n")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
