"""One seed of a pricing-market setting: the market, a DDPG agent per firm, the event loop,
the deviation test, and the seed's folder (events, a checkpoint while unfinished, result.json
and trace.npz once done). Settings, seeds in parallel and aggregates: trainers.market.run (the
papers and measures are described there). Training stops between two events when asked
(``should_stop``), where its state is whole (`MarketRun.state_dict`), saved in the seed's run
folder (runkit.folder); a resumed seed ends with the result of one never stopped."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from fedasync import seeds
from fedasync.events import EventLog, json_safe
from runkit.folder import CHECKPOINT, RunFolder
from trainers.market.config import MarketConfig, to_container
from trainers.market.ddpg import CriticDiverged, DDPGAgent, DDPGSettings
from trainers.market.env import ContinuousMarket
from trainers.market.market import LogitMarket
from trainers.market.results import MAY_DIFFER_ON_RESUME, RESULT, save_result

log = logging.getLogger("fedasync.market")

TOLERANCE = 0.05
"""The deviation test's tolerance, as a fraction of p_M - p_N."""
TRACE_MAX = 20_000
"""At most this many points of a run's price path are kept in trace.npz (evenly thinned)."""


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
            DDPGAgent(
                self.market.n,
                self.lo,
                self.hi,
                settings,
                seed=seeds.linear_seed(seed, "market.agent", i),
            )
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
