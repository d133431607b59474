"""Deployment faults across real hosts: the coordinator and each hospital in a network
namespace of their own (simulations.hosts), a real SuperLink, SuperNodes, ServerApp and warm
workers over TLS to the coordinator's address (simulations.placement.OnHosts). Each scenario
runs against an undisturbed run of the same seed and config.

Scenarios (3 hospitals; brain tissue patches and cnn-small unless said):
  partition   hospital 0's link down (packets dropped, no reset) for --cut-s seconds once 60
              updates are in, then back.
  erasure     the same cut, taken while hospital 0 erases (its request ``erasing``) and while
              hospital 1's erasure is being verified (``calibrating``).
  slow-link   hospital 0 behind a --mbit Mbit/s link (tc tbf) with MONAI's BasicUNet at its
              default widths (``unet``: 2.0M parameters, 7.9 MB a model each way) on nuclei
              (64x64 microscopy tiles, offline): fedasync against Flower's FedAvg on the same
              deployment, updates per wall second and time to a held-out Dice
              (--target-dice); then both again on unlimited links.
  restart     the coordinator's host crashes (SIGKILL to every process on it) once 60 updates
              are in, with an erasure request submitted just before; ``deploy_local`` brings
              it back (SuperLink from its database, run from its checkpoint).
  stop        ``flwr stop`` on the running run once 60 updates are in; ``flwr ls`` and
              ``flwr log`` are read; then the run is resumed (``run.resume=true``, a new
              deployment of the same run folder) to its budget.

Reported per scenario and seed: time to notice, time to recover, updates applied twice,
accepted updates lost, erasure requests and their final states, final score against the
undisturbed run. Needs root (namespaces); prints why and exits 2 otherwise. Delay is not
emulated: this kernel has no netem qdisc (tbf limits rate only; its queue adds delay only
when the link is saturated). Usage (about 14 minutes a seed for the four fault scenarios and
their undisturbed run, 12 more for slow-link):
  .venv/bin/python benchmarks/deployment_faults.py [--scenarios partition,restart,stop]
      [--seeds 0,1,2] [--cut-s 60] [--budget-s 140] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedasync.events import read_events  # noqa: E402
from simulations.config import load_config  # noqa: E402
from simulations.deploy import deploy_local  # noqa: E402
from simulations.deploy_progress import EventTail  # noqa: E402
from simulations.flower_commands import FEDERATION, tool  # noqa: E402
from simulations.hosts import HostFederation, available  # noqa: E402
from simulations.placement import OnHosts  # noqa: E402

HOSTS = ["coordinator", "hospital0", "hospital1", "hospital2"]
WARM_UPDATES = 60
"""Updates applied before a fault: the rates before it are those of a run in its stride."""
RATE_WINDOW_S = 5.0
"""Seconds over which an update rate is measured (before the fault, and back at full rate)."""


def _config(out: Path, name: str, seed: int, budget_s: float, *extra: str) -> Any:
    return load_config(
        None,
        [
            f"run.out_dir={out}",
            f"run.name={name}",
            f"run.seed={seed}",
            "lab.compare_sync=false",
            "run.progress=false",
            f"run.budget_s={budget_s}",
            "silos.count=3",
            "lab.speed.profile=uniform",
            "client.local_steps=2",
            "client.batch_size=16",
            "data.max_samples=600",
            "server.eval_every=10",
            "server.checkpoint_every=1",
            "server.evaluate_silos=false",
            *extra,
        ],
    )


class Watch:
    """Follows a run's metrics.jsonl on a thread of its own (every 50 ms): when each
    (silo, job) update was first seen (monotonic), and the rejects. A fault thread waits on
    conditions over what it saw (``wait``) while it keeps following."""

    def __init__(self, path: Path) -> None:
        self.tail = EventTail(path)
        self.seen: dict[tuple[int, int], float] = {}
        self.rejects: list[tuple[float, dict]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self.stop.is_set():
            self.poll()
            time.sleep(0.05)

    def poll(self) -> None:
        with self.lock:
            now = time.monotonic()
            for e in self.tail.poll():
                if e["event"] == "update":
                    self.seen.setdefault((e["silo"], e["job"]), now)
                elif e["event"] == "reject":
                    self.rejects.append((now, e))

    def updates(self) -> int:
        return len(self.seen)

    def wait(self, cond, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.05)
        return False

    def follow(self) -> None:
        """Idle until the run is over (the watch's own thread keeps following)."""
        self.stop.wait()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=10)
        self.poll()


def _rate(seen: dict, silos: set[int], t0: float, t1: float) -> float:
    n = sum(1 for (s, _), t in seen.items() if s in silos and t0 <= t < t1)
    return n / max(t1 - t0, 1e-9)


def _back_to_full(seen: dict, silo: int, healed: float, before: float) -> float | None:
    """Seconds from ``healed`` to the first update of ``silo`` after which its rate over the
    next window is at least 0.8x ``before``."""
    times = sorted(t for (s, _), t in seen.items() if s == silo and t > healed)
    for t in times:
        if _rate(seen, {silo}, t, t + RATE_WINDOW_S) >= 0.8 * before:
            return t - healed
    return None


def _final_updates(run_dir: Path) -> list[tuple[int, int]]:
    return [
        (e["silo"], e["job"])
        for e in read_events(run_dir / "metrics.jsonl")
        if e["event"] == "update"
    ]


def _requests(run_dir: Path) -> list[dict]:
    """The erasure store's requests and how often each reached ``calibrating`` (applied)."""
    store = run_dir / "erasures.sqlite"
    if not store.exists():
        return []
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT id, silo, state FROM requests ORDER BY created_at_ms").fetchall()
        audit = db.execute(
            "SELECT request_id, to_state FROM audit WHERE action != 'note'"
        ).fetchall()
    return [
        {
            "silo": silo,
            "state": state,
            "applied": sum(1 for r, s in audit if r == rid and s == "calibrating"),
            "path": [s for r, s in audit if r == rid],
        }
        for rid, silo, state in rows
    ]


def _submit_erasure(fed: HostFederation, run_dir: Path, cfg: Any, silo: int) -> int:
    """Submit an erasure of 3 of ``silo``'s samples as the admin on the coordinator's host;
    the CLI's exit status."""
    from protocol.config import build_silos

    ids = build_silos(cfg.data, cfg.silos.count, cfg.run.seed).silos[silo].sample_ids[:3]
    address = (run_dir / "erasure_address").read_text().strip()
    work = run_dir / "deploy"
    cmd = [tool("fedasync"), "erase", "submit", "--silo", str(silo)]
    cmd += ["--samples", ",".join(str(i) for i in ids), "--address", address]
    cmd += ["--ca-cert", str(work / "certs" / "ca.pem")]
    cmd += ["--token-file", str(work / "erasure" / "admin.token"), "--json"]
    return subprocess.run(fed.argv("coordinator", cmd), capture_output=True, timeout=60).returncode


def _state_of(run_dir: Path, silo: int) -> str | None:
    rows = [r for r in _requests(run_dir) if r["silo"] == silo]
    return rows[-1]["state"] if rows else None


def _deploy(fed: HostFederation, cfg: Any, fault, **kw: Any) -> tuple[dict, Watch, dict]:
    """One deployment on ``fed`` with ``fault(fed, watch, marks)`` on a thread."""
    watch = Watch(Path(cfg.run.out_dir) / cfg.run.name / "metrics.jsonl")
    marks: dict[str, Any] = {}
    t = threading.Thread(target=fault, args=(fed, watch, marks), daemon=True)
    t.start()
    try:
        summary = deploy_local(cfg, where=OnHosts(fed), echo=lambda line: None, **kw)
    finally:
        watch.stop.set()
        t.join(timeout=60)
        watch.close()
    return summary, watch, marks


def _cut(cut_s: float, then=None, warm: int = WARM_UPDATES):
    def fault(fed: HostFederation, watch: Watch, marks: dict) -> None:
        if not watch.wait(lambda: watch.updates() >= warm, 300):
            return
        if then is not None and not then(fed, watch, marks):
            return
        marks["cut"] = time.monotonic()
        fed.partition("hospital0")
        watch.stop.wait(cut_s)
        if watch.stop.is_set():
            return
        marks["healed"] = time.monotonic()
        fed.heal("hospital0")
        watch.follow()

    return fault


def _partition_figures(summary: dict, watch: Watch, marks: dict, run_dir: Path) -> dict:
    if "healed" not in marks:
        return {"error": "the run ended before the partition was over"}
    cut, healed, seen = marks["cut"], marks["healed"], watch.seen
    before = _rate(seen, {0}, cut - RATE_WINDOW_S, cut)
    noticed = [t for t, e in watch.rejects if e["silo"] == 0 and t >= cut]
    first = min((t for (s, _), t in seen.items() if s == 0 and t > healed), default=None)
    final = _final_updates(run_dir)
    return {
        "others_rate_before": _rate(seen, {1, 2}, cut - RATE_WINDOW_S, cut),
        "others_rate_during": _rate(seen, {1, 2}, cut, healed),
        "h0_rate_before": before,
        "noticed_s": (min(noticed) - cut) if noticed else None,
        "h0_first_update_after_heal_s": None if first is None else first - healed,
        "h0_full_rate_after_heal_s": _back_to_full(seen, 0, healed, before),
        "applied_twice": len(final) - len(set(final)),
        "versions": summary["versions"],
        "final_score": summary.get("final_score"),
    }


def undisturbed(out: Path, seed: int, budget_s: float) -> dict:
    cfg = _config(out, f"undisturbed-{seed}", seed, budget_s)
    with HostFederation(HOSTS) as fed:
        summary = deploy_local(cfg, where=OnHosts(fed), echo=lambda line: None)
    return {"versions": summary["versions"], "final_score": summary.get("final_score")}


def partition(out: Path, seed: int, args: argparse.Namespace) -> dict:
    cfg = _config(out, f"partition-{seed}", seed, args.budget_s)
    with HostFederation(HOSTS) as fed:
        summary, watch, marks = _deploy(fed, cfg, _cut(args.cut_s))
    return _partition_figures(summary, watch, marks, Path(cfg.run.out_dir) / cfg.run.name)


def erasure(out: Path, seed: int, args: argparse.Namespace) -> dict:
    extra = ("unlearning.service=true", "lab.erasure.relearn_versions=40")
    cfg = _config(out, f"erasure-{seed}", seed, args.budget_s, *extra)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name

    def during_erasures(fed: HostFederation, watch: Watch, marks: dict) -> bool:
        marks["submit_1"] = _submit_erasure(fed, run_dir, cfg, 1)
        if not watch.wait(
            lambda: _state_of(run_dir, 1) in ("calibrating", "verified", "unverified"), 120
        ):
            return False
        marks["submit_0"] = _submit_erasure(fed, run_dir, cfg, 0)
        ok = watch.wait(lambda: _state_of(run_dir, 0) == "erasing", 120)
        marks["h1_state_at_cut"] = _state_of(run_dir, 1)
        return ok

    with HostFederation(HOSTS) as fed:
        # (the erasures take ~20 s to reach the cut: it starts after 20 updates, not 60)
        summary, watch, marks = _deploy(fed, cfg, _cut(args.cut_s, during_erasures, warm=20))
    res = _partition_figures(summary, watch, marks, run_dir)
    res["h1_state_at_cut"] = marks.get("h1_state_at_cut")
    res["erasures"] = _requests(run_dir)
    return res


def restart(out: Path, seed: int, args: argparse.Namespace) -> dict:
    cfg = _config(out, f"restart-{seed}", seed, args.budget_s, "unlearning.service=true")
    run_dir = Path(cfg.run.out_dir) / cfg.run.name

    def crash(fed: HostFederation, watch: Watch, marks: dict) -> None:
        if not watch.wait(lambda: watch.updates() >= WARM_UPDATES, 300):
            return
        marks["submit_2"] = _submit_erasure(fed, run_dir, cfg, 2)
        marks["crash"] = time.monotonic()
        fed.crash("coordinator")
        marks["accepted"] = _final_updates(run_dir)  # its writer is dead: final
        marks["requests_at_crash"] = len(_requests(run_dir))
        watch.follow()

    with HostFederation(HOSTS) as fed:
        summary, watch, marks = _deploy(fed, cfg, crash, coordinator_restarts=1)
    if "crash" not in marks:
        return {"error": "the run ended before the crash"}
    events = read_events(run_dir / "metrics.jsonl")
    at = next(i for i, e in enumerate(events) if e["event"] == "resume")
    kept = [(e["silo"], e["job"]) for e in events[:at] if e["event"] == "update"]
    redo = [(e["silo"], e["job"]) for e in events[at:] if e["event"] == "update"]
    final = kept + redo
    rolled_back = marks["accepted"][len(kept) :]
    old = set(marks["accepted"])  # (seen after the crash, written before it)
    back = [
        min(
            (t for k, t in watch.seen.items() if k[0] == s and k not in old and t > marks["crash"]),
            default=None,
        )
        for s in range(3)
    ]
    (rst,) = summary["deployment"]["coordinator_restarts"]
    return {
        "restart_s": rst["restart_s"],
        "orphan_runs_stopped": len(rst["orphan_runs_stopped"]),
        "all_back_s": None if None in back else max(back) - marks["crash"],
        "accepted_at_crash": len(marks["accepted"]),
        "kept_by_checkpoint": len(kept),
        "rolled_back": len(rolled_back),
        "rolled_back_redone": sum(1 for k in rolled_back if k in set(redo)),
        "accepted_lost": len(set(marks["accepted"]) - set(final)),
        "applied_twice": len(final) - len(set(final)),
        "resumed_at_version": events[at]["version"],
        "requests_at_crash": marks["requests_at_crash"],
        "erasures": _requests(run_dir),
        "versions": summary["versions"],
        "final_score": summary.get("final_score"),
    }


def _flwr(fed: HostFederation, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """The flwr CLI on the coordinator's host, with the deployment's connection."""
    env = {
        "FLWR_HOME": str(run_dir / "deploy" / "flwr-home"),
        "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
    }
    cmd = fed.argv("coordinator", [tool("flwr"), *args])
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _workers_free(run_dir: Path, since: float) -> float:
    """Seconds after ``since`` (wall) until every hospital's warm worker had ended the task it
    held (its log's first task line after ``since``; 0 for a worker that held none)."""
    free = 0.0
    for log in sorted((run_dir / "deploy").glob("silo-*/worker-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if " fedasync.worker: task " not in line:
                continue
            try:
                t = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
                t += int(line[20:23]) / 1000
            except ValueError:
                continue
            if t >= since:
                free = max(free, t - since)
                break
    return free


def stop(out: Path, seed: int, args: argparse.Namespace) -> dict:
    cfg = _config(out, f"stop-{seed}", seed, args.budget_s)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name

    def flwr_stop(fed: HostFederation, watch: Watch, marks: dict) -> None:
        if not watch.wait(lambda: watch.updates() >= WARM_UPDATES, 300):
            return
        ls = json.loads(_flwr(fed, run_dir, "ls", FEDERATION, "--format", "json").stdout or "{}")
        running = [r["run-id"] for r in ls.get("runs", []) if r["status"] == "running"]
        if not running:
            return
        marks["run_id"] = running[0]
        marks["stop"], stopped_at = time.monotonic(), time.time()
        marks["stop_rc"] = _flwr(fed, run_dir, "stop", running[0], FEDERATION).returncode

        def status() -> str:
            out = _flwr(fed, run_dir, "ls", FEDERATION, "--format", "json").stdout
            runs = json.loads(out[out.index("{") :]).get("runs", []) if "{" in out else []
            return next((r["status"] for r in runs if r["run-id"] == running[0]), "")

        watch.wait(lambda: status().startswith("finished"), 60)
        marks["ls_status"] = status()
        marks["summary_s"] = None
        summary = run_dir / "summary.json"
        if watch.wait(lambda: summary.exists() and summary.stat().st_mtime >= stopped_at, 60):
            marks["summary_s"] = summary.stat().st_mtime - stopped_at
        marks["stopped_at"] = stopped_at
        log = _flwr(fed, run_dir, "log", running[0], FEDERATION, "--show").stdout
        marks["log_start"] = "fedasync: run started" in log
        marks["log_stop"] = "fedasync: run stopped" in log
        watch.follow()

    with HostFederation(HOSTS) as fed:  # the same hosts for the stopped run and its resume
        first, watch, marks = _deploy(fed, cfg, flwr_stop)
        if "stop" not in marks:
            return {"error": "the run ended before flwr stop"}
        before = _final_updates(run_dir)
        # (after the teardown: a worker still stuck in its task shows as its teardown)
        marks["workers_free_s"] = _workers_free(run_dir, marks["stopped_at"])
        resumed_cfg = _config(out, f"stop-{seed}", seed, args.budget_s, "run.resume=true")
        t0 = time.monotonic()
        second, watch2, _ = _deploy(fed, resumed_cfg, lambda *a: None)
    events = read_events(run_dir / "metrics.jsonl")
    at = next(i for i, e in enumerate(events) if e["event"] == "resume")
    final = [(e["silo"], e["job"]) for e in events if e["event"] == "update"]
    first_back = min((t for k, t in watch2.seen.items() if k not in set(before)), default=None)
    return {
        "stop_rc": marks["stop_rc"],
        "ls_status": marks.get("ls_status"),
        "stopped_summary": (first.get("stopped") or {}).get("reason"),
        "summary_after_stop_s": marks.get("summary_s"),
        "flwr_log_shows_start": marks.get("log_start"),
        "flwr_log_shows_stop": marks.get("log_stop"),
        "workers_free_s": marks.get("workers_free_s"),
        "stopped_at_version": first["versions"],
        "resumed_at_version": events[at]["version"],
        "resume_first_update_s": None if first_back is None else first_back - t0,
        "accepted_lost": len(set(before) - set(final)),
        "applied_twice": len(final) - len(set(final)),
        "versions": second["versions"],
        "final_score": second.get("final_score"),
    }


def slow_link(out: Path, seed: int, args: argparse.Namespace) -> dict:
    """fedasync and Flower's FedAvg with a 7.9 MB UNet, hospital 0 at --mbit and unlimited.

    (Not DenseNet121 on radiomics-slice: its held-out set is 36 slices, 83% one class, so its
    accuracy sits at the majority class and its loss jumps between evaluations. Nuclei's
    held-out Dice climbs smoothly: a time to target means something.)"""
    from simulations.deploy import deploy_local as deploy

    res: dict[str, Any] = {}
    extra = (
        "data.benchmark=nuclei",
        "data.network=unet",
        "client.local_steps=2",
        "client.batch_size=8",
        "server.eval_every=3",  # (FedAvg evaluates every round)
        "server.checkpoint_every=0",
    )
    for link in ("limited", "unlimited"):
        for mode in ("fedasync", "fedavg"):
            name = f"slow-{link}-{mode}-{seed}"
            cfg = _config(out, name, seed, args.slow_budget_s, *extra)
            serverapp = "server.flower_sync:app" if mode == "fedavg" else None
            with HostFederation(HOSTS) as fed:
                if link == "limited":
                    fed.limit("hospital0", args.mbit)
                summary = deploy(
                    cfg, where=OnHosts(fed), echo=lambda line: None, serverapp=serverapp
                )
            events = read_events(Path(cfg.run.out_dir) / name / "metrics.jsonl")
            evals = [e for e in events if e["event"] == "eval"]
            n_updates = sum(1 for e in events if e["event"] == "update")
            hit = next((e["t"] for e in evals if e["score"] >= args.target_dice), None)
            res[f"{link}_{mode}"] = {
                "versions": summary["versions"],
                "updates_per_s": n_updates / max(evals[-1]["t"], 1e-9) if evals else None,
                "time_to_target_s": hit,
                "final_score": summary.get("final_score"),
            }
    for link in ("limited", "unlimited"):
        a, f = (
            res[f"{link}_fedasync"]["time_to_target_s"],
            res[f"{link}_fedavg"]["time_to_target_s"],
        )
        res[f"{link}_speedup"] = None if a is None or f is None else f / a
        if a is not None and f is None:  # FedAvg never got there: a lower bound
            res[f"{link}_speedup_at_least"] = args.slow_budget_s / a
    return res


SCENARIOS = {
    "partition": partition,
    "erasure": erasure,
    "slow-link": slow_link,
    "restart": restart,
    "stop": stop,
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--cut-s", type=float, default=60.0)
    ap.add_argument("--budget-s", type=float, default=140.0)
    ap.add_argument("--mbit", type=float, default=10.0)
    ap.add_argument("--slow-budget-s", type=float, default=150.0)
    ap.add_argument(
        "--target-dice",
        type=float,
        default=0.80,
        help="slow-link: the held-out Dice (nuclei) to reach",
    )
    ap.add_argument("--out", default="runs/bench-deployment-faults")
    ap.add_argument("--json", help="write every row here too")
    ap.add_argument(
        "--report", help="print the summary and verdicts of a saved --json; run nothing"
    )
    return ap


def main(args: argparse.Namespace) -> int:
    if args.report:
        rows = json.loads(Path(args.report).read_text())
        return 0 if _report(rows) else 1
    why = available()
    if why is not None:
        print(f"deployment_faults: cannot make network namespaces here: {why}")
        return 2
    out = Path(args.out).resolve()
    names = [n for n in args.scenarios.split(",") if n]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        print(f"deployment_faults: unknown scenarios {unknown}; known: {list(SCENARIOS)}")
        return 2
    rows: list[dict] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        base = None
        if any(n in ("partition", "erasure", "restart", "stop") for n in names):
            base = undisturbed(out, seed, args.budget_s)
            print(json.dumps({"scenario": "undisturbed", "seed": seed, **base}), flush=True)
        for name in names:
            t0 = time.monotonic()
            row = {"scenario": name, "seed": seed, **SCENARIOS[name](out, seed, args)}
            row["wall_s"] = time.monotonic() - t0
            if base is not None and name != "slow-link":
                row["undisturbed_score"] = base["final_score"]
                row["undisturbed_versions"] = base["versions"]
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 0 if _report(rows) else 1


def _spread(values: list) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "n/a"
    return f"{statistics.fmean(v):.2f} [{min(v):.2f}, {max(v):.2f}] (n={len(v)})"


BACK_WITHIN_S = 30.0
"""Goal: the partitioned hospital back at its full update rate within this long."""


def verdict(row: dict) -> list[str]:
    """What ``row`` (one scenario, one seed) fails of the goals; empty when it passes."""
    bad = []
    if "error" in row:
        return [row["error"]]
    if row.get("applied_twice"):
        bad.append(f"{row['applied_twice']} updates applied twice")
    if row.get("accepted_lost"):
        bad.append(f"{row['accepted_lost']} accepted updates lost")
    name = row["scenario"]
    if name in ("partition", "erasure"):
        back = row.get("h0_full_rate_after_heal_s")
        if back is None or back > BACK_WITHIN_S:
            bad.append(f"hospital 0 not back at full rate within {BACK_WITHIN_S:g} s ({back})")
        if not row.get("others_rate_during"):
            bad.append("the other hospitals stalled during the cut")
    for e in row.get("erasures", []):
        if e["applied"] > 1:
            bad.append(f"silo {e['silo']}'s erasure applied {e['applied']} times")
    if name == "erasure" and len(row.get("erasures", [])) != 2:
        bad.append(f"{len(row.get('erasures', []))} erasure requests in the store, 2 submitted")
    if name == "restart":
        if len(row.get("erasures", [])) != row.get("requests_at_crash"):
            bad.append("an erasure request was lost or added across the restart")
        if row.get("all_back_s") is None:
            bad.append("a hospital did not come back after the restart")
    if name == "stop":
        if row.get("ls_status") != "finished:stopped" or not row.get("stopped_summary"):
            bad.append(
                f"the stop: flwr ls {row.get('ls_status')}, summary {row.get('stopped_summary')}"
            )
        if row.get("resumed_at_version") != row.get("stopped_at_version"):
            bad.append("the resume did not continue from the stop's checkpoint")
        if not row.get("flwr_log_shows_start"):
            bad.append("flwr log does not show the run")
    if name == "slow-link":
        lim, unl = row.get("limited_speedup"), row.get("unlimited_speedup")
        lim = lim if lim is not None else row.get("limited_speedup_at_least")
        if lim is None or unl is None or lim < unl:
            bad.append(f"async's advantage on the slow link {lim} < unlimited {unl}")
    return bad


def _report(rows: list[dict]) -> bool:
    """Print the summary over seeds and each row's verdict; True when every row passes."""
    print("\nsummary (mean [min, max] over seeds):")
    for name in SCENARIOS:
        r = [x for x in rows if x["scenario"] == name and "error" not in x]
        if not r:
            continue
        keys = [
            k
            for k, v in r[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("seed",)
        ]
        print(f"  {name}:")
        for k in keys:
            print(f"    {k}: {_spread([x.get(k) for x in r])}")
        for x in r:
            for e in x.get("erasures", []):
                print(f"    seed {x['seed']}: silo {e['silo']}'s erasure {' -> '.join(e['path'])}")
    ok = True
    print("\nverdicts:")
    for x in rows:
        if x["scenario"] == "undisturbed":
            continue
        bad = verdict(x)
        ok = ok and not bad
        print(
            f"  {x['scenario']} seed {x['seed']}: {'PASS' if not bad else 'FAIL: ' + '; '.join(bad)}"
        )
    return ok


def _stopped(e: BaseException, json_out: str | None) -> int:
    """One line for a signal (Ctrl-C): the rows finished so far are in --json (each is written
    when its scenario ends); the deployment in progress was stopped by deploy_local. The exit
    status (130 for Ctrl-C)."""
    from fedasync.interrupt import signal_of

    name, code = signal_of(e)
    kept = f"the finished rows are in {json_out}" if json_out else "no --json: nothing kept"
    print(f"deployment_faults: stopped by {name}; {kept}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    from fedasync.interrupt import Interrupted, exit_now, raise_interrupted, set_handlers

    set_handlers(raise_interrupted)  # SIGTERM and SIGHUP end it like Ctrl-C
    cli = _parser().parse_args()
    try:
        sys.exit(main(cli))
    except (Interrupted, KeyboardInterrupt) as stop:
        exit_now(_stopped(stop, cli.json))
