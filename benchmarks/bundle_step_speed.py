"""What fedasync's loop costs per local step on the 3D task, against a plain MONAI loop.

The same bundle (``medical_data.volumes``: 3D BasicUNet, DiceCE, SGD, random 32^3 crops),
the same dataset object, batch, transforms and seeded sampler. Two ways to take ``--steps``
steps:
- ``fedasync``: ``clients.task.BundleTask.train`` (the silo's one loop, ``clients.loop``:
  its stop check, score and loss sums, precision handling);
- ``monai``: a plain loop over a MONAI ``DataLoader``: ``zero_grad``, forward, loss,
  ``backward``, ``step``.

They alternate ``--repeats`` times (these machines are noisy; each pair is run back to back);
on a CPU each is timed by this process's CPU time (one thread), on CUDA by wall time. Prints
each pair's seconds per step, the median ratio ``step_cost_vs_plain_monai`` (the goal: at most
1.10) and its limit (1.0: the same work). On a CPU with one thread per silo, as
simulation runs it. With a CUDA device (``--device cuda``) both run there; with
``--precision bf16|fp16`` fedasync's loop runs in mixed precision and the plain loop under the
same ``torch.autocast`` (fp16 with ``torch.amp.GradScaler``).

    .venv/bin/python benchmarks/bundle_step_speed.py
    .venv/bin/python benchmarks/bundle_step_speed.py --device cuda --precision bf16 --threads 8
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def plain_monai(task, model, steps: int, seed: int, device, precision: str) -> None:  # noqa: ANN001
    """A plain MONAI training loop over the task's dataset, batch and seeded sampler."""
    from monai.data import DataLoader
    from torch.utils.data import RandomSampler

    from fedasync import seeds

    data = task.training_set([])
    size = task.bundle.batch_size()
    sampler = RandomSampler(
        data,
        replacement=True,
        num_samples=steps * size,
        generator=torch.Generator().manual_seed(seed),
    )
    loader = DataLoader(
        data,
        batch_size=size,
        sampler=sampler,
        num_workers=0,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(seeds.torch_seed(seed, "bundle.transforms")),
    )
    model.to(device).train()
    opt = task.bundle.optimizer(model.parameters())
    loss_fn = task.bundle.loss()
    amp = precision != "fp32" and device.type == "cuda"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=amp and precision == "fp16")
    for batch in loader:
        x = batch["image"].to(device, non_blocking=True)
        y = batch["label"].to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        ctx = torch.autocast("cuda", dtype=dtype) if amp else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def timed(fn, device) -> float:  # noqa: ANN001
    """Seconds ``fn`` took: on a CPU this process's CPU time (one thread: the work itself,
    what another process on the machine does not inflate), on CUDA wall time."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(
    bundle_dir: Path, *, steps: int, repeats: int, device: torch.device, precision: str
) -> list[tuple[float, float]]:
    """(fedasync, monai) seconds per step, ``repeats`` pairs after one warm-up pair."""
    from clients.task import BundleTask
    from medical_data.monai_bundle import read_bundle
    from protocol.config import ClientConfig

    b = read_bundle(bundle_dir)
    task = BundleTask(b, b.items("train"), [], cache=len(b.items("train")))
    client = ClientConfig(precision=precision)
    model = task.network()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    pairs = []
    for r in range(repeats + 1):
        model.load_state_dict(start)
        ours = timed(
            lambda r=r: task.train(
                model, steps=steps, client=client, seed=r, exclude=[], device=device, stop=None
            ),
            device,
        )
        model.load_state_dict(start)
        theirs = timed(lambda r=r: plain_monai(task, model, steps, r, device, precision), device)
        if r:  # (the first pair warms caches and kernels)
            pairs.append((ours / steps, theirs / steps))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/bench-bundle-step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from medical_data.volumes import write_brain_volumes, write_bundle

    out = Path(args.out).resolve()
    datalist = write_brain_volumes(out / "data", 16, validation=0, sites=4, seed=0)
    bundle = write_bundle(out / "bundle", datalist.parent)
    device = torch.device(args.device)
    pairs = measure(
        bundle, steps=args.steps, repeats=args.repeats, device=device, precision=args.precision
    )
    for k, (a, b) in enumerate(pairs):
        print(
            f"pair {k}: fedasync {a * 1000:.1f} ms/step, plain MONAI {b * 1000:.1f} ms/step, {a / b:.3f}x"
        )
    ratio = statistics.median(a / b for a, b in pairs)
    rate = 1.0 / statistics.median(a for a, _ in pairs)
    print(f"device={device} precision={args.precision} threads={args.threads}")
    print(f"steps_per_s={rate:.2f}")
    print(f"step_cost_vs_plain_monai={ratio:.3f}  (goal: <= 1.10; limit 1.0: the same work)")


if __name__ == "__main__":
    main()
