"""One pricing-market run per seed, the forced-deviation test, and settings run in parallel.

Paper: the market and the collusion index are Calvano, Calzolari, Denicolò and Pastorello
(AER 2020); the continuous-time setting (Poisson clocks, observation latency), the DDPG
agents and the two failure modes are arXiv 2606.09884 (Murthy and Pandey 2026), whose
benchmark this reimplements from its description (no code of theirs was read).

A run (``run_seed``): the firms' clocks (trainers.market.env.ContinuousMarket) give the next
revision time and who revises. At an event every mover first observes (its own price, its
competitors' as of ``latency`` ago) and settles its transition since its previous revision
(the profit it earned, discounted continuously, and the discount e^(-rho x elapsed)), which
its agent remembers before it learns (``agent.updates_per_revision`` gradient steps); then
every mover sets its new price. In the synchronous mode all firms are movers at every event,
so none sees another's new price before setting its own, as in a simultaneous-move game.
Training stops at the horizon (``run.horizon``, or ``run.revisions`` per firm). The collusion index is measured on the profit actually
earned over the last ``run.measure_fraction`` of the horizon: the firms' mean time-average
profit pi_bar, Delta = (pi_bar - pi_N) / (pi_M - pi_N).

Failure mode 2: a critic whose loss or Q-values leave the detector's bounds (or turn NaN)
raises ``CriticDiverged``; the run stops there and is *corrupted*: reported, counted, and left
out of every average.

The forced deviation (``deviation_test``, after training, agents frozen and greedy): the
market runs for half of ``run.deviation_span`` to settle, then firm 0, at its next revision,
sets the static best response to the prices it sees (an undercut when prices are above
Nash) for one revision, then follows its policy again. Reported: the prices before, the
competitors' lowest price after the deviation (a punishment when it falls below theirs
before by more than a tolerance), and the recovery time: from the deviation until every
price is back within the tolerance of its pre-deviation level and stays there to the end of
the span (None: no recovery within it). Calvano et al.'s signature of collusion is a
punishment followed by a return.

Settings run in parallel over seeds (``run_settings``): a process pool (spawned workers, one
torch thread each), one task per (setting, seed); results are the same as one process would
get, since every run is seeded from its own seed only.

A seed that finishes writes ``result.json`` in its folder (atomically); with ``run.resume``
a seed whose result is there, of the same config, is loaded instead of run again. A signal
(Ctrl-C reaches the pool's workers too: they ignore SIGINT, and start with it blocked) stops
the run: the pool's pending seeds are cancelled and its workers stopped, and
:class:`fedasync.interrupt.Interrupted` says how many seeds were done (``where``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedasync import seeds
from fedasync.events import EventLog, json_safe
from fedasync.interrupt import (
    DeferredStop,
    Interrupted,
    children_start_deaf,
    ignore_interrupts,
    shielded,
)
from runkit.folder import CHECKPOINT, RunFolder
from trainers.market.config import MarketConfig, to_container
from trainers.market.ddpg import CriticDiverged, DDPGAgent, DDPGSettings
from trainers.market.env import ContinuousMarket
from trainers.market.market import LogitMarket

log = logging.getLogger("fedasync.market")

TOLERANCE = 0.05
"""The deviation test's tolerance, as a fraction of p_M - p_N."""
TRACE_MAX = 20_000
"""At most this many points of a run's price path are kept in trace.npz (evenly thinned)."""
STOP_GRACE_S = 10.0
"""Seconds a stopped run waits for its running seeds to write their checkpoints."""
RESULT = "result.json"
"""A finished seed's result, in its folder (what ``run.resume`` loads)."""
MAY_DIFFER_ON_RESUME = frozenset(
    {"seed", "seeds", "name", "out_dir", "workers", "progress", "plots", "resume", "device"}
)
"""``run.*`` keys a loaded seed's config may differ in (none changes one seed's result)."""


def build_market(cfg: MarketConfig) -> LogitMarket:
    """The logit market of ``cfg.market``."""
    m = cfg.market
    return LogitMarket(n=m.firms, a=m.quality, a0=m.outside, mu=m.mu, c=m.cost)


def benchmarks(market: LogitMarket) -> dict[str, float]:
    """The static benchmarks of ``market`` (symmetric prices and per-firm profits)."""
    return {
        "p_nash": float(market.nash_prices()[0]),
        "p_monopoly": float(market.monopoly_prices()[0]),
        "profit_nash": float(market.nash_profit()),
        "profit_monopoly": float(market.monopoly_profit()),
    }


def agent_settings(cfg: MarketConfig) -> DDPGSettings:
    """The DDPG settings of ``cfg.agent``: every key of it that DDPGSettings has (all but
    ``updates_per_revision``, the run's)."""
    return DDPGSettings(**{f.name: getattr(cfg.agent, f.name) for f in fields(DDPGSettings)})


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads (tiny networks: one is fastest), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def initial_prices(cfg: MarketConfig, market: LogitMarket, rng: np.random.Generator) -> np.ndarray:
    """The starting prices ``market.init`` asks for."""
    lo, hi = market.price_bounds(cfg.market.xi)
    if cfg.market.init == "nash":
        return np.asarray(market.nash_prices(), dtype=float)
    if cfg.market.init == "monopoly":
        return np.asarray(market.monopoly_prices(), dtype=float)
    return rng.uniform(lo, hi, size=market.n)


@dataclass
class Trace:
    """A price path: the time of every event and the posted prices after it."""

    times: list[float]
    prices: list[np.ndarray]

    def arrays(self, limit: int = TRACE_MAX) -> tuple[np.ndarray, np.ndarray]:
        """(times, prices) as arrays, thinned evenly to at most ``limit`` points."""
        t = np.asarray(self.times, dtype=float)
        p = np.asarray(self.prices, dtype=float).reshape(len(self.times), -1)
        if len(t) > limit:
            keep = np.linspace(0, len(t) - 1, limit).round().astype(int)
            t, p = t[keep], p[keep]
        return t, p


@dataclass
class _Loop:
    """The training loop's running state (saved with the run, so a stop loses nothing)."""

    trace: Trace
    w_pi: np.ndarray  # the profit integral at the window's start
    w_t: float = 0.0  # the window's start
    w_stats: list[dict[str, float]] = field(default_factory=list)  # the window's updates
    m_t: float | None = None  # when the measured span started
    m_pi: np.ndarray | None = None  # the profit integral then
    t: float = 0.0  # the last event's time
    seconds: float = 0.0  # wall seconds trained before the last stop


class SeedStopped(Exception):
    """A seed's training was asked to stop between two events (its state is whole)."""

    def __init__(self, t: float):
        super().__init__(f"stopped at t={t:.1f}")
        self.t = t


class MarketRun:
    """One seed of one setting: the market, one DDPG agent per firm, and the event loop."""

    def __init__(self, cfg: MarketConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.market = build_market(cfg)
        self.bench = benchmarks(self.market)
        self.lo, self.hi = self.market.price_bounds(cfg.market.xi)
        rng = seeds.rng(seed, "market.start")
        self.env = ContinuousMarket(
            self.market,
            rate=cfg.market.rate,
            synchronous=cfg.market.clock == "sync",
            latency=cfg.market.latency,
            discount_rate=cfg.market.discount_rate,
            init_prices=initial_prices(cfg, self.market, rng),
            rng=rng,
        )
        settings = agent_settings(cfg)
        self.agents = [
            DDPGAgent(self.market.n, self.lo, self.hi, settings, seed=seed * 1009 + i)
            for i in range(self.market.n)
        ]
        self.last: list[tuple[np.ndarray, float] | None] = [None] * self.market.n
        self.earned = np.zeros(self.market.n)  # each firm's profit integral at its last settle
        self.revisions = 0
        self.loop: _Loop | None = None
        """The training loop's state (None before it starts)."""

    def step(
        self,
        learn: bool = True,
        explore: bool = True,
        forced: Callable[[int, np.ndarray], float | None] | None = None,
    ) -> tuple[float, tuple[int, ...], list[dict[str, float]]]:
        """One event: the movers observe, settle and learn, then set prices (``forced``: a
        price for a firm instead of its policy's). (time, movers, the updates' stats)."""
        t, movers = self.env.next_revision()
        seen = {i: self.env.observe(i) for i in movers}
        stats = []
        for i in movers:
            reward, discount, elapsed = self.env.settle(i)
            if self.cfg.market.reward == "rate":  # the transition's mean profit per time unit
                earned = self.env.profit_integral()[i]
                reward = (earned - self.earned[i]) / elapsed if elapsed > 0 else 0.0
                self.earned[i] = earned
            last = self.last[i]
            if learn and last is not None:
                agent = self.agents[i]
                agent.remember(last[0], last[1], reward, discount, seen[i])
                for _ in range(self.cfg.agent.updates_per_revision):
                    out = agent.update()
                    if out is not None:
                        stats.append(out)
        for i in movers:
            price = forced(i, seen[i]) if forced is not None else None
            if price is None:
                price = self.agents[i].act(seen[i], explore=explore)
            self.env.post(i, price)
            self.last[i] = (seen[i], price)
        self.revisions += len(movers)
        return t, movers, stats

    def train(
        self,
        events: EventLog | None,
        on_time: Callable[[float], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """Train to the horizon (or to a critic's divergence); the run's measures. Between
        two events (the state whole: `state_dict`) ``should_stop`` is asked whether to stop;
        if it says so, :class:`SeedStopped` is raised there and the run can be saved and
        continued later, to the same result as one never stopped."""
        cfg, env = self.cfg, self.env
        horizon = cfg.horizon
        measure_from = horizon * (1.0 - cfg.run.measure_fraction)
        lp = self.loop
        if lp is None:
            lp = self.loop = _Loop(trace=Trace([0.0], [env.prices]), w_pi=env.profit_integral())
        corrupted = None
        started = time.perf_counter() - lp.seconds
        try:
            while True:
                if should_stop is not None and should_stop():
                    lp.seconds = time.perf_counter() - started
                    raise SeedStopped(lp.t)
                lp.t, _, stats = self.step()
                t = lp.t
                if t > horizon:
                    break
                lp.trace.times.append(t)
                lp.trace.prices.append(env.prices)
                lp.w_stats += stats
                if lp.m_t is None and t >= measure_from:
                    lp.m_t, lp.m_pi = t, env.profit_integral()
                if t - lp.w_t >= cfg.run.window:
                    pi = env.profit_integral()
                    self._window(events, lp.w_t, t, (pi - lp.w_pi) / (t - lp.w_t), lp.w_stats)
                    lp.w_t, lp.w_pi, lp.w_stats = t, pi, []
                if on_time is not None:
                    on_time(t)
        except CriticDiverged as e:
            corrupted = {"reason": e.reason, "t": lp.t, "step": e.step}
            log.warning("seed %d: critic diverged at t=%.1f: %s", self.seed, lp.t, e.reason)
            if events is not None:
                events.write("diverged", version=self.revisions, **corrupted)
        # the clock stands at the first event past the horizon (its prices not yet posted):
        # the profit integral runs to it, under the prices of the last event within
        end_t = env.now
        m_t, m_pi, trace = lp.m_t, lp.m_pi, lp.trace
        result: dict[str, Any] = {
            "seed": self.seed,
            "status": "corrupted" if corrupted else "ok",
            "corrupted": corrupted,
            "revisions": self.revisions,
            "seconds": time.perf_counter() - started,
            **self.bench,
        }
        if corrupted is None and m_t is not None and m_pi is not None and end_t > m_t:
            profit = (env.profit_integral() - m_pi) / (end_t - m_t)
            times, prices = trace.arrays(limit=len(trace.times))
            sel = times >= m_t
            result.update(
                profit=profit.tolist(),
                delta=float(self.market.collusion_index(float(profit.mean()))),
                delta_firms=[float(self.market.collusion_index(float(x))) for x in profit],
                price_mean=_time_average(times[sel], prices[sel], end_t).tolist(),
                measured=[m_t, end_t],
            )
        self.trace = trace
        return result

    def state_dict(self) -> dict[str, Any]:
        """Everything a stopped training continues from: the market's clocks and posts, each
        agent (networks, optimisers, generators, replay buffer), the firms' last transitions
        and the loop's measures so far."""
        assert self.loop is not None, "nothing to save before training starts"
        lp = self.loop
        return {
            "seed": self.seed,
            "env": self.env.state_dict(),
            "agents": [{**a.state_dict(), "buffer": a.buffer.state_dict()} for a in self.agents],
            "last": [None if x is None else (x[0].tolist(), x[1]) for x in self.last],
            "earned": self.earned.tolist(),
            "revisions": self.revisions,
            "loop": {
                "times": lp.trace.times,
                "prices": [p.tolist() for p in lp.trace.prices],
                "w_t": lp.w_t,
                "w_pi": lp.w_pi.tolist(),
                "w_stats": lp.w_stats,
                "m_t": lp.m_t,
                "m_pi": None if lp.m_pi is None else lp.m_pi.tolist(),
                "t": lp.t,
                "seconds": lp.seconds,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what `state_dict` gave (a run of the same config and seed)."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state is of seed {state['seed']}, this run's is {self.seed}")
        self.env.load_state_dict(state["env"])
        for agent, saved in zip(self.agents, state["agents"], strict=True):
            agent.load_state_dict(saved)
            agent.buffer.load_state_dict(saved["buffer"])
        self.last = [None if x is None else (np.array(x[0]), float(x[1])) for x in state["last"]]
        self.earned = np.array(state["earned"], dtype=np.float64)
        self.revisions = int(state["revisions"])
        s = state["loop"]
        self.loop = _Loop(
            trace=Trace([float(t) for t in s["times"]], [np.array(p) for p in s["prices"]]),
            w_t=float(s["w_t"]),
            w_pi=np.array(s["w_pi"], dtype=np.float64),
            w_stats=list(s["w_stats"]),
            m_t=s["m_t"],
            m_pi=None if s["m_pi"] is None else np.array(s["m_pi"], dtype=np.float64),
            t=float(s["t"]),
            seconds=float(s["seconds"]),
        )

    def _window(
        self,
        events: EventLog | None,
        t0: float,
        t1: float,
        profit: np.ndarray,
        stats: list[dict[str, float]],
    ) -> None:
        if events is None:
            return
        fields: dict[str, Any] = {
            "t0": t0,
            "profit": profit.tolist(),
            "delta": float(self.market.collusion_index(float(profit.mean()))),
            "prices": self.env.prices.tolist(),
            "noise": self.agents[0].noise_sd,
        }
        if stats:
            for k in ("critic_loss", "actor_loss", "q_mean"):
                fields[k] = float(np.mean([s[k] for s in stats]))
            fields["q_max"] = float(max(s["q_max"] for s in stats))
        events.write("window", t=t1, version=self.revisions, **fields)

    def best_response(self, i: int, seen: np.ndarray) -> float:
        """Firm ``i``'s static best response to the prices it sees (a fine grid over the
        price range, then the best point)."""
        grid = np.linspace(self.lo, self.hi, 2001)
        p = np.repeat(seen[None, :], len(grid), axis=0)
        p[:, i] = grid
        return float(grid[int(np.argmax(self.market.profits(p)[:, i]))])

    def deviation_test(self, span: float, deviator: int = 0) -> dict[str, Any]:
        """The forced deviation on the frozen agents (module docstring)."""
        for a in self.agents:
            a.freeze()
        env = self.env
        start = env.now
        settle_until = start + span / 2
        times, paths = [env.now], [env.prices]
        while env.now < settle_until:
            t, _, _ = self.step(learn=False, explore=False)
            times.append(t)
            paths.append(env.prices)
        before = env.prices

        # the deviator's next revision: the static best response to what it sees then
        def undercut(i: int, seen: np.ndarray) -> float | None:
            return self.best_response(i, seen) if i == deviator else None

        while True:
            t, movers, _ = self.step(learn=False, explore=False, forced=undercut)
            times.append(t)
            paths.append(env.prices)
            if deviator in movers:
                break
        t_dev = times[-1]
        while env.now < t_dev + span:
            t, _, _ = self.step(learn=False, explore=False)
            times.append(t)
            paths.append(env.prices)
        tol = TOLERANCE * (self.bench["p_monopoly"] - self.bench["p_nash"])
        arr = np.asarray(paths)
        after = np.asarray(times) > t_dev
        rivals = [j for j in range(self.market.n) if j != deviator]
        rival_min = arr[after][:, rivals].min(axis=0) if rivals else np.array([])
        punished = bool(rivals) and bool(np.any(rival_min < before[rivals] - tol))
        # recovered: from some point after the deviation on, every price within tol of before
        off = np.nonzero(after & np.any(np.abs(arr - before[None, :]) > tol, axis=1))[0]
        recovery: float | None = 0.0
        if len(off):
            last = int(off.max())
            recovery = times[last + 1] - t_dev if last < len(times) - 1 else None
        return {
            "deviator": deviator,
            "t_deviation": t_dev,
            "prices_before": before.tolist(),
            "deviation_price": float(arr[times.index(t_dev)][deviator]),
            "rival_min": rival_min.tolist(),
            "punished": punished,
            "recovered": recovery is not None,
            "recovery_time": recovery,
            "tolerance": tol,
            "times": [x - t_dev for x in times],
            "prices": arr.tolist(),
        }


def _time_average(times: np.ndarray, prices: np.ndarray, end: float) -> np.ndarray:
    """The time average of a piecewise-constant path (``prices[k]`` holds from ``times[k]``)
    up to ``end``; at least one point."""
    dt = np.diff(np.append(times, end))
    return (prices * dt[:, None]).sum(axis=0) / max(dt.sum(), 1e-12)


def run_seed(
    cfg: MarketConfig,
    seed: int,
    run_dir: Path | None = None,
    on_time: Callable[[float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Train one seed of ``cfg``'s setting and, when ``run.deviation``, run the deviation
    test; the result (written with its events and trace under ``run_dir`` when given).

    With a ``run_dir``: a stop asked for by ``should_stop`` saves the seed's checkpoint there
    (runkit.folder) and returns ``{"seed": seed, "status": "stopped"}``; with ``run.resume`` a
    seed that has a checkpoint continues from it (its events truncated to it), to the result
    an unstopped run gets."""
    with torch_threads(1):
        run = MarketRun(cfg, seed)
        folder = None if run_dir is None else seed_folder(run_dir)
        events = None
        if folder is not None:
            config = to_container(cfg)
            if cfg.run.resume and folder.checkpoint_path.is_file():
                run.load_state_dict(folder.resume(config))
                events = folder.events
                assert events is not None
                events.write("resume", t=run.loop.t if run.loop else 0.0, version=run.revisions)
            else:
                events = folder.start(config)
                events.write("start", t=0.0, version=0, seed=seed, config=config, **run.bench)
        try:
            try:
                result = run.train(events, on_time, should_stop if folder else None)
            except SeedStopped:
                assert folder is not None
                folder.save_checkpoint(run.state_dict())
                return {"seed": seed, "status": "stopped"}
            if cfg.run.deviation and result["status"] == "ok":
                result["deviation"] = run.deviation_test(cfg.run.deviation_span)
            if events is not None:
                summary = {k: v for k, v in result.items() if k != "deviation"}
                events.write("end", t=run.env.now, version=run.revisions, **json_safe(summary))
        finally:
            if folder is not None:
                folder.close()
        if run_dir is not None:
            t, p = run.trace.arrays()
            np.savez_compressed(run_dir / "trace.npz", times=t, prices=p)
            save_result(run_dir, cfg, result)
            (run_dir / CHECKPOINT).unlink(missing_ok=True)  # the result stands for it now
        return result


def seed_folder(run_dir: Path) -> RunFolder:
    """A seed's run folder: its events, its checkpoint while it is unfinished, result.json
    and trace.npz once it is (a resume may differ in the ``run.*`` keys that do not change
    one seed's result)."""
    return RunFolder(
        run_dir.parent,
        run_dir.name,
        owned=(RESULT, "trace.npz"),
        may_differ=tuple(f"run.{k}" for k in MAY_DIFFER_ON_RESUME),
    )


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two configs (``to_container``) give the same result for one seed."""

    def key(c: dict[str, Any]) -> dict[str, Any]:
        run = {k: v for k, v in c.get("run", {}).items() if k not in MAY_DIFFER_ON_RESUME}
        return {"market": c.get("market"), "agent": c.get("agent"), "run": run}

    return key(a) == key(b)


def save_result(run_dir: Path, cfg: MarketConfig, result: dict[str, Any]) -> None:
    """Write a finished seed's ``result.json`` (with its config) atomically."""
    text = json.dumps({"config": to_container(cfg), "result": result})  # NaN kept as NaN
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, run_dir / RESULT)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_result(run_dir: Path, cfg: MarketConfig, seed: int) -> dict[str, Any] | None:
    """The seed's result saved in ``run_dir``, if it is there, whole and of ``cfg``; else None."""
    try:
        saved = json.loads((run_dir / RESULT).read_text())
        result = saved["result"]
        if result["seed"] == seed and _same_run(saved["config"], to_container(cfg)):
            return dict(result)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def setting_label(cfg: MarketConfig) -> str:
    """A setting's folder name: clock, rate and latency (e.g. ``async-r1-d0.5``)."""
    m = cfg.market
    return f"{m.clock}-r{m.rate:g}-d{m.latency:g}"


def confidence_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the ``level`` Student-t interval); half-width nan for < 2 values."""
    if not values:
        return math.nan, math.nan
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return float(x.mean()), math.nan
    from scipy import stats

    half = float(stats.t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return float(x.mean()), half


def aggregate(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A setting's seeds summed up: Delta's mean and 95% interval over the uncorrupted seeds,
    the corrupted ones counted (and why), and the deviation test's outcomes."""
    ok = [r for r in results if r["status"] == "ok" and "delta" in r]
    deltas = [r["delta"] for r in ok]
    mean, half = confidence_interval(deltas)
    devs = [r["deviation"] for r in ok if "deviation" in r]
    rec = [d["recovery_time"] for d in devs if d["recovery_time"] is not None]
    return {
        "delta": mean,
        "delta_ci95": half,
        "delta_sd": float(np.std(deltas, ddof=1)) if len(deltas) > 1 else math.nan,
        "deltas": deltas,
        "seeds": [r["seed"] for r in results],
        "ok": len(ok),
        "corrupted": len(results) - len(ok),
        "corrupted_reasons": [r["corrupted"]["reason"] for r in results if r.get("corrupted")],
        "price_mean": float(np.mean([np.mean(r["price_mean"]) for r in ok])) if ok else math.nan,
        "punished": sum(d["punished"] for d in devs),
        "recovered": sum(d["recovered"] for d in devs),
        "deviations": len(devs),
        "recovery_time_mean": float(np.mean(rec)) if rec else None,
        "seconds": float(sum(r["seconds"] for r in results)),
    }


_STOP: Any = None
"""In a pool worker: the event its parent sets to ask every running seed to checkpoint."""


def _worker_init(stop: Any) -> None:
    """A pool worker's start: SIGINT ignored (its parent stops it), the stop event kept."""
    global _STOP
    ignore_interrupts()
    _STOP = stop


def _task(cfg: MarketConfig, seed: int, run_dir: str) -> dict[str, Any]:
    """A pool task: one seed (a module-level function, so that it pickles)."""
    stop = _STOP
    return run_seed(cfg, seed, Path(run_dir), should_stop=None if stop is None else stop.is_set)


def _run_serial(
    todo: list[tuple[MarketConfig, int, Path]],
    done: Callable[[MarketConfig, dict[str, Any]], None],
) -> None:
    """``todo`` one after another in this process. The first signal asks the running seed to
    stop at its next event with a checkpoint; then :class:`Interrupted` goes on (a second
    signal, or a seed that does not get there within the grace, raises at once)."""
    with DeferredStop(STOP_GRACE_S) as stop:
        for cfg, seed, d in todo:
            stop.check()
            result = run_seed(cfg, seed, d, should_stop=lambda: stop.requested is not None)
            done(cfg, result)
        stop.check()


def pool_size(cfg: MarketConfig, tasks: int) -> int:
    """Worker processes for ``tasks`` runs (``run.workers``, 0: one per core)."""
    want = cfg.run.workers or (os.cpu_count() or 1)
    return max(1, min(want, tasks))


def run_settings(
    settings: list[MarketConfig], root: Path, progress_bar: Any = None
) -> dict[str, dict[str, Any]]:
    """Run every setting over its seeds (``run.seed`` ..), in parallel when more than one
    process is asked for; {setting label: aggregate, with the per-seed results}. Each seed's
    folder is ``root/<label>/seed-<s>``. With ``run.resume`` the seeds already finished there
    are loaded (module docstring); a signal raises :class:`fedasync.interrupt.Interrupted`
    once the pool is stopped, its ``where`` saying how many seeds were done."""
    tasks = [
        (cfg, cfg.run.seed + k, root / setting_label(cfg) / f"seed-{cfg.run.seed + k}")
        for cfg in settings
        for k in range(cfg.run.seeds)
    ]
    by_label: dict[str, list[dict[str, Any]]] = {setting_label(c): [] for c in settings}
    finished = 0

    def done(cfg: MarketConfig, result: dict[str, Any]) -> None:
        nonlocal finished
        finished += 1
        by_label[setting_label(cfg)].append(result)
        if progress_bar is not None:
            progress_bar.update(1)
            progress_bar.set_postfix_str(
                f"{setting_label(cfg)} seed {result['seed']}: "
                + (f"Delta={result['delta']:.2f}" if "delta" in result else result["status"])
            )

    todo = []
    for cfg, seed, d in tasks:
        loaded = load_result(d, cfg, seed) if cfg.run.resume else None
        if loaded is not None:
            done(cfg, loaded)
            continue
        (d / RESULT).unlink(missing_ok=True)  # an earlier run's, or one of another config
        todo.append((cfg, seed, d))
    if finished:
        log.info("resumed: %d of %d seed runs loaded from %s", finished, len(tasks), root)
    workers = pool_size(settings[0], len(todo)) if settings and todo else 1
    saved: list[int] = []  # seeds stopped with a checkpoint

    def finish(cfg: MarketConfig, result: dict[str, Any]) -> None:
        if result["status"] == "stopped":
            saved.append(int(result["seed"]))
        else:
            done(cfg, result)

    try:
        if workers == 1:
            _run_serial(todo, finish)
        else:
            _run_pool(todo, workers, finish)
    except Interrupted as e:
        e.run_dir = root
        e.where = f"with {finished} of {len(tasks)} seed runs done"
        if saved:
            e.where += f" and {len(saved)} checkpointed mid-run (seed {', '.join(map(str, saved))})"
        raise
    out = {}
    for cfg in settings:
        label = setting_label(cfg)
        results = sorted(by_label[label], key=lambda r: r["seed"])
        out[label] = {
            "clock": cfg.market.clock,
            "rate": cfg.market.rate,
            "latency": cfg.market.latency,
            **aggregate(results),
            "runs": results,
        }
    return out


def _run_pool(
    todo: list[tuple[MarketConfig, int, Path]],
    workers: int,
    done: Callable[[MarketConfig, dict[str, Any]], None],
) -> None:
    """``todo`` on a pool of ``workers`` spawned processes, ``done`` called as each finishes.
    The workers ignore SIGINT (and start with it blocked: ``children_start_deaf``); on any
    exception here (a signal's Interrupted) the pending seeds are cancelled and the workers
    stopped before it goes on."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(stop,))
    futures: dict[Any, MarketConfig] = {}
    try:
        with children_start_deaf():  # the workers start as the tasks are submitted
            futures = {pool.submit(_task, cfg, seed, str(d)): cfg for cfg, seed, d in todo}
        for f in as_completed(futures):
            done(futures[f], f.result())
            del futures[f]
    except BaseException:
        with shielded():  # bounded: the grace, then 5 s, then SIGKILL
            stop.set()  # the running seeds checkpoint at their next event and return
            running = [f for f in futures if f.running()]
            stopped, _ = wait(running, timeout=STOP_GRACE_S) if running else (set(), set())
            for f in stopped:
                if f.exception() is None:  # one that failed as it stopped has no checkpoint
                    done(futures[f], f.result())
            _stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def _stop_pool(pool: ProcessPoolExecutor, grace_s: float = 5.0) -> None:
    """Cancel the pool's pending tasks and stop its workers (SIGTERM, then SIGKILL)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(deadline - time.monotonic(), 0.0))
        if p.is_alive():
            p.kill()
            p.join(5)


def sweep_settings(cfg: MarketConfig) -> list[MarketConfig]:
    """The settings a config asks for: its own, or one per (rate, latency) of its sweep."""
    if not cfg.sweep.rates:
        return [cfg]
    return [
        replace(cfg, market=replace(cfg.market, rate=r, latency=d))
        for r in cfg.sweep.rates
        for d in cfg.sweep.latencies
    ]
