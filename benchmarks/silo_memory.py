"""A silo's memory is bounded by its cache setting, not by the size of its data set.

Writes 3D brain tissue volumes (``medical_data.volumes``: 40^3 voxels, NIfTI) and its bundle,
then, each in a fresh process, one silo (``clients.task.BundleTask``) with 1x and with 10x the
volumes at the same ``task.cache`` trains ``--steps`` local steps and evaluates on its
held-out volumes. Each process reports its peak resident memory (``ru_maxrss``) and its
resident memory once torch and MONAI were imported, before any data (the floor).

For contrast it prints what the silo's volumes would take as arrays in memory (the built-in
benchmarks' way: images float32 and labels int64, every sample at once).

Prints the two peaks, their ratio ``silo_peak_rss_ratio_10x`` (the goal: at most 1.2) and the
same ratio above the floor (``silo_data_rss_ratio_10x``: what the data and the training take
beyond the imports).

    .venv/bin/python benchmarks/silo_memory.py                  # 16 and 160 volumes, cache 4
    .venv/bin/python benchmarks/silo_memory.py --base 8 --cache 0
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rss_mb() -> float:
    """This process's current resident memory, MB (from /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(bundle: str, cache: int, steps: int) -> None:
    """One silo on the whole of ``bundle``'s datalist: train, evaluate, report memory."""
    import torch

    torch.set_num_threads(1)
    import monai.data  # noqa: F401 - the floor counts MONAI's import too

    from clients.task import BundleTask
    from medical_data.monai_bundle import read_bundle
    from protocol.config import ClientConfig

    floor = _rss_mb()
    b = read_bundle(bundle)
    task = BundleTask(b, b.items("train"), b.items("validate"), cache=cache)
    model = task.network()
    cpu = torch.device("cpu")
    task.train(model, steps=steps, client=ClientConfig(), seed=0, exclude=[], device=cpu, stop=None)
    task.evaluate(model, device=cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"floor_mb": floor, "peak_mb": peak, "items": len(task.items)}))


def run_child(bundle: Path, cache: int, steps: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            str(bundle),
            "--cache",
            str(cache),
            "--steps",
            str(steps),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base", type=int, default=16, help="volumes at 1x")
    ap.add_argument("--cache", type=int, default=4, help="task.cache of both runs")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="runs/bench-silo-memory")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.cache, args.steps)
        return
    from medical_data.volumes import SIZE, write_brain_volumes, write_bundle

    out = Path(args.out).resolve()
    rows = {}
    for scale in (1, 10):
        n = args.base * scale
        folder = out / f"x{scale}"
        datalist = write_brain_volumes(folder / "data", n, validation=4, sites=4, seed=0)
        bundle = write_bundle(folder / "bundle", datalist.parent)
        rows[scale] = run_child(bundle, args.cache, args.steps)
        arrays_mb = n * SIZE**3 * (4 + 8) / 2**20
        print(
            f"{n:4d} volumes, cache {args.cache}: peak RSS {rows[scale]['peak_mb']:.0f} MB "
            f"(floor after imports {rows[scale]['floor_mb']:.0f} MB); as arrays in memory "
            f"they alone would take {arrays_mb:.0f} MB",
            flush=True,
        )
    one, ten = rows[1], rows[10]
    above = (ten["peak_mb"] - ten["floor_mb"]) / max(one["peak_mb"] - one["floor_mb"], 1e-9)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"silo_peak_rss_ratio_10x={ten['peak_mb'] / one['peak_mb']:.3f}  (goal: <= 1.2)")
    print(f"silo_data_rss_ratio_10x={above:.3f}  (above the floor of the imports)")


if __name__ == "__main__":
    main()
