"""The staleness law (arXiv 2607.01083): does the stale surrogate's gradient bias grow as S·η?

Part 1, bias at fixed parameters. From a warm-started policy θ_0 (task ``sort``, short lists)
a chain θ_1..θ_S is made by S plain on-policy GRPO learner steps (Adam, learning rate η,
correction ``none``, one optimiser step per batch; the chain's prompts and sampling seeds are
the same for every η). At θ_S the benchmark takes the gradient of the GRPO surrogate

- ``g_on``: on samples drawn from θ_S (the on-policy gradient);
- ``g_S`` (series ``none``): on samples drawn from θ_0, S versions back, the uncorrected
  surrogate (what ``learner.correction=none`` differentiates);
- ``g_S`` (series ``tis``): the same stale samples weighted by sg(min(π_θS/μ, C)) (C = 2;
  with one optimiser step this is also decoupled PPO's gradient, docs/rl.md).

Both sample sets use the same prompts and the same random streams (common random numbers: a
group is a pure function of weights, seed and group id), so where θ_S and θ_0 sample the same
completion the two gradients cancel exactly and only the real difference is left. bias =
||g_S − g_on|| over N prompts x G samples; each set is split in two halves of prompts to
measure the noise: ``floor_indep`` = the expected ||g_on − g_on'|| of two independent
on-policy estimates of this size (||A − B||/√2), ``floor`` = the standard error of the bias
estimate itself (||d_A − d_B||/2, d = g_S − g_on), and ``bias_db`` = sqrt(bias² − floor²)
its noise-debiased value. Printed per (S, η): bias, bias/||g_on||, bias/(S·η), the
parameter distance and the KL between θ_0 and θ_S; the log-log fit bias ∝ S^p η^q (the law:
p = q = 1) and the coefficient of variation of bias/(S·η) over the grid (the law: small),
also over the points before saturation (bias < ||g_on||) and beside bias/|θ_S − θ_0| and
bias/sqrt(KL(θ_0||θ_S)), the other candidates for what the bias follows.

Part 2, collapse. Real asynchronous training (``RLRun``, ``rollout.mode=async``: every
trajectory is learnt exactly S versions after its behaviour policy, correction ``none``,
virtual clock) from the same warm start, for T learner steps, on a grid of S and η and for a
few cells with other T, on several seeds. A run has collapsed when its held-out greedy
accuracy (128 prompts, every 5 steps) ends (mean of the last two evaluations) more than X =
0.25 below its peak (``reward_drop``: 0.25 is 4-5 standard errors of a 128-prompt accuracy).
Two other detectors are reported beside it and do not decide: ``entropy_floor`` (the mean
token entropy of the last 5 steps below 0.02 nats) and ``grad_spike`` (a step whose
pre-clip gradient norm exceeds 10x the median of the steps before it, after 5 steps). The
phase diagram (S vs η, T fixed; and T vs η at fixed S) is drawn with the iso-lines S·η and
T·η; for each candidate variable (η, S·η, T·η, (S+1)·η, (S+1)·T·η) the best single-threshold
classifier of collapsed vs stable runs and the rank correlation with the accuracy drop say
which separates better.

Writes ``results.json``, ``bias_vs_s_eta.png`` and ``phase_diagram.png`` under ``--out``;
last line ``staleness_bias_per_s_eta_cv=<coefficient of variation of the noise-debiased
bias/(S·η) over the Part 1 grid, uncorrected series, seed-averaged>`` (0 when the law holds
exactly).

    .venv/bin/python benchmarks/rl_staleness_law.py            # ~15 min on 2 busy CPU cores
    .venv/bin/python benchmarks/rl_staleness_law.py --quick    # ~3 min
    .venv/bin/python benchmarks/rl_staleness_law.py --skip-part2
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from fedasync.events import read_events  # noqa: E402
from fedasync.importance import decoupled_ppo_loss, importance_ratio, masked_mean  # noqa: E402
from trainers.rl.backend import build_policy, build_task  # noqa: E402
from trainers.rl.config import load_rl_config  # noqa: E402
from trainers.rl.engine import RLRun  # noqa: E402
from trainers.rl.learner import Learner, grpo_advantages, pad_rows  # noqa: E402
from trainers.rl.policy import sequence_logprobs, warm_start  # noqa: E402
from trainers.rl.rollout import Group, generate_group  # noqa: E402

MEASURE_OFFSET = 5_000_000
"""First group id of the gradient-measurement prompts (the chain uses ids from 0)."""
CLIP_EPS = 0.2
TIS_CAP = 2.0
SERIES = ("none", "tis")

# ------------------------------------------------------------------ pure helpers (tested)


def coefficient_of_variation(xs: list[float]) -> float:
    """Population std / mean of ``xs`` (nan for fewer than 2 values or a zero mean)."""
    if len(xs) < 2:
        return math.nan
    m = statistics.fmean(xs)
    return statistics.pstdev(xs) / m if m != 0 else math.nan


def split_bias(d_a: torch.Tensor, d_b: torch.Tensor) -> dict[str, float]:
    """Bias of a difference estimator from its two half-batch estimates ``d_a``, ``d_b``.

    The full estimate is d = (d_a + d_b)/2; with independent halves of equal variance σ²,
    E||d_a − d_b||² = 2σ² and Var(d) = σ²/2, so its standard error is ||d_a − d_b||/2 and
    E||d||² = ||bias||² + floor², whence the debiased sqrt(max(0, ||d||² − floor²))."""
    d = (d_a + d_b) / 2
    raw = float(d.norm())
    floor = float((d_a - d_b).norm()) / 2
    return {"bias": raw, "floor": floor, "bias_db": math.sqrt(max(0.0, raw**2 - floor**2))}


def loglog_fit(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares log y = c + p log s + q log e over rows (s, e, y), y > 0: (p, q, c)."""
    pts = [(math.log(s), math.log(e), math.log(y)) for s, e, y in rows if y > 0]
    x = torch.tensor([[1.0, a, b] for a, b, _ in pts], dtype=torch.float64)
    y = torch.tensor([c for _, _, c in pts], dtype=torch.float64)
    sol = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    return float(sol[1]), float(sol[2]), float(sol[0])


def loglog_slope(rows: list[tuple[float, float]]) -> float:
    """Least-squares slope of log y on log x over rows (x, y) with x, y > 0."""
    pts = [(math.log(x), math.log(y)) for x, y in rows if x > 0 and y > 0]
    mx = statistics.fmean(a for a, _ in pts)
    my = statistics.fmean(b for _, b in pts)
    return sum((a - mx) * (b - my) for a, b in pts) / sum((a - mx) ** 2 for a, _ in pts)


def grad_spike(grad_norms: list[float], k: float = 10.0, warmup: int = 5) -> int | None:
    """First step i (>= ``warmup``) whose gradient norm exceeds k x the median of steps < i,
    ignoring steps with a zero norm (no learning signal); None when no step does."""
    for i in range(warmup, len(grad_norms)):
        prev = [g for g in grad_norms[:i] if g > 0]
        if len(prev) >= warmup and grad_norms[i] > k * statistics.median(prev):
            return i
    return None


def collapse_flags(
    accuracies: list[float],
    entropies: list[float],
    grad_norms: list[float],
    drop: float = 0.25,
    entropy_floor: float = 0.02,
    spike_k: float = 10.0,
) -> dict[str, Any]:
    """The three collapse detectors on one run; ``collapsed`` is ``reward_drop`` alone.

    ``accuracies``: held-out accuracies in order (the first is the warm start);
    ``reward_drop``: mean of the last two below max − ``drop``; ``entropy_floor``: mean of
    the last 5 entropies below the floor; ``grad_spike``: :func:`grad_spike` fired."""
    peak = max(accuracies)
    final = statistics.fmean(accuracies[-2:])
    ent = statistics.fmean(entropies[-5:]) if entropies else math.nan
    spike = grad_spike(grad_norms, spike_k)
    flags = {
        "peak_acc": peak,
        "final_acc": final,
        "acc_drop": peak - final,
        "final_entropy": ent,
        "reward_drop": peak - final > drop,
        "entropy_floor": bool(ent < entropy_floor),
        "grad_spike": spike is not None,
        "grad_spike_step": spike,
        "zero_signal_frac": (
            sum(g == 0 for g in grad_norms) / len(grad_norms) if grad_norms else math.nan
        ),
    }
    flags["collapsed"] = flags["reward_drop"]
    return flags


def best_threshold(xs: list[float], labels: list[bool]) -> tuple[float, float]:
    """The threshold t maximising the accuracy of "label iff x > t": (accuracy, t).

    Tied x values go to the same side, so a variable that cannot tell two runs apart gets no
    credit for splitting them."""
    n = len(xs)
    cuts = sorted(set(xs))
    best = (sum(not y for y in labels) / n, math.inf)  # everything predicted stable
    for i, t in enumerate(cuts):
        acc = sum((x > t) == y for x, y in zip(xs, labels, strict=True)) / n
        mid = (t + cuts[i + 1]) / 2 if i + 1 < len(cuts) else t
        if acc > best[0]:
            best = (acc, mid)
    return best


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan


# ------------------------------------------------------------------ Part 1


def base_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    return [
        "task.name=sort",
        f"task.max_len={args.max_len}",
        f"run.seed={seed}",
        f"rollout.group_size={args.group_size}",
    ]


def warm_policy(args: argparse.Namespace, seed: int) -> tuple[Any, Any, dict[str, float]]:
    cfg = load_rl_config(None, base_overrides(args, seed))
    task = build_task(cfg)
    pol = build_policy(cfg)
    info = warm_start(
        pol, task, steps=args.warm_start, batch_size=32, lr=3e-3, seed=seed, device="cpu"
    )
    pol.eval()
    return pol, task, info


def gen_groups(policy: Any, task: Any, seed: int, ids: range, version: int, g: int) -> list:
    policy.eval()
    return [
        generate_group(
            policy,
            task,
            seed=seed,
            group_id=i,
            version=version,
            group_size=g,
            temperature=1.0,
            device=torch.device("cpu"),
        )
        for i in ids
    ]


@torch.no_grad()
def crn_groups(
    policy: Any, task: Any, seed: int, ids: range, version: int, g: int, rows_per_batch: int = 2048
) -> list[Group]:
    """Groups of ``g`` samples for prompts ``ids`` under ``policy``, with common random numbers.

    Sample j of prompt i draws its k-th token by inverting the CDF of the policy's next-token
    distribution at a uniform U[i, j, k] that depends on (seed, i) alone, whatever the policy
    and whatever the other rows do (``generate`` shares one generator among a group's rows,
    so one sample that ends earlier shifts the others' random numbers). Two nearby policies
    then draw the same completion unless their CDFs differ at that uniform: the on-policy and
    stale sets differ only where the policies do, which is what makes the bias measurable."""
    from trainers.rl.rollout import Trajectory
    from trainers.rl.tasks import EOS, decode

    prompts = [task.sample(i, seed) for i in ids]
    uniforms = []
    for i in ids:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + i * 7919 + 29) % (2**63 - 1))
        uniforms.append(torch.rand(g, task.max_new_tokens, generator=gen, dtype=torch.float64))
    rows = [(pi, j) for pi in range(len(prompts)) for j in range(g)]
    toks: dict[tuple[int, int], list[int]] = {r: [] for r in rows}
    lps: dict[tuple[int, int], list[float]] = {r: [] for r in rows}
    policy.eval()
    for start in range(0, len(rows), rows_per_batch):
        active = rows[start : start + rows_per_batch]
        for k in range(task.max_new_tokens):
            if not active:
                break
            seqs = [list(prompts[pi].tokens) + toks[(pi, j)] for pi, j in active]
            lens = torch.tensor([len(x) for x in seqs])
            ids_t = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long)
            for r, x in enumerate(seqs):
                ids_t[r, : len(x)] = torch.tensor(x)
            logits = policy(ids_t)[torch.arange(len(seqs)), lens - 1].double()
            logp = torch.log_softmax(logits, dim=-1)
            cdf = logp.exp().cumsum(-1)
            u = torch.stack([uniforms[pi][j, k] for pi, j in active]) * cdf[:, -1]
            chosen = torch.searchsorted(cdf, u[:, None]).squeeze(1).clamp(max=cdf.shape[1] - 1)
            still = []
            for r, (pi, j) in enumerate(active):
                t = int(chosen[r])
                toks[(pi, j)].append(t)
                lps[(pi, j)].append(float(logp[r, t]))
                if t != EOS:
                    still.append((pi, j))
            active = still
    out = []
    for pi, i in enumerate(ids):
        trajs = []
        for j in range(g):
            t, lp = toks[(pi, j)], lps[(pi, j)]
            text = decode(t)
            trajs.append(
                Trajectory(
                    prompt=prompts[pi].tokens,
                    tokens=t,
                    logprobs=lp,
                    versions=[version] * len(t),
                    reward=float(task.score(prompts[pi], text)),
                    text=text,
                )
            )
        out.append(Group(i, version, trajs))
    return out


def surrogate_grads(
    policy: Any, groups: list[Group], series: tuple[str, ...], chunk: int
) -> dict[str, list[torch.Tensor]]:
    """Per series, the half-batch gradients [A, B] of the GRPO surrogate at ``policy``.

    Chunks of ``chunk`` groups alternate between the halves; a half's gradient is the mean of
    its chunks' gradients (each a token-level mean, as in the learner). Series ``on`` and
    ``none``: decoupled_ppo_loss with behaviour = proximal = the current weights (plain policy
    gradient); ``tis``: the behaviour weight min(π/μ, C) on the stored behaviour log-probs."""
    params = [p for p in policy.parameters() if p.requires_grad]
    sums = {s: [torch.zeros(sum(p.numel() for p in params)) for _ in range(2)] for s in series}
    counts = [0, 0]
    policy.eval()  # dropout is 0; eval() only fixes the mode
    for c, start in enumerate(range(0, len(groups), chunk)):
        half = c % 2
        part = groups[start : start + chunk]
        items = [
            (t, a)
            for g in part
            for t, a in zip(g.trajectories, grpo_advantages([t.reward for t in g.trajectories]))
        ]
        prompts = [t.prompt for t, _ in items]
        comps = [t.tokens for t, _ in items]
        behav = pad_rows([t.logprobs for t, _ in items], 0.0, torch.float32)
        adv = torch.tensor([a for _, a in items], dtype=torch.float32)[:, None]
        new, mask, _ = sequence_logprobs(policy, prompts, comps, 1.0, "cpu")
        behav = behav[:, : new.shape[1]]
        for j, s in enumerate(series):
            prox = new.detach()
            if s in ("on", "none"):
                loss = decoupled_ppo_loss(new, prox, prox, adv, CLIP_EPS, None, mask)
            elif s == "tis":
                loss = decoupled_ppo_loss(new, prox, behav, adv, CLIP_EPS, TIS_CAP, mask)
            else:
                raise ValueError(s)
            gs = torch.autograd.grad(
                loss, params, retain_graph=j + 1 < len(series), allow_unused=True
            )
            flat = torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1)
                    for g, p in zip(gs, params)
                ]
            )
            sums[s][half] += flat
        counts[half] += 1
    return {s: [v[h] / max(counts[h], 1) for h in range(2)] for s, v in sums.items()}


def kl_behaviour(policy: Any, groups: list[Group]) -> float:
    """Mean k3 estimate of KL(μ || π) on the stale tokens (μ the behaviour θ_0, π = policy)."""
    items = [t for g in groups for t in g.trajectories]
    with torch.no_grad():
        new, mask, _ = sequence_logprobs(
            policy, [t.prompt for t in items], [t.tokens for t in items], 1.0, "cpu"
        )
    behav = pad_rows([t.logprobs for t in items], 0.0, torch.float32)[:, : new.shape[1]]
    r = importance_ratio(new, behav).masked_fill(~mask, 1.0)
    return float(masked_mean((r - 1.0) - torch.log(r), mask))


def part1(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    theta0, task, info = warm_policy(args, seed)
    print(f"  part 1 seed {seed}: warm start held-out accuracy {info['accuracy']:.3f}", flush=True)
    ids = range(MEASURE_OFFSET, MEASURE_OFFSET + args.prompts)
    stale = crn_groups(theta0, task, seed, ids, 0, args.group_size)
    vec0 = torch.nn.utils.parameters_to_vector(theta0.parameters()).detach().clone()
    rows = []
    s_max = max(args.staleness)
    for eta in args.lrs:
        pol = copy.deepcopy(theta0)
        lcfg = load_rl_config(
            None, [*base_overrides(args, seed), f"learner.lr={eta}", "learner.correction=none"]
        ).learner
        learner = Learner(pol, lcfg, 1.0, torch.device("cpu"))
        for k in range(s_max):
            batch = gen_groups(
                pol,
                task,
                seed,
                range(k * args.chain_groups, (k + 1) * args.chain_groups),
                k,
                args.group_size,
            )
            learner.step(batch, k)
            s = k + 1
            if s not in args.staleness:
                continue
            pol.eval()
            on = crn_groups(pol, task, seed, ids, s, args.group_size)
            g_on = surrogate_grads(pol, on, ("on",), args.chunk)["on"]
            g_st = surrogate_grads(pol, stale, SERIES, args.chunk)
            full_on = (g_on[0] + g_on[1]) / 2
            vec = torch.nn.utils.parameters_to_vector(pol.parameters()).detach()
            row: dict[str, Any] = {
                "seed": seed,
                "S": s,
                "eta": eta,
                "s_eta": s * eta,
                "param_dist": float((vec - vec0).norm()),
                "kl_0S": kl_behaviour(pol, stale),
                "g_on_norm": float(full_on.norm()),
                "floor_indep": float((g_on[0] - g_on[1]).norm()) / math.sqrt(2),
                "same_samples": sum(
                    a.tokens == b.tokens
                    for ga, gb in zip(on, stale)
                    for a, b in zip(ga.trajectories, gb.trajectories)
                )
                / sum(len(g.trajectories) for g in on),
            }
            for name in SERIES:
                sb = split_bias(g_st[name][0] - g_on[0], g_st[name][1] - g_on[1])
                row[name] = sb | {
                    "rel": sb["bias"] / row["g_on_norm"],
                    "per_s_eta": sb["bias"] / (s * eta),
                    "db_per_s_eta": sb["bias_db"] / (s * eta),
                    "db_per_dtheta": sb["bias_db"] / row["param_dist"],
                    "db_per_sqrt_kl": sb["bias_db"] / math.sqrt(max(row["kl_0S"], 1e-12)),
                }
            rows.append(row)
            print(
                f"    S={s} eta={eta:g}: bias {row['none']['bias']:.4f} "
                f"(floor {row['none']['floor']:.4f}), tis {row['tis']['bias']:.4f}, "
                f"|g_on| {row['g_on_norm']:.3f}, same samples {row['same_samples']:.2f}",
                flush=True,
            )
    return rows


def report_part1(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    seeds = sorted({r["seed"] for r in rows})
    print(
        f"\nPart 1: bias of the stale surrogate's gradient at θ_S (samples from θ_0), sort "
        f"max_len {args.max_len}, warm start {args.warm_start}, chain batches "
        f"{args.chain_groups}x{args.group_size}, measured on {args.prompts} prompts x "
        f"{args.group_size} samples, seeds {seeds} (mean over seeds)"
    )
    print(
        f"{'S':>2} {'eta':>7} {'S*eta':>7} {'|dθ|':>6} {'KL':>7} {'same':>5} {'|g_on|':>6} "
        f"{'fl_ind':>6} | {'none':>6} {'floor':>6} {'db':>6} {'rel':>5} {'db/Sη':>6} "
        f"{'db/dθ':>5} | {'tis':>6} {'floor':>6} {'db':>6} {'db/Sη':>6}"
    )
    table = []
    keys = sorted({(r["S"], r["eta"]) for r in rows})
    for s, eta in keys:
        rs = [r for r in rows if r["S"] == s and r["eta"] == eta]

        def m(f: Any, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.fmean(f(r) for r in rs)

        t = {
            "S": s,
            "eta": eta,
            "s_eta": s * eta,
            **{
                k: m(lambda r, k=k: r[k])
                for k in ("param_dist", "kl_0S", "same_samples", "g_on_norm", "floor_indep")
            },
        }
        for name in SERIES:
            t[name] = {k: m(lambda r, k=k, n=name: r[n][k]) for k in rows[0][name]}
        table.append(t)
        n, c = t["none"], t["tis"]
        print(
            f"{s:>2} {eta:>7.0e} {s * eta:>7.1e} {t['param_dist']:>6.3f} {t['kl_0S']:>7.1e} "
            f"{t['same_samples']:>5.2f} {t['g_on_norm']:>6.3f} {t['floor_indep']:>6.3f} | "
            f"{n['bias']:>6.3f} {n['floor']:>6.3f} {n['bias_db']:>6.3f} {n['rel']:>5.2f} "
            f"{n['db_per_s_eta']:>6.0f} {n['db_per_dtheta']:>5.2f} | {c['bias']:>6.3f} "
            f"{c['floor']:>6.3f} {c['bias_db']:>6.3f} {c['db_per_s_eta']:>6.0f}"
        )
    summary: dict[str, Any] = {"table": table}
    for name in SERIES:
        raw = [t[name]["per_s_eta"] for t in table]
        ratios = [t[name]["db_per_s_eta"] for t in table]
        per_dt = [t[name]["db_per_dtheta"] for t in table]
        per_kl = [t[name]["db_per_sqrt_kl"] for t in table]
        p, q, _ = loglog_fit([(t["S"], t["eta"], t[name]["bias"]) for t in table])
        pd, qd, _ = loglog_fit([(t["S"], t["eta"], t[name]["bias_db"]) for t in table])
        rd = loglog_slope([(t["param_dist"], t[name]["bias_db"]) for t in table])
        above = sum(t[name]["bias"] > 3 * t[name]["floor"] for t in table)
        # before saturation: the stale gradient differs from the on-policy one by less than
        # the on-policy gradient's own norm (beyond, the bias stops growing, whatever S·η)
        small = [t[name]["db_per_s_eta"] for t in table if t[name]["rel"] < 1.0]
        spread = (
            f"max/min {max(ratios) / min(ratios):.1f}x"
            if min(ratios) > 0
            else "some are 0: within the noise"
        )
        summary[name] = {
            "cv_per_s_eta": coefficient_of_variation(ratios),
            "cv_per_s_eta_raw": coefficient_of_variation(raw),
            "cv_per_s_eta_unsaturated": coefficient_of_variation(small),
            "unsaturated_points": len(small),
            "cv_per_dtheta": coefficient_of_variation(per_dt),
            "cv_per_sqrt_kl": coefficient_of_variation(per_kl),
            "min_per_s_eta": min(ratios),
            "max_per_s_eta": max(ratios),
            "exp_S_raw": p,
            "exp_eta_raw": q,
            "exp_S": pd,
            "exp_eta": qd,
            "exp_dtheta": rd,
            "points_above_3_floor": above,
        }
        print(
            f"{name}: debiased bias/(S·η) from {min(ratios):.0f} to {max(ratios):.0f} "
            f"({spread}, CV "
            f"{summary[name]['cv_per_s_eta']:.2f}; raw CV {summary[name]['cv_per_s_eta_raw']:.2f})"
            f"; fit bias ∝ S^{pd:.2f} η^{qd:.2f} (raw S^{p:.2f} η^{q:.2f}; the law: S^1 η^1); "
            f"bias ∝ |dθ|^{rd:.2f}, CV of bias/|dθ| {summary[name]['cv_per_dtheta']:.2f}, "
            f"CV of bias/sqrt(KL(θ_0||θ_S)) {summary[name]['cv_per_sqrt_kl']:.2f}; "
            f"{above}/{len(table)} points have bias > 3x their noise floor; before saturation "
            f"(bias < |g_on|, {len(small)} points) CV of bias/(S·η) "
            f"{summary[name]['cv_per_s_eta_unsaturated']:.2f}"
        )
    ss = sorted({t["S"] for t in table})
    es = sorted({t["eta"] for t in table})
    cell = {(t["S"], t["eta"]): t["none"]["db_per_s_eta"] for t in table}
    print("debiased bias/(S·η), none (rows S, columns η; flat everywhere if the law holds):")
    print("   S " + " ".join(f"{e:>7.0e}" for e in es))
    for s in ss:
        print(f"{s:>4} " + " ".join(f"{cell.get((s, e), math.nan):>7.0f}" for e in es))
    pdist = loglog_fit([(t["S"], t["eta"], t["param_dist"]) for t in table])
    summary["param_dist_exp_S"], summary["param_dist_exp_eta"] = pdist[0], pdist[1]
    print(
        f"parameter distance |θ_S − θ_0| ∝ S^{pdist[0]:.2f} η^{pdist[1]:.2f} (S·η would be "
        f"S^1 η^1: Adam moves every coordinate by about η a step, in directions that change)"
    )
    rel_fl = [t["floor_indep"] / t["none"]["bias"] for t in table if t["none"]["bias"] > 0]
    print(
        f"independent on-policy noise floor / bias (none): from {min(rel_fl):.2f} to "
        f"{max(rel_fl):.2f}; the bias's own floor (common random numbers) is the 'floor' column"
    )
    return summary


def plot_part1(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    markers = {1: "o", 2: "s", 4: "^", 8: "D", 16: "v", 3: "P", 6: "X"}
    colors = {"none": "tab:red", "tis": "tab:blue"}
    for name in SERIES:
        for s in sorted({t["S"] for t in table}):
            ts = [t for t in table if t["S"] == s]
            x = [t["s_eta"] for t in ts]
            axes[0].plot(
                x,
                [t[name]["bias"] for t in ts],
                markers.get(s, "o"),
                color=colors[name],
                mfc=colors[name] if name == "none" else "none",
                label=f"{name}, S={s}",
            )
            axes[0].plot(x, [t[name]["floor"] for t in ts], "_", color=colors[name], ms=8)
            x = [x for x, t in zip(x, ts) if t[name]["bias_db"] > 0]
            ts = [t for t in ts if t[name]["bias_db"] > 0]
            axes[1].plot(
                x,
                [t[name]["db_per_s_eta"] for t in ts],
                markers.get(s, "o"),
                color=colors[name],
                mfc=colors[name] if name == "none" else "none",
            )
            axes[2].plot(
                [t["param_dist"] for t in ts],
                [t[name]["bias_db"] for t in ts],
                markers.get(s, "o"),
                color=colors[name],
                mfc=colors[name] if name == "none" else "none",
            )
    xs = sorted(t["s_eta"] for t in table)
    pos = [t["none"]["db_per_s_eta"] for t in table if t["none"]["db_per_s_eta"] > 0]
    k = math.exp(statistics.fmean(math.log(v) for v in pos))
    axes[0].plot(xs, [k * x for x in xs], "k--", lw=0.8, label="∝ S·η (geometric-mean slope)")
    axes[0].plot(
        xs,
        [t["floor_indep"] for t in sorted(table, key=lambda t: t["s_eta"])],
        ":",
        color="grey",
        label="independent on-policy floor",
    )
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("S·η")
        ax.grid(alpha=0.3, which="both")
    axes[2].set_xlabel("parameter distance |θ_S − θ_0|")
    axes[2].set_ylabel("debiased bias")
    axes[2].set_title("the same points against how far the weights moved")
    axes[0].set_ylabel("||g_S − g_on||  (dashes: its noise floor)")
    axes[1].set_ylabel("debiased bias / (S·η)  (flat if the law holds)")
    axes[0].legend(fontsize=7, ncol=2)
    axes[0].set_title("gradient bias of the stale surrogate")
    axes[1].set_title("filled: none, hollow: tis")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ Part 2


def run_cell(
    args: argparse.Namespace,
    out: Path,
    seed: int,
    s: int,
    eta: float,
    steps: int,
    warm: dict[str, torch.Tensor],
) -> dict[str, Any]:
    name = f"S{s}-lr{eta:g}-T{steps}-s{seed}"
    cfg = load_rl_config(
        None,
        [
            *base_overrides(args, seed),
            f"run.out_dir={out}",
            f"run.name={name}",
            f"run.max_steps={steps}",
            "run.eval_every=5",
            f"run.eval_prompts={args.eval_prompts}",
            "run.progress=false",
            "run.plots=false",
            "run.device=cpu",
            "rollout.mode=async",
            f"rollout.max_staleness={s}",
            f"rollout.workers={args.batch_groups * (s + 1)}",
            f"rollout.batch_groups={args.batch_groups}",
            "learner.correction=none",
            f"learner.lr={eta}",
            "learner.minibatches=1",
            "policy.warm_start_steps=0",
            "clock.gen_token_s=4e-4",
            "clock.learn_token_s=8.5e-5",
        ],
    )
    run = RLRun(cfg, out / name)
    run.policy.load_state_dict(warm)  # the shared warm start (policy.warm_start_steps=0)
    summ = run.run()
    steps_ev = [e for e in read_events(out / name / "metrics.jsonl") if e["event"] == "step"]
    accs = [e["accuracy"] for e in summ["evals"]]
    taus = [int(k) for e in steps_ev for k, n in e["staleness_hist"].items() for _ in range(n)]
    flags = collapse_flags(
        accs,
        [e["entropy"] for e in steps_ev if "entropy" in e],
        [e.get("grad_norm", 0.0) for e in steps_ev],
    )
    return {
        "seed": seed,
        "S": s,
        "eta": eta,
        "T": steps,
        "mean_staleness": sum(taus) / max(len(taus), 1),
        "accuracies": accs,
        **flags,
    }


def part2(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    runs = []
    cells = [(s, e, args.steps) for s in args.p2_staleness for e in args.p2_lrs]
    cells += [
        (s, e, t)
        for s in args.t_staleness
        for e in args.t_lrs
        for t in args.t_steps
        if (s, e, t) not in cells
    ]
    for seed in args.seeds:
        pol, _, info = warm_policy(args, seed)
        warm = {k: v.clone() for k, v in pol.state_dict().items()}
        print(f"  part 2 seed {seed}: warm start accuracy {info['accuracy']:.3f}", flush=True)
        for s, eta, steps in cells:
            t0 = time.monotonic()
            r = run_cell(args, out / "runs", seed, s, eta, steps, warm)
            runs.append(r)
            fired = [k for k in ("reward_drop", "entropy_floor", "grad_spike") if r[k]]
            print(
                f"    S={s} eta={eta:g} T={steps}: acc {r['accuracies'][0]:.2f} -> peak "
                f"{r['peak_acc']:.2f} -> final {r['final_acc']:.2f}, fired "
                f"{','.join(fired) or '-'} ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    return runs


def separation(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    variables = {
        "eta": lambda r: r["eta"],
        "S*eta": lambda r: r["S"] * r["eta"],
        "T*eta": lambda r: r["T"] * r["eta"],
        "(S+1)*eta": lambda r: (r["S"] + 1) * r["eta"],
        "(S+1)*T*eta": lambda r: (r["S"] + 1) * r["T"] * r["eta"],
    }
    labels = [r["collapsed"] for r in runs]
    drops = [r["acc_drop"] for r in runs]
    res = {}
    for name, f in variables.items():
        xs = [f(r) for r in runs]
        acc, thr = best_threshold(xs, labels)
        res[name] = {
            "threshold_accuracy": acc,
            "threshold": thr,
            "spearman_drop": spearman(xs, drops),
        }
    return res


def report_part2(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    seeds = sorted({r["seed"] for r in runs})
    print(
        f"\nPart 2: async training, correction none, B={args.batch_groups}x{args.group_size}, "
        f"virtual clock, seeds {seeds}; collapsed = held-out accuracy ends > 0.25 below its "
        f"peak (entropy floor 0.02 nats and 10x gradient-norm spike reported beside it)"
    )
    print(
        f"{'S':>2} {'eta':>7} {'T':>3} {'S*eta':>7} {'T*eta':>6} {'tau':>4} {'acc0':>5} "
        f"{'final':>11} {'drop':>5} {'collapsed':>9} {'entropy':>7} {'spike':>5} {'zero-g':>6}"
    )
    cells = sorted({(r["S"], r["eta"], r["T"]) for r in runs}, key=lambda c: (c[2], c[0], c[1]))
    table = []
    for s, eta, t in cells:
        rs = [r for r in runs if (r["S"], r["eta"], r["T"]) == (s, eta, t)]
        fin = [r["final_acc"] for r in rs]
        row = {
            "S": s,
            "eta": eta,
            "T": t,
            "collapsed_frac": statistics.fmean(r["collapsed"] for r in rs),
            "final_mean": statistics.fmean(fin),
            "drop_mean": statistics.fmean(r["acc_drop"] for r in rs),
            "n": len(rs),
        }
        table.append(row)
        print(
            f"{s:>2} {eta:>7.0e} {t:>3} {s * eta:>7.1e} {t * eta:>6.3f} "
            f"{statistics.fmean(r['mean_staleness'] for r in rs):>4.1f} "
            f"{statistics.fmean(r['accuracies'][0] for r in rs):>5.2f} "
            f"{statistics.fmean(fin):>4.2f} {min(fin):.2f}-{max(fin):.2f} "
            f"{row['drop_mean']:>5.2f} {sum(r['collapsed'] for r in rs):>4}/{len(rs):<4} "
            f"{sum(r['entropy_floor'] for r in rs):>5}/{len(rs):<1} "
            f"{sum(r['grad_spike'] for r in rs):>3}/{len(rs):<1} "
            f"{statistics.fmean(r['zero_signal_frac'] for r in rs):>6.2f}"
        )
    sep = separation(runs)
    print("which variable separates collapsed from stable runs (all runs, each seed a point):")
    for name, v in sep.items():
        print(
            f"  {name:12s} best single threshold classifies {v['threshold_accuracy']:.2f} "
            f"(at {v['threshold']:.3g}); Spearman with the accuracy drop {v['spearman_drop']:+.2f}"
        )
    agree = {
        k: sum(r[k] == r["reward_drop"] for r in runs) / len(runs)
        for k in ("entropy_floor", "grad_spike")
    }
    print(
        f"detectors: reward_drop fired in {sum(r['reward_drop'] for r in runs)}/{len(runs)} runs,"
        f" entropy_floor in {sum(r['entropy_floor'] for r in runs)}, grad_spike in "
        f"{sum(r['grad_spike'] for r in runs)}; agreement with reward_drop: "
        + ", ".join(f"{k} {v:.2f}" for k, v in agree.items())
    )
    return {"table": table, "separation": sep, "detector_agreement": agree}


def plot_part2(runs: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("phase", ["tab:green", "gold", "tab:red"])
    t_fixed = args.steps
    extra = [s for s in args.t_staleness]
    fig, axes = plt.subplots(1, 1 + len(extra), figsize=(5.2 * (1 + len(extra)), 4.6))
    axes = list(axes) if len(extra) else [axes]

    def ypos(s: int) -> float:
        return math.log2(s) if s > 0 else -1.0

    def draw(ax: Any, key_runs: list[dict[str, Any]], ykey: str, yfun: Any, ylabels: Any) -> None:
        cells = sorted({(r[ykey], r["eta"]) for r in key_runs})
        for yv, eta in cells:
            rs = [r for r in key_runs if (r[ykey], r["eta"]) == (yv, eta)]
            frac = statistics.fmean(r["collapsed"] for r in rs)
            x, y = math.log10(eta), yfun(yv)
            ax.add_patch(
                plt.Rectangle((x - 0.24, y - 0.45), 0.48, 0.9, color=cmap(frac), alpha=0.85)
            )
            ax.text(
                x,
                y,
                f"{statistics.fmean(r['final_acc'] for r in rs):.2f}\n"
                f"{sum(r['collapsed'] for r in rs)}/{len(rs)}",
                ha="center",
                va="center",
                fontsize=7,
            )
        xs = sorted({math.log10(r["eta"]) for r in key_runs})
        ys = sorted({yfun(r[ykey]) for r in key_runs})
        ax.set_xlim(xs[0] - 0.35, xs[-1] + 0.35)
        ax.set_ylim(ys[0] - 0.6, ys[-1] + 0.6)
        ax.set_xticks(xs, [f"{10**x:.0e}" for x in xs])
        ax.set_yticks(ys, ylabels(sorted({r[ykey] for r in key_runs})))
        ax.set_xlabel("η (Adam learning rate)")

    def iso(ax: Any, lx: list[float], consts: list[float], ylo: float, label: str) -> None:
        """Lines y = log2(c/η) (S·η = c or T·η = c) for round values c, above ``ylo``."""
        x0, x1 = min(lx) - 0.35, max(lx) + 0.35
        gx = [x0 + (x1 - x0) * i / 80 for i in range(81)]
        for c in consts:
            ys = [math.log2(c / 10**x) for x in gx]
            keep = [(x, y) for x, y in zip(gx, ys) if y >= ylo]
            if len(keep) < 2:
                continue
            ax.plot([x for x, _ in keep], [y for _, y in keep], "k--", lw=0.7)
            xe, ye = keep[-1] if keep[-1][1] <= ax.get_ylim()[1] else keep[0]
            if ax.get_ylim()[0] <= ye <= ax.get_ylim()[1]:
                ax.text(xe, ye, f"{label}={c:g}", fontsize=6, ha="right", va="bottom")
        for x in sorted(set(lx)):
            ax.axvline(x, color="tab:blue", ls=":", lw=0.7)

    decades = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
    main = [r for r in runs if r["T"] == t_fixed]
    ax = axes[0]
    draw(ax, main, "S", ypos, lambda ss: [f"{s}" + (" (sync)" if s == 0 else "") for s in ss])
    ax.set_ylabel("S (staleness)")
    ax.set_title(
        f"T={t_fixed}; cell: mean final acc, collapsed/seeds\n"
        "dashed: S·η const; dotted: T·η const (here η const)",
        fontsize=8,
    )
    iso(ax, [math.log10(r["eta"]) for r in main], decades, -0.5, "Sη")
    for ax, s in zip(axes[1:], extra):
        sub = [r for r in runs if r["S"] == s and r["eta"] in args.t_lrs]
        if not sub:
            continue
        draw(ax, sub, "T", lambda t: math.log2(t), lambda ts: [str(t) for t in ts])
        ax.set_ylabel("T (learner steps)")
        ax.set_title(f"S={s}; dashed: T·η const; dotted: S·η const (here η const)", fontsize=8)
        iso(ax, [math.log10(r["eta"]) for r in sub], [0.01, 0.03, 0.1, 0.3], -math.inf, "Tη")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a ~3 minute version")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--p1-seeds", type=int, nargs="+", default=None)
    ap.add_argument("--max-len", type=int, default=6)
    ap.add_argument("--warm-start", type=int, default=100)
    ap.add_argument("--group-size", type=int, default=8)
    # Part 1
    ap.add_argument("--staleness", type=int, nargs="+", default=None)
    ap.add_argument("--lrs", type=float, nargs="+", default=None)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per gradient estimate")
    ap.add_argument("--chain-groups", type=int, default=8, help="groups per chain step")
    ap.add_argument("--chunk", type=int, default=32)
    # Part 2
    ap.add_argument("--steps", type=int, default=None, help="T of the phase diagram")
    ap.add_argument("--p2-staleness", type=int, nargs="+", default=None)
    ap.add_argument("--p2-lrs", type=float, nargs="+", default=None)
    ap.add_argument("--t-staleness", type=int, nargs="*", default=None)
    ap.add_argument("--t-lrs", type=float, nargs="+", default=None)
    ap.add_argument("--t-steps", type=int, nargs="+", default=None)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--skip-part1", action="store_true")
    ap.add_argument("--skip-part2", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/bench_rl_law")
    args = ap.parse_args()
    q = args.quick
    defaults = {
        "seeds": [0] if q else [0, 1],
        "p1_seeds": [0],
        "staleness": [1, 4] if q else [1, 2, 4, 8],
        "lrs": [3e-4, 3e-3] if q else [1e-4, 3e-4, 1e-3, 3e-3],
        "prompts": 256 if q else 1024,
        "steps": 20 if q else 40,
        "p2_staleness": [0, 8] if q else [0, 1, 2, 4, 8],
        "p2_lrs": [3e-4, 3e-3] if q else [1e-4, 3e-4, 1e-3, 3e-3],
        "t_staleness": [] if q else [0, 4],
        "t_lrs": [1e-3, 3e-3],
        "t_steps": [20, 80],
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results: dict[str, Any] = {"args": vars(args)}
    cv = math.nan
    if not args.skip_part1:
        rows = [r for seed in args.p1_seeds for r in part1(args, seed)]
        s1 = report_part1(rows, args)
        plot_part1(s1["table"], out / "bias_vs_s_eta.png")
        results["part1"] = {"rows": rows, **s1}
        cv = s1["none"]["cv_per_s_eta"]
        print(f"(part 1: {time.monotonic() - t0:.0f} s)", flush=True)
    if not args.skip_part2:
        t1 = time.monotonic()
        runs = part2(args, out)
        s2 = report_part2(runs, args)
        plot_part2(runs, args, out / "phase_diagram.png")
        results["part2"] = {"runs": runs, **s2}
        print(f"(part 2: {time.monotonic() - t1:.0f} s)", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}/results.json and PNGs ({time.monotonic() - t0:.0f} s)")
    print(f"staleness_bias_per_s_eta_cv={cv:.3f}")


if __name__ == "__main__":
    main()
