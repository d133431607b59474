"""OPD against GRPO per learner token, with a teacher trained by teacher forcing and by DAgger.

Issue 30: distillation pays only if the teacher is worth copying on the student's own
prefixes. A teacher trained by teacher forcing alone has only seen right prefixes; where the
student has already gone wrong its advice is untrained. ``distill.teacher_dagger_steps``
(docs/rl.md, "Teacher") continues its training DAgger-style on its own and a weaker model's
samples, labelled with the task's expert next token. This script measures what that buys.

1. Teachers. Both are trained once and cached under ``--out/teachers``: the supervised one
   (``--teacher-steps`` teacher-forcing steps) and the DAgger one (the same, then
   ``--dagger-steps`` DAgger steps). Printed for each: held-out greedy accuracy and
   *recovery*, how often its argmax is the expert's token after the first mistake of a
   weaker model's sample (its own weights after 100 supervised steps), and on the path
   before it.
2. Runs, all ``sync`` (no staleness: the learning rule alone), ``--steps`` learner steps,
   seeds ``--seeds``, every run of a seed from the same warm-started student:
   GRPO on the exact reward (``distill.loss=none``) at two learning rates, and OPD with
   ``forward_kl`` and ``reverse_kl`` (top-k buckets) from each teacher. Evaluations every
   ``--eval-every`` steps on ``--eval-prompts`` held-out prompts: greedy exact-match accuracy
   and, for OPD, the teacher's recovery on the student's own samples.
3. Cost. Per arm: accuracy gain at the end (mean ± half-range over seeds), learner tokens,
   gain per million learner tokens, and for each gain in ``--gains`` the learner tokens until
   the accuracy (a running mean of three evaluations, against evaluation noise) reaches the
   warm start + that gain and stays there; the ratio GRPO / OPD of those tokens per seed
   (> 1: OPD is cheaper), over the seeds where both reach it (the count is printed).
   ``opd_vs_grpo_cost.png``: accuracy gain against learner tokens per arm.
   Last line: ``opd_tokens_vs_grpo=<x>``, the best GRPO arm's tokens over the best OPD arm's
   to the first gain of ``--gains``, mean over the seeds where both reach it.

    .venv/bin/python benchmarks/opd_vs_grpo_cost.py --out runs/bench_opd_cost     # ~25 min
    .venv/bin/python benchmarks/opd_vs_grpo_cost.py --quick                       # ~6 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# the sibling script, by its folder (an installed package also calls itself "benchmarks")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from opd_async_vs_sync import overrides, run_all, run_one, stats  # noqa: E402

GRPO = {"distill.loss": "none", "learner.correction": "decoupled"}
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "grpo-lr3e-4": ("GRPO, lr 3e-4", {**GRPO, "learner.lr": 3e-4}),
    "grpo-lr1e-3": ("GRPO, lr 1e-3", {**GRPO, "learner.lr": 1e-3}),
    "opd-fkl-sup": ("OPD forward_kl, supervised teacher", {"distill.loss": "forward_kl"}),
    "opd-fkl-dagger": ("OPD forward_kl, DAgger teacher", {"distill.loss": "forward_kl"}),
    "opd-rkl-sup": ("OPD reverse_kl, supervised teacher", {"distill.loss": "reverse_kl"}),
    "opd-rkl-dagger": ("OPD reverse_kl, DAgger teacher", {"distill.loss": "reverse_kl"}),
}
"""label and overrides per arm; a ``-dagger`` arm also gets the DAgger teacher's settings."""


def dagger_keys(args: argparse.Namespace) -> dict[str, Any]:
    return {"distill.teacher_dagger_steps": args.dagger_steps}


def arm_overrides(args: argparse.Namespace, arm: str, seed: int, **extra: Any) -> list[str]:
    _, ov = ARMS[arm]
    more = dagger_keys(args) if arm.endswith("-dagger") else {}
    return overrides(args, seed, **{"rollout.mode": "sync", **ov, **more, **extra})


def smoothed(evals: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(learner tokens, running mean of the last three accuracies) at each evaluation."""
    out = []
    for i, e in enumerate(evals):
        window = [x["accuracy"] for x in evals[max(0, i - 2) : i + 1]]
        out.append((e["learner_tokens"], statistics.fmean(window)))
    return out


def tokens_to(run: dict[str, Any], gain: float) -> int | None:
    """Learner tokens at the first evaluation after which the smoothed accuracy stays at or
    above the warm start + ``gain``; None if it never does."""
    target = run["initial_accuracy"] + gain - 1e-12
    at = None
    for tokens, acc in smoothed(run["evals"]):
        if acc >= target:
            at = tokens if at is None else at
        else:
            at = None
    return at


def teacher_line(name: str, info: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}"

    line = (
        f"| {name} | {f(info.get('accuracy'))} | {f(info.get('recovery'))} | "
        f"{f(info.get('on_path'))} |"
    )
    if "supervised_recovery" in info:
        line += (
            f" (before DAgger: accuracy {f(info['supervised_accuracy'])}, "
            f"recovery {f(info['supervised_recovery'])})"
        )
    return line


def report(args: argparse.Namespace, res: dict[str, Any], teachers: dict[str, Any]) -> None:
    sup, dag = teachers.get("supervised", {}), teachers.get("DAgger", {})
    if sup.get("recovery") is None and "supervised_recovery" in dag:
        # a supervised teacher cached before recovery was recorded: the DAgger teacher's
        # measure of it, on the same prefixes
        sup |= {"recovery": dag["supervised_recovery"], "on_path": dag["supervised_on_path"]}
    print("\n## Teachers (held-out; recovery on a weaker model's samples)")
    print("| teacher | accuracy | recovery after a mistake | on the path |")
    print("|---|---|---|---|")
    for name, info in teachers.items():
        print(teacher_line(name, info))

    print(
        f"\n## Cost (sync, {args.steps} steps, seeds {args.seeds}: mean ± half-range; "
        f"tokens to a gain: smoothed accuracy reached and kept, mean over the seeds that do)"
    )
    head = "| arm | gain at the end | learner tokens | gain per 1M tokens | teacher recovery |"
    head += "".join(f" tokens to +{g:.2f} |" for g in args.gains)
    print(head)
    print("|---|---|---|---|---|" + "---|" * len(args.gains))
    table: dict[str, dict[str, Any]] = {}
    for arm in args.arms:
        rows = [res[f"{arm}-s{x}"] for x in args.seeds]
        gains = [r["final_accuracy"] - r["initial_accuracy"] for r in rows]
        toks = [r["learner_tokens"] for r in rows]
        rec = [r["evals"][0].get("teacher_recovery") for r in rows]
        rec_ok = [x for x in rec if x is not None]
        to = {g: [tokens_to(r, g) for r in rows] for g in args.gains}
        table[arm] = {"gains": gains, "to": to}
        cells = "".join(
            f" {statistics.fmean([t for t in ts if t is not None]):.0f} "
            f"({sum(t is not None for t in ts)}/{len(ts)}) |"
            if any(t is not None for t in ts)
            else f" never (0/{len(ts)}) |"
            for ts in to.values()
        )
        print(
            f"| {ARMS[arm][0]} | {stats(gains)} | {statistics.fmean(toks):.0f} | "
            f"{stats([g / t * 1e6 for g, t in zip(gains, toks)])} | "
            f"{stats(rec_ok) if rec_ok else '-'} |{cells}"
        )

    g0 = args.gains[0]
    grpo = [a for a in args.arms if a.startswith("grpo")]
    opd = [a for a in args.arms if a.startswith("opd")]
    if not grpo or not opd:
        return

    def best(arms: list[str]) -> str:  # most seeds reaching the first gain, then fewest tokens
        def key(a: str) -> tuple[int, float]:
            ts = [t for t in table[a]["to"][g0] if t is not None]
            return (-len(ts), statistics.fmean(ts) if ts else float("inf"))

        return min(arms, key=key)

    print(f"\n## Ratio of learner tokens to +{g0:.2f}, GRPO / OPD, per seed (> 1: OPD cheaper)")
    ratios: dict[tuple[str, str], list[float]] = {}
    for o in opd:
        for gr in grpo:
            rs = [
                a / b
                for a, b in zip(table[gr]["to"][g0], table[o]["to"][g0])
                if a is not None and b is not None
            ]
            ratios[(gr, o)] = rs
            print(
                f"- {ARMS[o][0]} against {ARMS[gr][0]}: "
                + (f"{stats(rs)} ({len(rs)}/{len(args.seeds)} seeds)" if rs else "no seed")
            )
    bg, bo = best(grpo), best(opd)
    plot(args, res, Path(args.out) / "opd_vs_grpo_cost.png")
    head_r = ratios[(bg, bo)]
    print(f"\nbest GRPO arm: {ARMS[bg][0]}; best OPD arm: {ARMS[bo][0]}")
    print(
        f"opd_tokens_vs_grpo={statistics.fmean(head_r):.3f}" if head_r else "opd_tokens_vs_grpo=nan"
    )


def plot(args: argparse.Namespace, res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for arm in args.arms:
        rows = [res[f"{arm}-s{x}"] for x in args.seeds]
        n = min(len(r["evals"]) for r in rows)
        xs = [statistics.fmean(r["evals"][i]["learner_tokens"] for r in rows) for i in range(n)]
        ys = [[r["evals"][i]["accuracy"] - r["initial_accuracy"] for r in rows] for i in range(n)]
        m = [statistics.fmean(y) for y in ys]
        style = "--" if arm.startswith("grpo") else "-"
        (line,) = ax.plot(xs, m, style, marker="o", ms=3, label=ARMS[arm][0])
        ax.fill_between(
            xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.12, color=line.get_color()
        )
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("learner tokens")
    ax.set_ylabel("held-out accuracy gain over the warm start")
    ax.set_title(f"OPD against GRPO, sync ({len(args.seeds)} seeds: mean, min–max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--quick", action="store_true", help="two seeds, short")
    ap.add_argument("--out", default="runs/bench_opd_cost")
    ap.add_argument("--procs", "--jobs", dest="procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--warm-start", type=int, default=80)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3, help="OPD's learning rate")
    ap.add_argument("--correction", default="none", help="OPD's learner.correction")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--teacher-steps", type=int, default=1500)
    ap.add_argument("--dagger-steps", type=int, default=500)
    ap.add_argument("--gains", type=float, nargs="+", default=[0.05, 0.10])
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--reuse", action="store_true", help="report from --out's results.json")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.steps, args.dagger_steps = [0, 1], 30, 100
    args.costs = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.reuse:
        saved = json.loads((out / "results.json").read_text())
        report(args, saved["runs"], saved["teachers"])
        return
    # 1. both teachers (trained once, cached) and the per-token costs, from two probe runs
    probe = run_one(
        ("probe-sup", arm_overrides(args, "opd-fkl-sup", args.seeds[0], **{"run.max_steps": 1}))
    )
    args.costs = {
        "gen_token_s": probe["gen_token_s"],
        "learn_token_s": probe["learn_token_s"],
        "teacher_token_s": probe["distill"]["teacher_token_s"],
    }
    teachers = {"supervised": probe["distill"]["teacher"]}
    if any(a.endswith("-dagger") for a in args.arms):
        dprobe = run_one(
            (
                "probe-dagger",
                arm_overrides(args, "opd-fkl-dagger", args.seeds[0], **{"run.max_steps": 1}),
            )
        )
        teachers["DAgger"] = dprobe["distill"]["teacher"]
    print(
        f"student after its warm start (seed {args.seeds[0]}): {probe['initial_accuracy']:.3f}",
        flush=True,
    )
    # 2. the runs
    jobs = [
        (f"{arm}-s{seed}", arm_overrides(args, arm, seed))
        for seed in args.seeds
        for arm in args.arms
    ]
    res = run_all(args, jobs)
    keep = ("final_accuracy", "initial_accuracy", "learner_tokens", "evals", "wall_s")
    (out / "results.json").write_text(
        json.dumps(
            {
                "args": {k: v for k, v in vars(args).items() if k != "costs"},
                "costs": args.costs,
                "teachers": teachers,
                "runs": {k: {kk: v.get(kk) for kk in keep} for k, v in res.items()},
            },
            indent=1,
        )
    )
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; results in {out}/results.json")
    report(args, res, teachers)


if __name__ == "__main__":
    main()
