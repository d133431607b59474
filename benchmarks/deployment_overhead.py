"""What Flower's deployment engine costs per message, and async against Flower's own FedAvg.

On loopback with TLS and SuperNode authentication (``simulations.deploy.deploy_local``: one
SuperLink, one SuperNode per silo, the same ClientApp), for 3 and 8 silos, one deployment at
a time:

- ``fedasync``: fedasync's ServerApp (``server.app:app``, server.mode=fedasync) on the wall
  clock: a silo is re-sent work as soon as its reply is taken;
- ``flower-fedavg``: Flower's synchronous ``flwr.serverapp.strategy.FedAvg`` round loop
  adapted to our protocol (``server.flower_sync:app``): every silo each round, a barrier,
  ``send_and_receive`` polling every 3 s.

Per run: the round trip of a train message, dispatch -> reply taken by the ServerApp (for
fedasync: the time between two takes of the same silo's replies, as ``deploy.json`` measures
it, since the silo is re-sent work at once; for FedAvg: exact, from the strategy's records),
mean and median; Flower's overhead per message = round trip - the ClientApp's own training
seconds (``train_seconds`` in its reply metrics): a fresh ClientApp process with torch and MONAI
imports, the SuperNodes' 3 s polls, TLS transport, and for FedAvg the wait at the barrier;
updates per wall second once training has started: per silo, its updates / (its last take -
the first dispatch), summed over silos (``upd/s``: the rate at which the deployment delivers
updates; fedasync stops at the budget with work in flight and FedAvg finishes the round it
started before it, so neither is charged for the cut), and, coarser with runs this short,
updates taken within ``--budget-s`` of the first dispatch / ``--budget-s`` (``upd/s_B``,
counted in whole round trips); the time from the first
dispatch to a target test accuracy (``--target``, default 95% of the lower of the two runs'
best scores, so that both reach it); and the 1-minute load average (``/proc/loadavg``)
before and after each run, since the machine is shared.

The last line, ``deploy_speedup_vs_sync=<x>``, is fedasync's updates per wall second divided by
Flower FedAvg's at 8 silos: how many more local updates the asynchronous loop gets out of the
same deployment in the same time (it does not weigh what an update is worth; the time to
target does).

    .venv/bin/python benchmarks/deployment_overhead.py                      # 3 and 8 silos
    .venv/bin/python benchmarks/deployment_overhead.py --silos 3 --budget-s 60 run.seed=1
    .venv/bin/python benchmarks/deployment_overhead.py --reuse   # the table from finished runs

Every run's processes are stopped by ``deploy_local`` (by process group, pid and an
environment marker); the script then checks that none of their pids is still alive.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedasync.events import read_events  # noqa: E402
from server.summary import time_to_target  # noqa: E402
from simulations.config import load_config  # noqa: E402
from simulations.deploy import deploy_local  # noqa: E402
from simulations.deploy_progress import takes, training_start  # noqa: E402
from simulations.processes import alive  # noqa: E402

SERVERAPPS = {
    "fedasync": ("server.app:app", ["server.mode=fedasync"]),
    "flower-fedavg": ("server.flower_sync:app", []),
}


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
        "best": summary["best_accuracy"],
        "final": summary["final_accuracy"],
        "evals": [{**e, "t": max(0.0, e["t"] - start)} for e in summary["evals"]],
        "wall_s": d["wall_s"],
        "processes": len(d["pids"]),
        "left_running": d["left_running"],
    }


def reuse(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A finished run's summary (with its deploy.json) and load averages (``--reuse``)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["deployment"] = json.loads((run_dir / "deploy.json").read_text())
    return summary, json.loads((run_dir / "bench.json").read_text())


def prefixed(name: str) -> Callable[[str], None]:
    """Echo for one run's console lines."""
    return lambda line: print(f"[{name}] {line}", flush=True)


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--silos", default="3,8", help="silo counts, comma-separated")
    ap.add_argument("--budget-s", type=float, default=150.0, help="wall seconds of training")
    ap.add_argument("--modes", default="fedasync,flower-fedavg")
    ap.add_argument("--target", type=float, help="test score to reach (default: see above)")
    ap.add_argument("--out", default="runs/bench-deploy")
    ap.add_argument(
        "--reuse", action="store_true", help="take finished runs from --out instead of rerunning"
    )
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args()
    out = Path(args.out)
    common = [
        f"run.out_dir={out}",
        f"run.budget_s={args.budget_s}",
        "run.compare_sync=false",
        "data.max_samples=600",
        "data.network=cnn-small",
        "client.num_threads=1",
        "client.local_steps=5",
        "silos.speed_profile=uniform",
        "server.eval_every=2",
        "server.checkpoint_every=0",
        "server.evaluate_silos=false",
    ]
    rows: dict[str, dict[str, Any]] = {}
    pids: list[int] = []
    for n in [int(x) for x in args.silos.split(",")]:
        for mode in args.modes.split(","):
            serverapp, extra = SERVERAPPS[mode]
            name = f"{mode}-{n}"
            cfg = load_config(
                None, common + extra + [f"silos.count={n}", f"run.name={name}"] + args.overrides
            )
            run_dir = out / name
            if args.reuse and (run_dir / "bench.json").exists():
                summary, bench = reuse(run_dir)
            else:
                load_before = loadavg()
                t0 = time.monotonic()
                summary = deploy_local(cfg, echo=prefixed(name), serverapp=serverapp)
                bench = {"load_before": load_before, "load_after": loadavg()}
                bench["budget_s"] = cfg.run.budget_s
                (run_dir / "bench.json").write_text(json.dumps(bench) + "\n")
                print(f"[{name}] done in {time.monotonic() - t0:.0f}s wall", flush=True)
                pids += summary["deployment"]["pids"]  # reused runs were checked when they ran
            rows[name] = {
                **figures(mode, summary, run_dir, bench["budget_s"]),
                **bench,
                "silos": n,
                "mode": mode,
            }
    # the target: given, or 95% of the lower best score per silo count (both reach it)
    for n in {r["silos"] for r in rows.values()}:
        same = [r for r in rows.values() if r["silos"] == n]
        target = args.target or 0.95 * min(r["best"] for r in same)
        for r in same:
            r["target"], r["time_to_target_s"] = target, time_to_target(r["evals"], target)
    print(
        f"\n{'silos':>5s} {'mode':14s} {'load':>9s} {'updates':>7s} {'rt_mean':>7s} "
        f"{'rt_med':>7s} {'train':>6s} {'ovh_mean':>8s} {'ovh_med':>7s} {'ready':>6s} "
        f"{'upd/s':>6s} {'upd/s_B':>7s} {'best':>6s} {'target':>6s} {'t_target':>8s}"
    )
    for r in rows.values():
        print(
            f"{r['silos']:5d} {r['mode']:14s} {r['load_before']:4.1f}-{r['load_after']:<4.1f} "
            f"{r['updates_in_budget']:>3d}/{r['updates']:<3d} {fmt(r['rt_mean']):>7s} {fmt(r['rt_median']):>7s} "
            f"{fmt(r['train_mean'], '.2f'):>6s} {fmt(r['overhead_mean']):>8s} "
            f"{fmt(r['overhead_median']):>7s} {fmt(r['reply_ready_mean']):>6s} "
            f"{fmt(r['updates_per_wall_s'], '.3f'):>6s} "
            f"{fmt(r['updates_per_wall_s_in_budget'], '.3f'):>7s} {r['best']:6.3f} {r['target']:6.3f} "
            f"{fmt(r['time_to_target_s'], '.0f'):>8s}"
        )
    print(
        "seconds per train message: rt = dispatch -> reply taken, train = the silo's own "
        "training, ovh = rt - train, ready = dispatch -> reply created (FedAvg); updates = within "
        "the budget/all; load = 1-min load average before-after"
    )
    left = [p for p in sorted(set(pids)) if alive(p)]
    print(
        f"processes started by this invocation: {len(set(pids))}; still running after the runs: {left or 'none'}"
    )
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    a, s = rows.get("fedasync-8"), rows.get("flower-fedavg-8")
    speedup = (
        a["updates_per_wall_s"] / s["updates_per_wall_s"]
        if a and s and a["updates_per_wall_s"] and s["updates_per_wall_s"]
        else 0.0
    )
    print(f"deploy_speedup_vs_sync={speedup:.2f}")


if __name__ == "__main__":
    main()
