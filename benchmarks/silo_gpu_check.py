"""Silos on a GPU: what to run when a CUDA machine is at hand (a few minutes).

1. One silo's local steps on the 3D bundle task (``benchmarks/bundle_step_speed.py``'s
   setting) on the GPU in fp32, bf16 and fp16 (``client.precision``), each against a plain
   MONAI loop with the same autocast, and against the CPU's steps per second (one thread, as a
   simulated silo has): ``gpu_steps_per_s_<precision>``, ``gpu_vs_cpu_<precision>`` and
   ``step_cost_vs_plain_monai_<precision>``. A step whose loss is not finite fails the check.
2. Several simulated silos sharing the one GPU through Flower's simulation engine
   (``engine.client_gpus=1/N``, ``client.precision=bf16``): a short ``task.bundle`` run must
   finish with versions and a finite Dice, without running out of memory; prints the versions
   and the Dice.

Prints ``silo_gpu_check=ok`` last, or ``silo_gpu_check=FAILED: ...`` (exit 1). Without CUDA it
says so and exits 0: a CPU run of fedasync needs no GPU.

    .venv/bin/python benchmarks/silo_gpu_check.py
    .venv/bin/python benchmarks/silo_gpu_check.py --silos 8 --budget-s 60
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--silos", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=40.0)
    ap.add_argument("--out", default="runs/bench-silo-gpu")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device on this machine: the GPU checks did not run (CPU runs need none)")
        print("silo_gpu_check=skipped")
        return 0
    from bundle_step_speed import measure

    from medical_data.volumes import write_brain_volumes, write_bundle

    out = Path(args.out).resolve()
    datalist = write_brain_volumes(out / "data", 16, validation=4, sites=4, seed=0)
    bundle = write_bundle(out / "bundle", datalist.parent)
    failures: list[str] = []
    results: dict[str, float] = {}
    torch.set_num_threads(1)
    cpu = measure(bundle, steps=5, repeats=1, device=torch.device("cpu"), precision="fp32")
    cpu_rate = 1.0 / cpu[0][0]
    print(f"cpu (1 thread): {cpu_rate:.2f} steps/s", flush=True)
    gpu = torch.device("cuda")
    for precision in ("fp32", "bf16", "fp16"):
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            print("bf16: not supported by this GPU")
            continue
        pairs = measure(
            bundle, steps=args.steps, repeats=args.repeats, device=gpu, precision=precision
        )
        rate = 1.0 / statistics.median(a for a, _ in pairs)
        ratio = statistics.median(a / b for a, b in pairs)
        results[f"gpu_steps_per_s_{precision}"] = rate
        results[f"gpu_vs_cpu_{precision}"] = rate / cpu_rate
        results[f"step_cost_vs_plain_monai_{precision}"] = ratio
        print(
            f"{precision}: {rate:.1f} steps/s ({rate / cpu_rate:.1f}x the CPU's), "
            f"{ratio:.3f}x a plain MONAI loop",
            flush=True,
        )
    from clients.task import BundleTask
    from medical_data.monai_bundle import read_bundle
    from protocol.config import ClientConfig

    b = read_bundle(bundle)
    for precision in ("bf16", "fp16"):
        task = BundleTask(b, b.items("train"), b.items("validate"))
        model = task.network()
        stats = task.train(
            model,
            steps=5,
            client=ClientConfig(precision=precision),
            seed=0,
            exclude=[],
            device=gpu,
            stop=None,
        )
        if not math.isfinite(stats["train_loss"]):
            failures.append(f"{precision}: the training loss is not finite")
    from simulations.config import load_config
    from simulations.launcher import run_engine

    cfg = load_config(
        None,
        [
            f"task.bundle={bundle}",
            f"run.out_dir={out}",
            "run.name=shared-gpu",
            f"run.budget_s={args.budget_s}",
            "lab.compare_sync=false",
            f"silos.count={args.silos}",
            "data.partition=iid",
            "client.precision=bf16" if torch.cuda.is_bf16_supported() else "client.precision=fp16",
            "client.device=cuda",
            f"engine.client_gpus={1.0 / args.silos:.4f}",
            "server.eval_every=5",
            "server.checkpoint_every=0",
            "server.evaluate_silos=false",
        ],
    )
    try:
        summary = run_engine(cfg, out / "shared-gpu")
        versions, dice = summary["versions"], summary["final_score"]
        print(f"{args.silos} silos on one GPU: {versions} versions, Dice {dice:.4f}")
        if versions < 1 or not math.isfinite(dice):
            failures.append(f"the shared-GPU run made {versions} versions, Dice {dice}")
    except Exception as e:  # noqa: BLE001 - a check reports, it does not crash
        failures.append(f"the shared-GPU run failed: {type(e).__name__}: {str(e)[:200]}")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    if failures:
        print("silo_gpu_check=FAILED: " + "; ".join(failures))
        return 1
    print("silo_gpu_check=ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
