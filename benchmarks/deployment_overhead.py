"""What Flower's deployment engine costs per message, and async against Flower's own FedAvg.

On loopback with TLS and SuperNode authentication (``simulations.deploy.deploy_local``: one
SuperLink, one SuperNode per silo, the same ClientApp), one deployment at a time. Three parts
(``--parts``, default all):

``overhead``: fedasync's ServerApp at 3 and 8 silos (``--silos``), with warm workers (one
long-lived ClientApp worker per SuperNode, ``simulations.worker``, the default) and with
Flower's process per message (``workers=flower``); the SuperNodes' sleeps are capped in both
(``simulations.supernode``). Light work (cnn-small, 5 local steps) and no evaluation during
the run, so that what is measured is the message path. Per train message: round trip, the
time between two takes of the same silo's replies (the silo is re-sent work at once), and
overhead = round trip - the ClientApp's own training seconds (``train_seconds``); median and
mean; and the CPU the SuperLink and the SuperNodes used, as a fraction of one core over the
run (``deploy.json``'s ``cpu_s``: the price of their shorter polls). Goal: overhead median
under 1 s with warm workers.

``speedup``: fedasync against ``flower-fedavg`` (Flower's synchronous
``flwr.serverapp.strategy.FedAvg`` round loop adapted to our protocol,
``server.flower_sync:app``: every silo each round, a barrier, ``send_and_receive``, its 3 s
wait between polls capped at fedasync's poll, ``POLL_INTERVAL_S``) on the same deployment (warm workers) with 8 silos of which 2 are 4x slower
(``lab.speed.profile=stragglers``, ``straggler_fraction=0.25``, ``straggler_slowdown=4``,
``lab.emulate_speed=true``: a slow silo waits after training so that its message takes 4x
as long), over ``--reps`` seeds (default 3). Per run: updates per wall second once training
started (per silo, its updates / (its last take - the first dispatch), summed over silos),
and the time from the first dispatch to a target test score (95% of the lower of the two
runs' best scores of that seed, on the coordinator's held-out set). The ratio of updates per
wall second, fedasync / FedAvg, per seed: mean and standard deviation.

``memory``: one warm deployment of 1 silo until 500 versions (500 train messages to one
worker): its resident memory after its 10th, 100th and last message (its log).

The last line, ``deploy_speedup_vs_sync=<x>``, is the mean ratio of the speedup part (how many
more local updates the asynchronous loop gets out of the same deployment in the same time;
it does not weigh what an update is worth: the time to target does).

    .venv/bin/python benchmarks/deployment_overhead.py                    # all three parts
    .venv/bin/python benchmarks/deployment_overhead.py --parts overhead --silos 3
    .venv/bin/python benchmarks/deployment_overhead.py --reuse   # the tables from finished runs

Every run's processes are stopped by ``deploy_local`` (by process group, pid and an
environment marker); the script then checks that none of their pids is still alive.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedasync.events import read_events  # noqa: E402
from fedasync.processes import alive  # noqa: E402
from server.summary import time_to_target  # noqa: E402
from simulations.config import load_config  # noqa: E402
from simulations.deploy import deploy_local  # noqa: E402
from simulations.deploy_progress import takes, training_start  # noqa: E402

SERVERAPPS = {
    "fedasync": ("server.app:app", ["server.mode=fedasync"]),
    "flower-fedavg": ("server.flower_sync:app", []),
}

LIGHT = [
    "data.max_samples=600",
    "data.network=cnn-small",
    "client.num_threads=1",
    "client.local_steps=5",
    "lab.speed.profile=uniform",
    "server.checkpoint_every=0",
    "server.evaluate_silos=false",
]
"""The work of the overhead and memory parts: light, so that the message path shows."""


def loadavg() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def async_messages(events: list[dict[str, Any]]) -> tuple[float, list[dict[str, float]]]:
    """fedasync: (first dispatch, one record per taken update: taken, round trip, train s).

    The first jobs go out right after the version-0 evaluation; each later job of a silo right
    after its previous reply was taken (or rejected): ``deploy_progress.takes``."""
    start = training_start(events)
    assert start is not None, "the run never started training"
    out = [
        {"silo": silo, "taken": e["t"], "rt": rt, "train": e.get("train_seconds", 0.0)}
        for e, silo, rt in takes(events)
        if e["event"] == "update"
    ]
    return start, out


def sync_messages(summary: dict[str, Any]) -> tuple[float, list[dict[str, float]]]:
    """flower-fedavg: (first dispatch, one record per taken update) from its summary."""
    out = [
        {
            "silo": m["silo"],
            "taken": m["taken"],
            "rt": m["taken"] - m["dispatched"],
            "train": m["train_seconds"],
            "ready": m["reply_created"] - m["dispatched"],
        }
        for m in summary["messages"]
    ]
    return float(summary["training_started_s"]), out


def steady_rate(start: float, msgs: list[dict[str, float]]) -> float:
    """Updates per wall second while training: per silo, its updates / (its last take - the
    first dispatch), summed over silos (work cut off by the end of the run is not counted
    against either mode)."""
    last: dict[int, list[float]] = {}
    for m in msgs:
        last.setdefault(int(m["silo"]), []).append(m["taken"])
    return sum(len(ts) / (max(ts) - start) for ts in last.values() if max(ts) > start)


def figures(mode: str, summary: dict[str, Any], run_dir: Path, budget_s: float) -> dict[str, Any]:
    """One row of the table (wall seconds)."""
    if mode == "fedasync":
        start, msgs = async_messages(read_events(run_dir / "metrics.jsonl"))
    else:
        start, msgs = sync_messages(summary)
    rts = [m["rt"] for m in msgs]
    over = [m["rt"] - m["train"] for m in msgs]
    in_budget = [m for m in msgs if m["taken"] - start <= budget_s]
    ready = [m["ready"] for m in msgs if "ready" in m]
    d = summary["deployment"]
    return {
        "updates": len(msgs),
        "versions": summary["versions"],
        "rt_mean": statistics.fmean(rts) if rts else None,
        "rt_median": statistics.median(rts) if rts else None,
        "train_mean": statistics.fmean(m["train"] for m in msgs) if msgs else None,
        "overhead_mean": statistics.fmean(over) if over else None,
        "overhead_median": statistics.median(over) if over else None,
        "reply_ready_mean": statistics.fmean(ready) if ready else None,
        "updates_in_budget": len(in_budget),
        "updates_per_wall_s_in_budget": len(in_budget) / budget_s,
        "updates_per_wall_s": steady_rate(start, msgs),
        "best": summary["best_score"],
        "final": summary["final_score"],
        "evals": [{**e, "t": max(0.0, e["t"] - start)} for e in summary["evals"]],
        "wall_s": d["wall_s"],
        "processes": len(d["pids"]),
        "left_running": d["left_running"],
    }


def reuse_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A finished run's summary (with its deploy.json) and load averages (``--reuse``)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["deployment"] = json.loads((run_dir / "deploy.json").read_text())
    return summary, json.loads((run_dir / "bench.json").read_text())


def prefixed(name: str) -> Callable[[str], None]:
    """Echo for one run's console lines."""
    return lambda line: print(f"[{name}] {line}", flush=True)


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def run_one(
    out: Path, name: str, mode: str, workers: str, overrides: list[str], reuse: bool
) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """One deployment (or, with ``reuse``, its finished outputs): (summary, bench, run dir)."""
    serverapp, extra = SERVERAPPS[mode]
    run_dir = out / name
    if reuse and (run_dir / "bench.json").exists():
        summary, bench = reuse_run(run_dir)
        return summary, bench, run_dir
    cfg = load_config(None, [f"run.out_dir={out}", f"run.name={name}", *extra, *overrides])
    load_before = loadavg()
    t0 = time.monotonic()
    summary = deploy_local(cfg, echo=prefixed(name), serverapp=serverapp, workers=workers)
    bench = {"load_before": load_before, "load_after": loadavg(), "budget_s": cfg.run.budget_s}
    (run_dir / "bench.json").write_text(json.dumps(bench) + "\n")
    print(f"[{name}] done in {time.monotonic() - t0:.0f}s wall", flush=True)
    left = [p for p in summary["deployment"]["pids"] if alive(p)]
    assert not left, f"{name}: processes {left} still running"
    return summary, bench, run_dir


def cpu_share(d: dict[str, Any], role: str) -> float | None:
    """A role's CPU over the run as a fraction of one core (``deploy.json``)."""
    cpu, wall = d.get("cpu_s", {}).get(role), d.get("cpu_wall_s")
    return cpu / wall if cpu is not None and wall else None


def part_overhead(args: argparse.Namespace, out: Path) -> dict[str, dict[str, Any]]:
    """Per-message overhead with and without warm workers (see the module docstring)."""
    rows = {}
    for n in [int(x) for x in args.silos.split(",")]:
        for workers in args.workers.split(","):
            name = f"overhead-{workers}-{n}"
            overrides = [
                *LIGHT,
                "lab.compare_sync=false",
                f"run.budget_s={args.overhead_budget_s}",
                f"silos.count={n}",
                "server.eval_every=1000000",
                *args.overrides,
            ]
            summary, bench, run_dir = run_one(out, name, "fedasync", workers, overrides, args.reuse)
            d = summary["deployment"]
            rows[name] = {
                **figures("fedasync", summary, run_dir, bench["budget_s"]),
                **bench,
                "silos": n,
                "workers": workers,
                "superlink_cpu": cpu_share(d, "superlink"),
                "supernodes_cpu": cpu_share(d, "supernodes"),
                "workers_cpu": cpu_share(d, "workers"),
                "split": worker_split(run_dir, n),
                "node_split": node_split(run_dir, n),
            }
    print(
        f"\n{'silos':>5s} {'workers':8s} {'load':>9s} {'msgs':>5s} {'rt_med':>6s} {'rt_mean':>7s} "
        f"{'train':>6s} {'ovh_med':>7s} {'ovh_mean':>8s} {'link_cpu':>8s} {'nodes_cpu':>9s}"
    )
    for r in rows.values():
        print(
            f"{r['silos']:5d} {r['workers']:8s} {r['load_before']:4.1f}-{r['load_after']:<4.1f} "
            f"{r['updates']:5d} {fmt(r['rt_median'], '.2f'):>6s} {fmt(r['rt_mean'], '.2f'):>7s} "
            f"{fmt(r['train_mean'], '.2f'):>6s} {fmt(r['overhead_median'], '.2f'):>7s} "
            f"{fmt(r['overhead_mean'], '.2f'):>8s} {fmt(r['superlink_cpu'], '.2f'):>8s} "
            f"{fmt(r['supernodes_cpu'], '.2f'):>9s}"
        )
    print(
        "seconds per train message: rt = between two takes of a silo's replies, train = its "
        "own training, ovh = rt - train; cpu = cores used on average over the run (SuperLink; "
        "all SuperNodes together); load = 1-min load average before-after"
    )
    for name, r in rows.items():
        if r["split"]:
            x = r["split"]
            print(
                f"{name}: worker task {x['task']:.2f} s (pull {x['pull']:.2f}, app "
                f"{x['app']:.2f}, push {x['push']:.2f}), outside the worker {x['gap']:.2f} s "
                "(medians, from the workers' logs)"
            )
        if r["node_split"]:
            x = r["node_split"]
            print(
                f"{name}: the SuperNode pulls a message in {x['pull']:.2f} s, waits "
                f"{x['reply']:.2f} s more for its reply, pushes it in {x['push']:.2f} s; from "
                f"then to its next message {x['between']:.2f} s (the ServerApp's take and "
                "dispatch, the SuperNode's idle sleep; medians, from the SuperNodes' logs)"
            )
    return rows


def part_speedup(args: argparse.Namespace, out: Path) -> dict[str, dict[str, Any]]:
    """fedasync against Flower's FedAvg with 2 of 8 silos 4x slower, over seeds."""
    rows = {}
    for seed in range(args.reps):
        pair = {}
        for mode in ("fedasync", "flower-fedavg"):
            name = f"speedup-{mode}-s{seed}"
            overrides = [
                *LIGHT,
                f"client.local_steps={args.local_steps}",
                "lab.compare_sync=false",
                f"run.budget_s={args.budget_s}",
                f"run.seed={seed}",
                "silos.count=8",
                "lab.speed.profile=stragglers",
                "lab.speed.straggler_fraction=0.25",
                "lab.speed.straggler_slowdown=4",
                "lab.emulate_speed=true",
                "server.eval_every=8",
                *args.overrides,
            ]
            summary, bench, run_dir = run_one(out, name, mode, "warm", overrides, args.reuse)
            pair[mode] = {
                **figures(mode, summary, run_dir, bench["budget_s"]),
                **bench,
                "mode": mode,
                "seed": seed,
            }
        target = 0.95 * min(r["best"] for r in pair.values())
        for mode, r in pair.items():
            r["target"], r["time_to_target_s"] = target, time_to_target(r["evals"], target)
            rows[f"speedup-{mode}-s{seed}"] = r
    print(
        f"\n{'seed':>4s} {'mode':14s} {'load':>9s} {'updates':>7s} {'rt_mean':>7s} {'train':>6s} "
        f"{'upd/s':>6s} {'best':>6s} {'target':>6s} {'t_target':>8s}"
    )
    for r in rows.values():
        print(
            f"{r['seed']:4d} {r['mode']:14s} {r['load_before']:4.1f}-{r['load_after']:<4.1f} "
            f"{r['updates']:7d} {fmt(r['rt_mean']):>7s} {fmt(r['train_mean'], '.2f'):>6s} "
            f"{fmt(r['updates_per_wall_s'], '.3f'):>6s} {r['best']:6.3f} {r['target']:6.3f} "
            f"{fmt(r['time_to_target_s'], '.0f'):>8s}"
        )
    ratios = []
    for seed in range(args.reps):
        a, s = rows[f"speedup-fedasync-s{seed}"], rows[f"speedup-flower-fedavg-s{seed}"]
        if a["updates_per_wall_s"] and s["updates_per_wall_s"]:
            ratios.append(a["updates_per_wall_s"] / s["updates_per_wall_s"])
    spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    mean = statistics.fmean(ratios) if ratios else 0.0
    print(
        f"updates per wall second, fedasync / FedAvg, per seed: "
        f"{', '.join(f'{x:.2f}' for x in ratios)}; mean {mean:.2f} +- {spread:.2f} (sd)"
    )
    rows["ratio"] = {"per_seed": ratios, "mean": mean, "sd": spread}
    return rows


def worker_split(run_dir: Path, silos: int) -> dict[str, float] | None:
    """Where a warm round trip goes, from the workers' logs (medians over every silo's
    messages): the worker's own task (pulling its input, the ClientApp, pushing the reply)
    and the gap outside it, from a task's end to the next task's start (SuperNode ->
    SuperLink -> ServerApp take and dispatch -> SuperLink -> SuperNode -> the worker's
    AcquireTask). None for Flower's workers (no such log)."""
    from datetime import datetime

    line_re = re.compile(
        r"(\S+ \S+) INFO fedasync\.worker: task \d+ .* completed in ([0-9.]+) s "
        r"\(pulled ([0-9.]+), ran ([0-9.]+), pushed ([0-9.]+)"
    )
    task, pull, app, push, gap = [], [], [], [], []
    for silo in range(silos):
        log = run_dir / "deploy" / f"silo-{silo}" / f"worker-{silo}.log"
        if not log.exists():
            return None
        ends = []
        for line in log.read_text().splitlines():
            m = line_re.match(line)
            if m:
                end = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                took = float(m.group(2))
                if ends:
                    gap.append(end - took - ends[-1])
                ends.append(end)
                task.append(took)
                pull.append(float(m.group(3)))
                app.append(float(m.group(4)))
                push.append(float(m.group(5)))
    if not gap:
        return None
    med = statistics.median
    return {
        "task": med(task),
        "pull": med(pull),
        "app": med(app),
        "push": med(push),
        "gap": med(gap),
    }


NODE_LINE = re.compile(
    r"INFO (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+):\s+"
    r"(Receiving|Received successfully|Sending|Sent successfully)"
)
NODE_STEPS = {
    ("Receiving", "Received"): "pull",
    ("Received", "Sending"): "reply",
    ("Sending", "Sent"): "push",
    ("Sent", "Receiving"): "between",
}


def node_split(run_dir: Path, silos: int) -> dict[str, float] | None:
    """A message's cycle at its SuperNode, from the SuperNodes' timestamped logs (medians over
    every silo's messages, the first three of each left out: the workers' start): ``pull``
    (SuperLink -> SuperNode: the message found, then its objects pulled), ``reply`` (from then
    until the ClientApp's reply is there; the worker's own pull overlaps the SuperNode's),
    ``push`` (the reply and its objects to the SuperLink) and ``between`` (from that push to
    the next message found: the ServerApp's poll, take and dispatch, and the SuperNode's idle
    sleep). None when the logs have no timestamps (runs before they had)."""
    from datetime import datetime

    steps: dict[str, list[float]] = {v: [] for v in NODE_STEPS.values()}
    for silo in range(silos):
        log = run_dir / "deploy" / f"silo-{silo}" / f"silo-{silo}.log"
        if not log.exists():
            return None
        marks = []
        for line in log.read_text(errors="replace").splitlines():
            m = NODE_LINE.search(line)
            if m:
                at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                marks.append((m.group(2).split()[0], at))
        per: dict[str, list[float]] = {v: [] for v in NODE_STEPS.values()}
        for (a, ta), (b, tb) in zip(marks, marks[1:]):
            if (a, b) in NODE_STEPS:
                per[NODE_STEPS[a, b]].append(tb - ta)
        for k, v in per.items():
            steps[k] += v[3:]
    if not all(steps.values()):
        return None
    return {k: statistics.median(v) for k, v in steps.items()}


def worker_rss(log: Path) -> list[tuple[int, float]]:
    """(messages served, RSS MiB) after each message, from a warm worker's log."""
    out = []
    for line in log.read_text().splitlines():
        if " in this worker)" in line and "rss " in line:
            n = int(line.split(" in this worker)")[0].rsplit("(", 1)[1])
            out.append((n, float(line.rsplit("rss ", 1)[1].split()[0])))
    return out


def part_memory(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Each warm worker's memory over about 500 messages."""
    overrides = [
        *LIGHT,
        "lab.compare_sync=false",
        f"run.budget_s={args.memory_budget_s}",
        f"run.max_versions={args.memory_versions}",
        "silos.count=1",
        "server.eval_every=1000000",
        *args.overrides,
    ]
    _, _, run_dir = run_one(out, "memory-warm-1", "fedasync", "warm", overrides, args.reuse)
    rows = {}
    print(f"\n{'silo':>4s} {'messages':>8s} {'rss@10':>7s} {'rss@100':>8s} {'rss@last':>8s}")
    for silo in range(1):
        points = worker_rss(run_dir / "deploy" / f"silo-{silo}" / f"worker-{silo}.log")
        at = dict(points)
        last = points[-1] if points else (0, None)
        rows[str(silo)] = {
            "messages": last[0],
            "rss_10": at.get(10),
            "rss_100": at.get(100),
            "rss_last": last[1],
        }
        r = rows[str(silo)]
        print(
            f"{silo:4d} {r['messages']:8d} {fmt(r['rss_10'], '.0f'):>7s} "
            f"{fmt(r['rss_100'], '.0f'):>8s} {fmt(r['rss_last'], '.0f'):>8s}"
        )
    print("MiB resident after the worker's 10th, 100th and last message")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--parts", default="overhead,speedup,memory")
    ap.add_argument("--silos", default="3,8", help="overhead part: silo counts")
    ap.add_argument("--overhead-budget-s", type=float, default=60.0)
    ap.add_argument("--workers", default="warm,flower", help="overhead part: worker kinds")
    ap.add_argument("--budget-s", type=float, default=120.0, help="speedup part: wall seconds")
    ap.add_argument("--local-steps", type=int, default=20, help="speedup part: local steps")
    ap.add_argument("--reps", type=int, default=3, help="speedup part: seeds")
    ap.add_argument("--memory-versions", type=int, default=500)
    ap.add_argument("--memory-budget-s", type=float, default=900.0)
    ap.add_argument(
        "--node-idle-max-s",
        default="0.5",
        help="the SuperNodes' longest idle sleep (simulations.node.NODE_SLEEPS; 0.05 = fixed)",
    )
    ap.add_argument("--out", default="runs/bench-deploy")
    ap.add_argument(
        "--reuse", action="store_true", help="take finished runs from --out instead of rerunning"
    )
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (every run)")
    args = ap.parse_args()
    import simulations.node as node

    sleeps = list(node.NODE_SLEEPS)
    sleeps[sleeps.index("--idle-max-s") + 1] = str(float(args.node_idle_max_s))
    node.NODE_SLEEPS = tuple(sleeps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    results: dict[str, Any] = {}
    if "overhead" in parts:
        results["overhead"] = part_overhead(args, out)
    if "memory" in parts:
        results["memory"] = part_memory(args, out)
    if "speedup" in parts:
        results["speedup"] = part_speedup(args, out)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    if "speedup" in results:
        print(f"deploy_speedup_vs_sync={results['speedup']['ratio']['mean']:.2f}")


if __name__ == "__main__":
    main()
