"""A MONAI bundle trains as fedasync's task: 3D brain tissue, held-out Dice before and after.

Writes the 3D brain tissue volumes and the model-zoo style bundle of ``medical_data.volumes``
(a 3D BasicUNet, DiceCE, SGD, random 32^3 crops, a NIfTI datalist, sliding-window
validation), then for each seed runs ``fedasync simulate task.bundle=DIR`` through Flower's
simulation engine (4 silos, one per site, one of them 10x slower) and reads:
- the held-out Dice of the initial model (version 0) and of the final one, on the bundle's
  validation volumes (the server's evaluation);
- whether the final model, as the run's bundle wrote it, loads into the bundle's
  ``network_def`` with ``monai.bundle`` and torch alone (strict), and scores the same there.

With ``--deploy`` it also trains the same bundle on a two-hospital deployment (``fedasync
deploy local --bundle``: a SuperLink and two SuperNodes over TLS, each node with the bundle and
its own datalist) and prints its versions and the silos' federated Dice.

Prints per seed, then ``bundle_dice_initial``, ``bundle_dice_final`` (mean ± spread over
seeds), ``bundle_dice_gain_min`` (the smallest gain of a seed) and ``bundle_loads_with_monai``.

    .venv/bin/python benchmarks/bundle_3d.py                    # seeds 0-2
    .venv/bin/python benchmarks/bundle_3d.py --seeds 0 --budget-s 60 --deploy
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spread import fmt, mean_spread  # noqa: E402

from simulations.config import load_config  # noqa: E402
from simulations.launcher import run_engine, setup_logging  # noqa: E402


def monai_alone(bundle: Path, val_items: list[dict]) -> tuple[bool, float]:
    """Load ``bundle``'s model with monai.bundle and torch only; its Dice on ``val_items``
    through the bundle's own validation transforms and inferer, computed with MONAI's
    DiceMetric (mean over foreground classes)."""
    import torch
    from monai.bundle import ConfigParser
    from monai.metrics import DiceMetric
    from monai.networks.utils import one_hot

    parser = ConfigParser()
    parser.read_config(str(bundle / "configs" / "train.json"))
    net = parser.get_parsed_content("network_def")
    missing = net.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    loaded = not missing.missing_keys and not missing.unexpected_keys
    pre = parser.get_parsed_content("validate#preprocessing")
    inferer = parser.get_parsed_content("validate#inferer")
    classes = int(parser["network_def"]["out_channels"])
    metric = DiceMetric(include_background=False, reduction="mean_batch")
    net.eval()
    with torch.no_grad():
        for item in val_items:
            d = pre(dict(item))
            out = inferer(d["image"][None], net)
            pred = one_hot(out.argmax(1, keepdim=True), classes)
            metric(pred, one_hot(d["label"][None].long(), classes))
    return loaded, float(metric.aggregate().nanmean())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--volumes", type=int, default=48)
    ap.add_argument("--budget-s", type=float, default=150.0, help="virtual seconds per run")
    ap.add_argument("--out", default="runs/bench-bundle-3d")
    ap.add_argument("--deploy", action="store_true", help="also a two-hospital deployment")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    setup_logging(out)
    from medical_data.volumes import write_brain_volumes, write_bundle

    datalist = write_brain_volumes(out / "data", args.volumes, validation=8, sites=4, seed=0)
    bundle = write_bundle(out / "bundle", datalist.parent)
    val_items = json.loads(datalist.read_text())["validation"]
    for item in val_items:
        for k in ("image", "label"):
            item[k] = str(datalist.parent / item[k])
    rows = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        cfg = load_config(
            None,
            [
                f"task.bundle={bundle}",
                f"run.out_dir={out}",
                f"run.name=seed{seed}",
                f"run.seed={seed}",
                f"run.budget_s={args.budget_s}",
                "lab.compare_sync=false",
                "silos.count=4",
                "lab.speed.profile=stragglers",
                "lab.speed.straggler_fraction=0.25",
                "lab.speed.straggler_slowdown=10",
                "client.local_steps=5",
                "server.eval_every=10",
                "server.checkpoint_every=0",
                "server.evaluate_silos=false",
                *args.overrides,
            ],
        )
        t0 = time.monotonic()
        s = run_engine(cfg, out / f"seed{seed}")
        final_bundle = out / f"seed{seed}" / "bundle" / "final"
        loaded, dice_monai = monai_alone(final_bundle, val_items)
        rows[seed] = {
            "initial": s["evals"][0]["score"],
            "final": s["final_score"],
            "best": s["best_score"],
            "versions": s["versions"],
            "loads_with_monai": loaded,
            "dice_monai_alone": dice_monai,
            "wall_s": time.monotonic() - t0,
        }
        r = rows[seed]
        print(
            f"seed {seed}: Dice {r['initial']:.4f} -> {r['final']:.4f} (best {r['best']:.4f}) in "
            f"{r['versions']} versions, {r['wall_s']:.0f}s wall; final bundle loads with "
            f"monai.bundle alone: {loaded}, Dice there {dice_monai:.4f}",
            flush=True,
        )
    deploy = None
    if args.deploy:
        from simulations.deploy import deploy_local

        cfg = load_config(
            None,
            [
                f"task.bundle={bundle}",
                f"run.out_dir={out}",
                "run.name=deploy",
                "lab.compare_sync=false",
                "run.max_versions=10",
                "run.budget_s=600",
                "silos.count=2",
                "client.local_steps=5",
            ],
        )
        d = deploy_local(cfg)
        deploy = {"versions": d["versions"], "final": d["final_score"]}
        print(
            f"deployment (2 hospitals, TLS): {d['versions']} versions, Dice {d['final_score']:.4f}"
        )
    gains = [r["final"] - r["initial"] for r in rows.values()]
    (out / "results.json").write_text(json.dumps({"seeds": rows, "deploy": deploy}, indent=2))
    print(f"bundle_dice_initial={fmt(mean_spread([r['initial'] for r in rows.values()]), '.3f')}")
    print(f"bundle_dice_final={fmt(mean_spread([r['final'] for r in rows.values()]), '.3f')}")
    print(f"bundle_dice_gain_min={min(gains):.4f}")
    print(f"bundle_loads_with_monai={all(r['loads_with_monai'] for r in rows.values())}")


if __name__ == "__main__":
    main()
