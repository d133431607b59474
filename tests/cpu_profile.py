"""Where the suite's CPU goes: a pytest plugin that records, for each test, the CPU seconds the
whole machine spent while it ran (``/proc/stat``: every process, so the SuperLink, SuperNodes,
Ray workers and other processes a test starts count too, which ``--durations`` under xdist
does not show) and its wall seconds.

Run the suite in one process, so each test has the machine to itself::

    .venv/bin/python -m pytest -p tests.cpu_profile -p no:xdist -m "not serial" -q

It appends one JSON line per test to ``runs/cpu-profile.jsonl`` (``CPU_PROFILE_OUT`` to change)
and prints the files that cost the most CPU at the end. The suite is CPU-bound on two cores,
so a test's CPU seconds, not its wall seconds, are what it adds to ``make test``. A
module-scoped fixture's cost lands on the first test that uses it. Linux only.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_rows: list[dict] = []


def _busy_s() -> float:
    """CPU seconds the machine has been busy since boot (user, nice, system, irq, softirq,
    steal; not idle or iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _TICK


def _out() -> Path:
    return Path(os.environ.get("CPU_PROFILE_OUT", "runs/cpu-profile.jsonl"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu0, t0 = _busy_s(), time.monotonic()
    yield
    row = {"id": item.nodeid, "cpu_s": _busy_s() - cpu0, "wall_s": time.monotonic() - t0}
    _rows.append(row)
    out = _out()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in _rows:
        f = by_file[r["id"].split("::")[0]]
        f[0] += r["cpu_s"]
        f[1] += r["wall_s"]
        f[2] += 1
    total = sum(f[0] for f in by_file.values())
    tr = terminalreporter
    tr.write_sep("=", f"CPU by file: {total:.0f} CPU s in {len(_rows)} tests ({_out()})")
    for name, (cpu, wall, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:15]:
        tr.write_line(f"{cpu:8.1f} CPU s {wall:8.1f} wall s {n:5d} tests  {name}")
