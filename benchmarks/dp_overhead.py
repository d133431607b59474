"""What DP-SGD costs a silo: seconds per local step, and test accuracy, with and without DP.

1. Time (wall, on this machine): the default network (cnn-small) on brain-tissue silo 0 of 6,
   batch ``--batch-size``, ``--threads`` torch threads. For each of plain SGD
   (``clients.local.train_local``) and DP-SGD (``clients.dp.train_local_dp``, noise 1.0,
   clipping 1.0): seconds per step inside a long message (``--long-steps`` steps: the
   per-step cost), and seconds per message of ``client.local_steps`` steps (10: what the
   ClientApp does per train message, opacus's set-up included). For DP also the ledger's
   share of a message (budget check and record in SQLite, RDP epsilon). Medians of
   ``--reps`` repetitions after one warm-up.
2. With ``--accuracy``: two short simulations on Flower's simulation engine, same config and
   seed, ``client.dp.enabled`` false and true, and their final and best test accuracy and
   the silos' epsilon (``summary.json``). The commands are printed; each takes about a minute.

    .venv/bin/python benchmarks/dp_overhead.py [--accuracy] [--threads 1] [--reps 7]
Last line: ``dp_step_overhead_x=<ratio of CPU seconds per step, DP / no DP>`` (CPU time, since
wall time on a shared machine mostly measures the other load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clients.dp import sample_rate, train_local_dp  # noqa: E402
from clients.local import train_local  # noqa: E402
from clients.privacy import PrivacyLedger  # noqa: E402
from medical_data.networks import network_for  # noqa: E402
from protocol.config import DataConfig, build_silos  # noqa: E402


def _median(fn, reps: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of this process (all its threads) of
    ``fn()``; CPU time is what to compare on a shared machine (waiting for a core is not in it).
    """
    fn()  # warm-up (opacus's first wrap, allocator)
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def timing(args: argparse.Namespace) -> float:
    torch.set_num_threads(args.threads)
    fed = build_silos(DataConfig(), 6, 0)
    data = fed.silos[0]
    torch.manual_seed(0)
    model = network_for(fed.spec)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    common = dict(task=fed.spec.task, batch_size=args.batch_size, lr=0.05)
    dp = dict(noise_multiplier=1.0, max_grad_norm=1.0)

    def plain(steps: int) -> None:
        model.load_state_dict(start)
        train_local(model, data, steps=steps, **common)  # type: ignore[arg-type]

    def private(steps: int) -> None:
        model.load_state_dict(start)
        train_local_dp(model, data, steps=steps, **common, **dp)  # type: ignore[arg-type]

    tmp = Path(tempfile.mkdtemp(prefix="dp-overhead-"))
    job = iter(range(10**9))
    q = sample_rate(len(data), args.batch_size)

    def ledger() -> None:
        with PrivacyLedger(tmp / "silo-0.sqlite") as led:
            entries = [(1.0, q, args.local_steps)]
            led.check(entries, delta=1e-5, mechanism="rdp", budget=None)
            led.record(entries, silo=0, job_id=next(job), delta=1e-5, mechanism="rdp", budget=None)

    n, k = args.long_steps, args.local_steps
    rows = {}  # name -> (wall s/step, CPU s/step, wall s/message, CPU s/message)
    for name, fn in (("no DP", plain), ("DP-SGD", private)):
        long_wall, long_cpu = _median(lambda fn=fn: fn(n), args.reps)
        msg_wall, msg_cpu = _median(lambda fn=fn: fn(k), args.reps)
        rows[name] = (long_wall / n, long_cpu / n, msg_wall, msg_cpu)
    led_wall, led_cpu = _median(ledger, args.reps)
    print(
        f"cnn-small, brain-tissue silo 0 ({len(data)} samples), batch {args.batch_size}, "
        f"{args.threads} thread(s), Poisson rate q={q:.4f}, noise 1.0, clip 1.0"
    )
    print(
        f"{'':8s} {'s/step':>9s} {'CPU s/step':>11s} {f's/message ({k} steps)':>22s} {'CPU s/message':>14s}"
    )
    for name, r in rows.items():
        print(f"{name:8s} {r[0]:9.4f} {r[1]:11.4f} {r[2]:22.4f} {r[3]:14.4f}")
    dp, no = rows["DP-SGD"], rows["no DP"]
    ratios = [d / p for d, p in zip(dp, no)]
    print(f"ratio    {ratios[0]:8.2f}x {ratios[1]:10.2f}x {ratios[2]:21.2f}x {ratios[3]:13.2f}x")
    print(
        f"ledger check + record per message (not in the DP rows): {led_wall:.4f} s, "
        f"{led_cpu:.4f} CPU s"
    )
    return ratios[1]


def accuracy(args: argparse.Namespace) -> None:
    out = Path(tempfile.mkdtemp(prefix="dp-accuracy-"))
    common = [
        f"run.out_dir={out}",
        "lab.compare_sync=false",
        "run.progress=false",
        f"run.budget_s={args.budget_s}",
    ]
    rows = {}
    for name, extra in (
        ("no DP", []),
        ("DP-SGD", ["client.dp.enabled=true", *args.dp]),
    ):
        run = "dp" if extra else "nodp"
        cmd = [str(ROOT / ".venv/bin/fedasync"), "simulate", f"run.name={run}", *common, *extra]
        print("$", " ".join(cmd), flush=True)
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        s = json.loads((out / run / "summary.json").read_text())
        eps = [v.get("dp_epsilon") for v in s["per_silo"].values()]
        rows[name] = (s, eps, time.monotonic() - t0)
    print(
        f"{'':8s} {'final acc':>9s} {'best acc':>9s} {'versions':>8s} {'wall s':>7s}  epsilon per silo"
    )
    for name, (s, eps, wall) in rows.items():
        e = "-" if eps[0] is None else " ".join(f"{x:.2f}" for x in eps)
        print(
            f"{name:8s} {s['final_score']:9.3f} {s['best_score']:9.3f} "
            f"{s['versions']:8d} {wall:7.0f}  {e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--long-steps", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--accuracy", action="store_true", help="also run the two simulations")
    ap.add_argument("--budget-s", type=float, default=400.0, help="virtual seconds per run")
    ap.add_argument(
        "--dp",
        nargs="*",
        default=["client.dp.noise_multiplier=1.0", "client.dp.max_grad_norm=1.0"],
        help="overrides of the DP run",
    )
    args = ap.parse_args()
    if args.accuracy:
        accuracy(args)
    ratio = timing(args)
    print(f"dp_step_overhead_x={ratio:.2f}")


if __name__ == "__main__":
    main()
