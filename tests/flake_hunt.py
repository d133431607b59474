"""Find flaky tests before users do: run tests N rounds under CPU load, report each failure.

    .venv/bin/python tests/flake_hunt.py                    # the slow tests, 5 rounds, 2 busy
    .venv/bin/python tests/flake_hunt.py --rounds 3 --busy 4 -- -k deploy
    .venv/bin/python tests/flake_hunt.py --select all       # every test, not just the slow ones
    .venv/bin/python tests/flake_hunt.py --workers 0        # one process, no pytest-xdist

Each round runs the tests as ``make test`` does (the ``serial`` ones alone, then the rest on
``--workers`` pytest-xdist workers; the arguments after ``--`` are added to both) while
``--busy`` processes spin on the CPU, the way a loaded CI machine or a laptop compiling in the
background would slow the tests' subprocesses down. A round's output and its JUnit XML are
kept in ``--out`` (default ``runs/flake-hunt/``); at the end one line per test that failed at
least once: how often, and where its log is. Exit code 0 when nothing failed, 1 otherwise.

A failure found here is fixed at its root (a race, a bound that is really a timing
assumption), never by a retry or a longer timeout that only hides it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _busy() -> subprocess.Popen[bytes]:
    """A process that spins one core until it is killed."""
    return subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _failures(junit: Path) -> list[tuple[str, str]]:
    """(test id, first line of the failure) of each failed or errored test in a JUnit file."""
    if not junit.exists():
        return [("(no junit file: pytest did not finish)", "")]
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                out.append((name, (bad.get("message") or "").splitlines()[0][:200]))
    return out


def _pytest(cmd: list[str], log: Path, timeout_s: float) -> int:
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -9


def _round(
    k: int, out: Path, select: str, extra: list[str], busy: int, workers: int, timeout_s: float
) -> dict:
    log = out / f"round{k}.log"
    log.unlink(missing_ok=True)
    chosen = "slow and " if select == "slow" else ""
    parts = [  # as make test: the serial tests alone, then the rest on the workers
        (f"{chosen}serial", []),
        (f"{chosen}not serial", ["-n", str(workers), "--dist", "loadfile"] if workers else []),
    ]
    spinners = [_busy() for _ in range(busy)]
    t0 = time.monotonic()
    rcs, failed = [], []
    try:
        for j, (marks, xdist) in enumerate(parts):
            junit = out / f"round{k}-{j}.xml"
            cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", marks]
            rc = _pytest([*cmd, f"--junitxml={junit}", *xdist, *extra], log, timeout_s)
            rcs.append(rc)
            if rc != 5:  # 5: nothing selected
                failed += _failures(junit)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    wall = time.monotonic() - t0
    rc = max((r for r in rcs if r != 5), default=0, key=abs)
    return {"round": k, "rc": rc, "wall_s": round(wall, 1), "failed": failed, "log": str(log)}


def main(argv: list[str] | None = None) -> int:
    """Run the rounds; print the failures; 0 when there were none."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU")
    p.add_argument("--workers", type=int, default=3, help="pytest-xdist workers (0: none)")
    p.add_argument("--select", choices=("slow", "all"), default="slow")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="a round's limit")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "flake-hunt")
    p.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for k in range(1, args.rounds + 1):
        r = _round(
            k, args.out, args.select, args.pytest_args, args.busy, args.workers, args.timeout_s
        )
        rounds.append(r)
        print(
            f"round {k}/{args.rounds}: exit {r['rc']}, {len(r['failed'])} failed, "
            f"{r['wall_s']:.0f} s under {args.busy} busy processes; log {r['log']}",
            flush=True,
        )
        for name, why in r["failed"]:
            print(f"  FAILED {name}: {why}", flush=True)
    (args.out / "rounds.json").write_text(json.dumps(rounds, indent=1) + "\n")
    count = Counter(name for r in rounds for name, _ in r["failed"])
    bad_rounds = sum(1 for r in rounds if r["rc"] != 0)
    print(f"{len(rounds)} rounds, {bad_rounds} with a failure, {sum(count.values())} failures")
    for name, n in count.most_common():
        logs = [r["log"] for r in rounds if any(f == name for f, _ in r["failed"])]
        print(f"  {name}: failed {n}/{len(rounds)} rounds; logs {', '.join(logs)}")
    return 0 if bad_rounds == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
