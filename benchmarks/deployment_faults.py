"""Deployment faults across real hosts: the coordinator and each hospital in a network
namespace of their own (simulations.hosts), a real SuperLink, SuperNodes, ServerApp and warm
workers over TLS to the coordinator's address (simulations.placement.OnHosts).

Scenarios (issue 32); this script runs those built so far and says which are not yet:
  partition   hospital 0's link down (packets dropped, no reset) for --cut-s seconds during
              training, then back. Reported: the others' update rate before and during the
              cut, seconds from the link's return to hospital 0's first update and to its full
              rate again, its stale reply's staleness, updates applied twice (must be 0),
              and the final score against an undisturbed run of the same seed.
  (not yet)   partition during an erasure, a 10 Mbit/s hospital against FedAvg, the
              coordinator's restart, flwr stop.

Needs root (namespaces); prints why and exits 2 otherwise. Usage:
  .venv/bin/python benchmarks/deployment_faults.py [--seeds 0,1,2] [--cut-s 20] [--budget-s 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedasync.events import read_events  # noqa: E402
from simulations.config import load_config  # noqa: E402
from simulations.deploy import deploy_local  # noqa: E402
from simulations.hosts import HostFederation, available  # noqa: E402
from simulations.placement import OnHosts  # noqa: E402

WARM_UPDATES = 60
"""Updates applied before the cut: the rates before it are those of a run in its stride."""
RATE_WINDOW_S = 5.0
"""Seconds over which an update rate is measured (before the cut, and back at full rate)."""


def _config(out: Path, name: str, seed: int, budget_s: float):
    return load_config(
        None,
        [
            f"run.out_dir={out}",
            f"run.name={name}",
            f"run.seed={seed}",
            "run.compare_sync=false",
            "run.progress=false",
            f"run.budget_s={budget_s}",
            "silos.count=3",
            "silos.speed_profile=uniform",
            "client.local_steps=2",
            "client.batch_size=16",
            "data.max_samples=600",
            "server.eval_every=10",
            "server.checkpoint_every=0",
            "server.evaluate_silos=false",
        ],
    )


def _updates(path: Path) -> list[dict]:
    try:
        return [e for e in read_events(path) if e["event"] == "update"]
    except OSError:
        return []


def _rate(events: list[dict], silo: int | None, t0: float, t1: float) -> float:
    n = sum(1 for e in events if t0 <= e["wall"] < t1 and (silo is None or e["silo"] == silo))
    return n / max(t1 - t0, 1e-9)


def partition(out: Path, seed: int, cut_s: float, budget_s: float) -> dict:
    """One run with hospital 0 cut off, and its figures."""
    cfg = _config(out, f"partition-{seed}", seed, budget_s)
    metrics = Path(cfg.run.out_dir) / cfg.run.name / "metrics.jsonl"
    seen: dict[int, float] = {}  # update index -> wall time first seen
    marks: dict[str, float] = {}

    def watch(fed: HostFederation, stop: threading.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            for i in range(len(seen), len(_updates(metrics))):
                seen[i] = now
            if "cut" not in marks and len(seen) >= WARM_UPDATES:
                marks["cut"] = now
                fed.partition("hospital0")
            if "cut" in marks and "healed" not in marks and now - marks["cut"] >= cut_s:
                marks["healed"] = now
                fed.heal("hospital0")
            time.sleep(0.05)

    with HostFederation(["coordinator", "hospital0", "hospital1", "hospital2"]) as fed:
        stop = threading.Event()
        t = threading.Thread(target=watch, args=(fed, stop), daemon=True)
        t.start()
        try:
            summary = deploy_local(cfg, where=OnHosts(fed), echo=lambda line: None)
        finally:
            stop.set()
            t.join(timeout=30)
    events = _updates(metrics)
    for i, e in enumerate(events):
        e["wall"] = seen.get(i, float("inf"))
    cut, healed = marks.get("cut"), marks.get("healed")
    if cut is None or healed is None:
        return {"seed": seed, "error": "the run ended before the partition was over"}
    first = next((e for e in events if e["silo"] == 0 and e["wall"] > healed), None)
    before = _rate(events, 0, cut - RATE_WINDOW_S, cut)
    back_full = None
    if first is not None:
        for e in events:
            if e["silo"] == 0 and e["wall"] >= first["wall"]:
                if _rate(events, 0, e["wall"], e["wall"] + RATE_WINDOW_S) >= 0.8 * before:
                    back_full = e["wall"] - healed
                    break
    jobs = [(e["silo"], e["job"]) for e in events]
    return {
        "seed": seed,
        "others_rate_before": _rate(events, None, cut - RATE_WINDOW_S, cut) - before,
        "others_rate_during": _rate(events, None, cut, healed),
        "h0_rate_before": before,
        "h0_first_update_after_heal_s": None if first is None else first["wall"] - healed,
        "h0_full_rate_after_heal_s": back_full,
        "h0_first_staleness": None if first is None else first["staleness"],
        "applied_twice": len(jobs) - len(set(jobs)),
        "versions": summary["versions"],
        "final_score": summary.get("final_accuracy"),
    }


def undisturbed(out: Path, seed: int, budget_s: float) -> dict:
    """The same seed with no fault: its versions and final score."""
    cfg = _config(out, f"undisturbed-{seed}", seed, budget_s)
    with HostFederation(["coordinator", "hospital0", "hospital1", "hospital2"]) as fed:
        summary = deploy_local(cfg, where=OnHosts(fed), echo=lambda line: None)
    return {
        "seed": seed,
        "versions": summary["versions"],
        "final_score": summary.get("final_accuracy"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--cut-s", type=float, default=20.0)
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--out", default="runs/bench-deployment-faults")
    args = ap.parse_args()
    why = available()
    if why is not None:
        print(f"deployment_faults: cannot make network namespaces here: {why}")
        return 2
    out = Path(args.out).resolve()
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        p = partition(out, seed, args.cut_s, args.budget_s)
        u = undisturbed(out, seed, args.budget_s)
        p["undisturbed_score"] = u["final_score"]
        rows.append(p)
        print(json.dumps(p), flush=True)
    ok = [r for r in rows if "error" not in r]
    if ok:
        back = [r["h0_first_update_after_heal_s"] for r in ok if r["h0_first_update_after_heal_s"]]
        print(
            f"partition ({args.cut_s:.0f} s, {len(ok)} seeds): others' rate during/before "
            f"{statistics.fmean(r['others_rate_during'] for r in ok):.2f}/"
            f"{statistics.fmean(r['others_rate_before'] for r in ok):.2f} updates/s; hospital 0 "
            f"back {min(back, default=float('nan')):.1f}-{max(back, default=float('nan')):.1f} s "
            f"after its link; applied twice {sum(r['applied_twice'] for r in ok)}"
        )
    print("not yet: partition during erasure, 10 Mbit/s vs FedAvg, coordinator restart, flwr stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
