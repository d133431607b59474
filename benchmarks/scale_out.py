"""Scale-out: many simulated silos on few Ray actors; throughput and peak memory.

One fedasync run on Flower's simulation engine with 100 silos (brain-tissue, cnn-small) on
a private local Ray of ``engine.num_cpus`` CPUs: silos are virtual nodes (a Flower Context
each, held by the driver), actors are few (``engine.num_cpus``, one CPU each), and
every actor builds the federation's data once and serves every silo from it
(``clients/app.py`` caches it per process). Printed:

- updates per virtual second (accepted updates / virtual seconds) and per wall second
  (accepted updates / the ServerApp's wall time, ``summary.json["wall_time_s"]``);
- peak memory of every process of the run, sampled every 0.5 s: this process (driver and
  ServerApp) and every Ray process, found by a marker in the environment they inherit.
  RSS summed over processes counts shared pages (torch's libraries) once per process; PSS
  shares them out, so its sum is the run's real footprint.

    .venv/bin/python benchmarks/scale_out.py [key=value ...]   # overrides, as for simulate
Last line: ``updates_per_wall_s=<float>``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedasync.processes import pids_with_env  # noqa: E402
from simulations.config import load_config  # noqa: E402
from simulations.launcher import (
    CLIENT_CPUS,  # noqa: E402
    simulate,  # noqa: E402
)

MARKER_ENV = "FEDASYNC_SCALE_OUT_BENCH"

DEFAULTS = [
    "run.name=bench-scale-out",
    "silos.count=100",
    "run.budget_s=60",
    "lab.compare_sync=false",
    "run.progress=false",
    "client.local_steps=5",
    "data.network=cnn-small",
    "server.eval_every=100",
    "server.checkpoint_every=0",
    "server.evaluate_silos=false",
    "server.wait_for_nodes_s=600",  # each actor builds the data once, before its first answer
    "engine.num_cpus=2",
]


def _kib(path: Path, field: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _kind(pid: int) -> str:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"
    if pid == os.getpid():
        return "driver"
    if argv0.startswith("ray::"):
        return "actor" if "ClientAppActor" in argv0 else "ray-worker"
    return Path(argv0.split()[0]).name if argv0 else "?"


class MemorySampler(threading.Thread):
    """Peak RSS and PSS (MiB) of this process and every process carrying the marker."""

    def __init__(self, marker: str, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.marker, self.every_s = marker, every_s
        self.stop = threading.Event()
        self.peak_rss = self.peak_pss = 0.0
        self.at_peak: dict[str, list[float]] = {}
        """RSS (MiB) of each process at the PSS peak, by kind (driver, actor, raylet, ...)."""

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            rss, pss, by_kind = 0.0, 0.0, {}
            for pid in [os.getpid(), *pids_with_env(MARKER_ENV, self.marker)]:
                proc = Path(f"/proc/{pid}")
                try:
                    r = _kib(proc / "status", "VmRSS") / 1024
                    p = _kib(proc / "smaps_rollup", "Pss") / 1024
                except OSError:
                    continue  # exited between the scan and the read
                rss, pss = rss + r, pss + p
                by_kind.setdefault(_kind(pid), []).append(round(r))
            self.peak_rss = max(self.peak_rss, rss)
            if pss > self.peak_pss:
                self.peak_pss, self.at_peak = pss, by_kind


def main(overrides: list[str]) -> None:
    cfg = load_config(None, DEFAULTS + overrides)
    marker = uuid.uuid4().hex
    os.environ[MARKER_ENV] = marker  # inherited by Ray's GCS, raylet and workers
    sampler = MemorySampler(marker)
    sampler.start()
    t0 = time.monotonic()
    summary = simulate(cfg)
    command_wall = time.monotonic() - t0
    sampler.stop.set()
    sampler.join()
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    updates = summary["updates_accepted"]
    actors = (cfg.engine.num_cpus or os.cpu_count() or 1) // CLIENT_CPUS
    figures = {
        "silos": cfg.silos.count,
        "actors": actors,
        "updates_accepted": updates,
        "updates_rejected": summary["updates_rejected_total"],
        "versions": summary["versions"],
        "final_score": round(summary["final_score"], 4),
        "silos_that_trained": sum(1 for s in summary["per_silo"].values() if s["accepted"] > 0),
        "virtual_s": round(summary["virtual_time_s"], 1),
        "server_wall_s": round(summary["wall_time_s"], 1),
        "command_wall_s": round(command_wall, 1),
        "updates_per_virtual_s": round(updates / summary["virtual_time_s"], 2),
        "peak_rss_sum_mib": round(sampler.peak_rss),
        "peak_pss_sum_mib": round(sampler.peak_pss),
        "rss_mib_at_peak_by_process": sampler.at_peak,
    }
    (run_dir / "scale_out.json").write_text(json.dumps(figures, indent=1))
    for k, v in figures.items():
        print(f"{k}={v}")
    print(f"updates_per_wall_s={updates / summary['wall_time_s']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
