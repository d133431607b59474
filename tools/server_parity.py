"""Behaviour parity of the server across a change: six runs' events, summaries and weights.

A redesign of ``server/`` must not change what a run does. This tool runs six small
configurations of ``fedasync simulate`` (Flower's simulation engine, the virtual clock, so a
seed's run is reproducible) at the checkout it is started from, and writes what each did with
the machine's noise taken out: every event of ``metrics.jsonl``, ``summary.json`` flattened,
and the sha256 of each saved model. Run it before and after, then compare::

    python tools/server_parity.py record runs/parity/before     # at the old commit
    python tools/server_parity.py record runs/parity/after      # at the new one
    python tools/server_parity.py compare runs/parity/before runs/parity/after \\
        --rename final_accuracy=final_score

``compare`` prints the first differences per configuration and exits 1 when there is any;
``--rename OLD=NEW`` (repeatable) reads a key the change renamed as its new name.

The six: fedasync (the default), fedbuff, sync, an erasure of a whole silo, a crash fault, and
a stop at version 12 resumed from its checkpoint to version 25. What is left out as noise: the
wall clock (``train_seconds``, ``wall_time_s``, ``silo_seconds``), Flower's node ids and the
request ids, which are drawn at random (a request id is named by its order of appearance),
the run folder in paths, and when a cancelled job's reply was discarded (it arrives on the
wall clock: those events are compared as a set).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["run.budget_s=60", "run.compare_sync=false", "run.progress=false", "run.seed=0"]
CONFIGS: dict[str, list[list[str]]] = {
    "fedasync": [[]],
    "fedbuff": [["server.mode=fedbuff", "server.buffer_size=3"]],
    "sync": [["server.mode=sync", "run.budget_s=300"]],
    "erasure": [["run.budget_s=120", "erasures=[{silo: 1, at_s: 40}]"]],
    "crash": [["lab.faults=[{kind: crash, silo: 2, at_version: 5, down_s: 20}]"]],
    "resume": [["run.max_versions=12"], ["run.max_versions=25", "run.resume=true"]],
}
"""Each configuration's commands, in turn on one run folder (``resume``: stop, then resume)."""
ENTRY = "import sys; from simulations.entry import main; sys.argv[0] = 'fedasync'; sys.exit(main())"
"""``fedasync`` as the checkout's code (``-c`` puts the working folder first on the path)."""
NOISE = frozenset({"train_seconds", "wall_time_s", "silo_seconds", "node"})
"""Keys whose values the machine decides (wall seconds) or Flower draws (node ids)."""
UUID = re.compile(r"\b[0-9a-f]{32}\b")
"""A request id (uuid4 hex): random, so each is named by its order of appearance."""
CANCELLED = "its job was cancelled"
"""A cancelled job's reply is discarded when it arrives, on the wall clock: these events are
compared as a set, without their time and version."""
MAX_SHOWN = 8
"""Differences printed per configuration."""


def record(out: Path) -> int:
    """Run the six configurations into ``out``; write ``out/fingerprint.json``."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    prints: dict[str, Any] = {}
    for name, steps in CONFIGS.items():
        t0 = time.monotonic()
        for i, extra in enumerate(steps):
            cmd = [sys.executable, "-c", ENTRY, "simulate", *COMMON]
            cmd += [f"run.out_dir={out}", f"run.name={name}", *extra]
            log = out / f"{name}.{i}.log"
            code = _run(cmd, log)
            if code != 0:
                print(f"server_parity: {name} exited {code} (see {log})", file=sys.stderr)
                return 1
        prints[name] = fingerprint(out / name)
        print(
            f"server_parity: {name}: {len(prints[name]['events'])} events in "
            f"{time.monotonic() - t0:.0f}s wall",
            flush=True,
        )
    (out / "fingerprint.json").write_text(json.dumps(prints, indent=1, sort_keys=True))
    print(f"server_parity: wrote {out / 'fingerprint.json'}")
    return 0


def _run(cmd: list[str], log: Path) -> int:
    """One command from the repository root, its output to ``log``; a Ctrl-C stops it first."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise


def fingerprint(run_dir: Path) -> dict[str, Any]:
    """A run's events and flattened summary without the noise, and its models' sha256."""
    from fedasync.events import read_events

    ids: dict[str, str] = {}  # a request id (uuid4) -> its order of appearance

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k not in NOISE}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, str):
            v = v.replace(str(run_dir), "<run>")
            return UUID.sub(lambda m: ids.setdefault(m.group(0), f"<id {len(ids) + 1}>"), v)
        return v

    events, discarded = [], []
    for e in read_events(run_dir / "metrics.jsonl"):
        e = clean(e)
        if e["event"] == "reply_discarded" and str(e.get("reason", "")).startswith(CANCELLED):
            discarded.append({k: v for k, v in e.items() if k not in ("t", "version")})
        else:
            events.append(e)
    summary = flatten(clean(json.loads((run_dir / "summary.json").read_text())))
    models = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((run_dir / "models").glob("*.pt"))
    }
    discarded.sort(key=lambda e: (e.get("silo", -1), e.get("job", -1)))
    return {"events": events, "discarded": discarded, "summary": summary, "models": models}


def flatten(v: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": [1]}}`` -> ``{"a.b[0]": 1}``."""
    if isinstance(v, dict):
        out: dict[str, Any] = {}
        for k, x in v.items():
            out.update(flatten(x, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(v, list):
        out = {}
        for i, x in enumerate(v):
            out.update(flatten(x, f"{prefix}[{i}]"))
        return out
    return {prefix: v}


def renamed(v: Any, names: dict[str, str]) -> Any:
    """``v`` with every dict key (and summary path part) in ``names`` read as its new name."""
    if isinstance(v, dict):
        return {_rename_path(k, names): renamed(x, names) for k, x in v.items()}
    if isinstance(v, list):
        return [renamed(x, names) for x in v]
    return v


def _rename_path(key: str, names: dict[str, str]) -> str:
    """Each dotted part of ``key`` by its new name, its ``[i]`` index kept."""
    out = []
    for part in key.split("."):
        head, bracket, index = part.partition("[")
        out.append(names.get(head, head) + bracket + index)
    return ".".join(out)


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints of one configuration, in the order found."""
    out: list[str] = []
    eb, ea = before["events"], after["events"]
    if len(eb) != len(ea):
        out.append(f"events: {len(eb)} before, {len(ea)} after")
    for i, (x, y) in enumerate(zip(eb, ea)):
        if x != y:
            keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            out.append(f"event {i} ({x.get('event')} at t={x.get('t')}): differs in {keys}")
    sb, sa = before["summary"], after["summary"]
    for k in sorted(set(sb) | set(sa)):
        if sb.get(k, "<absent>") != sa.get(k, "<absent>"):
            out.append(
                f"summary {k}: {_short(sb.get(k, '<absent>'))} -> {_short(sa.get(k, '<absent>'))}"
            )
    if before.get("discarded", []) != after.get("discarded", []):
        out.append("the discarded replies of cancelled jobs differ")
    if before["models"] != after["models"]:
        out.append(f"models differ: {sorted(before['models'])} -> {sorted(after['models'])}")
    return out


def _short(v: Any, limit: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def compare(a: Path, b: Path, names: dict[str, str]) -> int:
    """Print the differences of each configuration; 0 when none."""
    before = json.loads((a / "fingerprint.json").read_text())
    after = json.loads((b / "fingerprint.json").read_text())
    bad = 0
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            print(f"{name}: recorded on one side only")
            bad += 1
            continue
        diffs = differences(renamed(before[name], names), after[name])
        if not diffs:
            print(f"{name}: identical ({len(after[name]['events'])} events)")
            continue
        bad += 1
        print(f"{name}: {len(diffs)} differences")
        for d in diffs[:MAX_SHOWN]:
            print(f"  {d}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """The command line: ``record OUT`` or ``compare BEFORE AFTER [--rename OLD=NEW]``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the six configurations at this checkout")
    r.add_argument("out", type=Path)
    c = sub.add_parser("compare", help="compare two recordings")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--rename", action="append", default=[], metavar="OLD=NEW")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "record":
            return record(args.out)
        names = {}
        for pair in args.rename:
            old, sep, new = pair.partition("=")
            if not (sep and old and new):
                ap.error(f"--rename takes OLD=NEW, got {pair[:80]!r}")
            names[old] = new
        return compare(args.before, args.after, names)
    except KeyboardInterrupt:
        print(
            "server_parity: stopped by SIGINT; the runs finished so far are kept", file=sys.stderr
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
