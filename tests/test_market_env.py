"""The continuous-time pricing market (issue 17): the logit market, Poisson revision clocks,
timed histories (delayed observations) and the continuous-time environment."""

import math

import numpy as np
import pytest

from fedasync.clock import PoissonClocks
from fedasync.versions import TimedHistory
from trainers.market.env import ContinuousMarket
from trainers.market.market import LogitMarket

# --- LogitMarket -------------------------------------------------------------------------


def _hand_profits(p1: float, p2: float) -> tuple[float, float]:
    """Profits of the default market (a=2, a0=0, mu=0.25, c=1) at (p1, p2), by hand."""
    e1, e2, e0 = math.exp((2 - p1) / 0.25), math.exp((2 - p2) / 0.25), math.exp(0.0)
    return (p1 - 1) * e1 / (e1 + e2 + e0), (p2 - 1) * e2 / (e1 + e2 + e0)


def test_demand_and_profits_match_a_hand_computation():
    # Prepare: exp((2 - 1.5)/0.25) = e^2, exp((2 - 1.8)/0.25) = e^0.8, outside good e^0 = 1
    market = LogitMarket()
    total = math.exp(2.0) + math.exp(0.8) + 1.0
    q_expected = np.array([math.exp(2.0) / total, math.exp(0.8) / total])

    # Execute
    q = market.demand(np.array([1.5, 1.8]))
    pi = market.profits(np.array([1.5, 1.8]))

    # Assert
    np.testing.assert_allclose(q, q_expected, rtol=1e-13)
    np.testing.assert_allclose(q, [0.6961221, 0.2096680], atol=1e-7)
    np.testing.assert_allclose(pi, [0.5 * q_expected[0], 0.8 * q_expected[1]], rtol=1e-13)
    assert q.sum() < 1.0  # the outside good takes 1 / total
    assert 1.0 - q.sum() == pytest.approx(1.0 / total, rel=1e-12)


def test_demand_is_batched_and_stable_for_extreme_prices():
    market = LogitMarket()
    p = np.array([[1.5, 1.8], [1.0, 1.0], [-1000.0, 5.0], [1000.0, 1000.0]])

    q = market.demand(p)

    assert q.shape == (4, 2)
    for row, qr in zip(p, q):
        np.testing.assert_array_equal(market.demand(row), qr)
    assert np.all(np.isfinite(q))
    assert q[2, 0] == pytest.approx(1.0) and q[2, 1] < 1e-12
    assert q[3].sum() == pytest.approx(0.0, abs=1e-300)  # everyone buys the outside good
    with pytest.raises(ValueError):
        market.demand(np.array([1.0, 2.0, 3.0]))


def test_nash_and_monopoly_prices_of_calvano_et_al():
    market = LogitMarket()

    p_n, p_m = market.nash_prices(), market.monopoly_prices()

    assert p_n.shape == p_m.shape == (2,)
    assert round(float(p_n[0]), 3) == 1.473 and p_n[0] == p_n[1]
    assert round(float(p_m[0]), 3) == 1.925 and p_m[0] == p_m[1]
    # first-order conditions: p_i = c + mu / (1 - q_i) and m = mu / (1 - Q)
    np.testing.assert_allclose(p_n, 1.0 + 0.25 / (1.0 - market.demand(p_n)), atol=1e-12)
    q_total = market.demand(p_m).sum()
    np.testing.assert_allclose(p_m, 1.0 + 0.25 / (1.0 - q_total), atol=1e-12)
    assert market.monopoly_profit() > market.nash_profit() > 0


def test_nash_is_a_best_response_and_monopoly_maximises_joint_profit():
    market = LogitMarket(n=3, mu=0.4, a0=0.5)
    p_n, p_m = market.nash_prices(), market.monopoly_prices()
    grid = np.linspace(1.0, 3.0, 2001)

    own = [market.profits(np.array([x, p_n[1], p_n[2]]))[0] for x in grid]
    joint = [market.profits(np.array([x, y, p_m[2]])).sum() for x in grid[::50] for y in grid[::50]]

    assert max(own) <= market.profits(p_n)[0] + 1e-12
    assert max(joint) <= market.profits(p_m).sum() + 1e-12


def test_collusion_index_and_price_bounds():
    market = LogitMarket()
    pi_n, pi_m = market.nash_profit(), market.monopoly_profit()
    p_n, p_m = float(market.nash_prices()[0]), float(market.monopoly_prices()[0])

    lo, hi = market.price_bounds(0.1)

    assert market.collusion_index(pi_n) == 0.0
    assert market.collusion_index(pi_m) == pytest.approx(1.0, abs=1e-14)
    np.testing.assert_allclose(
        market.collusion_index(np.array([pi_n, (pi_n + pi_m) / 2, pi_m])), [0.0, 0.5, 1.0]
    )
    assert lo == pytest.approx(p_n - 0.1 * (p_m - p_n)) and hi == pytest.approx(
        p_m + 0.1 * (p_m - p_n)
    )
    assert market.price_bounds(0.0) == (p_n, p_m)
    with pytest.raises(ValueError):
        market.price_bounds(-0.1)
    with pytest.raises(ValueError, match="collusion index"):  # one firm: Nash is the monopoly
        LogitMarket(n=1).collusion_index(0.3)


@pytest.mark.parametrize(
    "kwargs", [{"n": 0}, {"mu": 0.0}, {"mu": -1.0}, {"a": math.inf}, {"c": math.nan}]
)
def test_market_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        LogitMarket(**kwargs)


# --- PoissonClocks -----------------------------------------------------------------------


@pytest.mark.parametrize("synchronous", [False, True])
def test_each_agent_revises_at_rate_in_both_modes(synchronous):
    # Prepare: per agent the count up to T is Poisson(rate T): sd sqrt(rate T) = 122
    n, rate, horizon = 3, 1.5, 10_000.0
    clocks = PoissonClocks(n, rate, synchronous=synchronous, rng=np.random.default_rng(7))
    counts = np.zeros(n)

    # Execute
    while True:
        t, agents = clocks.next()
        if t > horizon:
            break
        if synchronous:
            assert agents == tuple(range(n))
        else:
            assert len(agents) == 1 and 0 <= agents[0] < n
        counts[list(agents)] += 1

    # Assert
    expected = rate * horizon
    assert np.all(np.abs(counts - expected) < 5 * math.sqrt(expected))  # about 4 %
    assert clocks.now == t


def test_poisson_clocks_are_reproducible_and_increasing():
    def run(seed):
        clocks = PoissonClocks(4, 2.0, synchronous=False, rng=np.random.default_rng(seed))
        return [clocks.next() for _ in range(200)]

    a, b, c = run(3), run(3), run(4)

    assert a == b and a != c
    times = [t for t, _ in a]
    assert all(t1 > t0 for t0, t1 in zip(times, times[1:])) and times[0] > 0
    assert {i for _, (i,) in a} == {0, 1, 2, 3}


def test_poisson_clocks_validate_and_start():
    rng = np.random.default_rng(0)
    for n, rate in [(0, 1.0), (2, 0.0), (2, -1.0), (2, math.inf), (2, math.nan)]:
        with pytest.raises(ValueError):
            PoissonClocks(n, rate, synchronous=False, rng=rng)
    clocks = PoissonClocks(1, 1.0, synchronous=True, rng=rng, start=5.0)
    assert clocks.now == 5.0 and clocks.next()[0] > 5.0


# --- TimedHistory ------------------------------------------------------------------------


def test_as_of_at_between_and_before_records():
    h: TimedHistory[str] = TimedHistory()
    assert [h.record(t, v) for t, v in [(0.0, "a"), (1.0, "b"), (2.5, "c")]] == [0, 1, 2]

    assert h.as_of(0.0) == (0, "a")
    assert h.as_of(0.5) == (0, "a")
    assert h.as_of(1.0) == (1, "b")
    assert h.as_of(2.4999) == (1, "b")
    assert h.as_of(100.0) == (2, "c")
    assert h.latest() == (2, 2.5, "c") and len(h) == 3
    with pytest.raises(LookupError, match="first"):
        h.as_of(-0.1)


def test_same_time_records_last_wins_and_staleness_at():
    h: TimedHistory[str] = TimedHistory()
    h.record(0.0, "a")
    h.record(1.0, "x")
    h.record(1.0, "y")
    h.record(3.0, "z")

    assert h.as_of(1.0) == (2, "y")
    assert h.as_of(0.999) == (0, "a")
    assert h.staleness_at(0.5) == 3
    assert h.staleness_at(2.0) == 1
    assert h.staleness_at(3.0) == 0


def test_empty_history_and_bad_records_raise():
    h: TimedHistory[int] = TimedHistory()
    with pytest.raises(LookupError):
        h.latest()
    with pytest.raises(LookupError):
        h.as_of(0.0)
    h.record(2.0, 1)
    with pytest.raises(ValueError, match=r"t=1\.0.*t=2\.0"):
        h.record(1.0, 2)
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError):
            h.record(bad, 3)
    with pytest.raises(ValueError):
        TimedHistory(retain=-1.0)


def test_retention_keeps_the_entry_in_effect_at_the_horizon():
    # Prepare
    h: TimedHistory[str] = TimedHistory(retain=1.0)
    h.record(0.0, "a")
    h.record(0.5, "b")

    # Execute / Assert: horizon 1.2 - 1 = 0.2 still needs "a" (in effect at 0.2)
    h.record(1.2, "c")
    assert len(h) == 3 and h.as_of(0.2) == (0, "a")

    # horizon 2.0 - 1 = 1.0 needs "b", not "a"
    h.record(2.0, "d")
    assert len(h) == 3
    assert h.as_of(1.0) == (1, "b") and h.as_of(0.5) == (1, "b")
    with pytest.raises(LookupError, match="retention"):
        h.as_of(0.4)
    with pytest.raises(LookupError, match="first"):
        h.as_of(-1.0)
    assert h.latest() == (3, 2.0, "d") and h.staleness_at(1.0) == 2


def test_retention_zero_keeps_only_the_latest():
    h: TimedHistory[int] = TimedHistory(retain=0.0)
    for k in range(5):
        h.record(float(k), k)
    assert len(h) == 1 and h.as_of(4.0) == (4, 4)
    with pytest.raises(LookupError, match="retention"):
        h.as_of(3.5)


def test_bounded_history_answers_like_an_unbounded_one_within_the_window():
    # Prepare: a long run, with bursts of same-time records, through many compactions
    rng = np.random.default_rng(1)
    bounded: TimedHistory[int] = TimedHistory(retain=5.0)
    full: TimedHistory[int] = TimedHistory()
    t = 0.0
    for k in range(3000):
        t += float(rng.exponential(0.1)) if rng.random() > 0.2 else 0.0
        assert bounded.record(t, k) == full.record(t, k) == k

        # Execute / Assert
        if k % 50 == 0:
            for q in t - 5.0 * rng.random(20):
                if q >= 0:
                    assert bounded.as_of(q) == full.as_of(q)
                    assert bounded.staleness_at(q) == full.staleness_at(q)
    assert len(bounded) < 150  # about 5 / 0.1 held, plus lazily compacted ones
    assert bounded.latest() == full.latest()


# --- ContinuousMarket --------------------------------------------------------------------


def _env(latency=0.0, synchronous=False, rho=0.0, seed=0, n=2, init=None):
    market = LogitMarket(n=n)
    return ContinuousMarket(
        market,
        rate=1.0,
        synchronous=synchronous,
        latency=latency,
        discount_rate=rho,
        init_prices=np.array(init if init is not None else [1.6] * n),
        rng=np.random.default_rng(seed),
    )


@pytest.mark.parametrize("synchronous", [False, True])
def test_latency_zero_observation_is_the_posted_prices_exactly(synchronous):
    env = _env(latency=0.0, synchronous=synchronous, n=3)
    rng = np.random.default_rng(11)
    assert all(np.array_equal(env.observe(i), env.prices) for i in range(3))
    for _ in range(300):
        _, movers = env.next_revision()
        before = env.prices
        observed = {i: env.observe(i) for i in movers}  # all observe, then all post
        for i in movers:
            assert np.array_equal(observed[i], before)
            assert np.array_equal(env.observed_age(i), np.zeros(3))
        for i in movers:
            env.post(i, float(rng.uniform(1.3, 2.1)))
        for i in range(3):
            assert np.array_equal(env.observe(i), env.prices)


@pytest.mark.parametrize("synchronous", [False, True])
def test_delayed_observation_matches_a_brute_force_list_of_posts(synchronous):
    # Prepare
    n, latency = 3, 0.7
    init = [1.5, 1.6, 1.7]
    env = _env(latency=latency, synchronous=synchronous, n=n, init=init)
    rng = np.random.default_rng(5)
    posts: list[list[tuple[float, float]]] = [[] for _ in range(n)]

    def seen(j: int, now: float) -> tuple[float, int]:
        """Price of j as of now - latency, and how many of its posts are newer."""
        earlier = [p for t, p in posts[j] if t <= now - latency]
        return (earlier[-1] if earlier else init[j]), len(posts[j]) - len(earlier)

    # Execute / Assert
    for step in range(600):
        now, movers = env.next_revision()
        for i in movers:
            obs, age = env.observe(i), env.observed_age(i)
            assert obs[i] == env.prices[i] and age[i] == 0
            for j in set(range(n)) - {i}:
                assert (obs[j], age[j]) == seen(j, now)
        for i in movers:
            if step % 7 != 3:  # sometimes keep the price
                price = float(rng.uniform(1.3, 2.1))
                env.post(i, price)
                posts[i].append((now, price))
    assert env.now > 10 * latency
    assert any(seen(j, env.now)[1] > 0 for j in range(n))  # the delay did hide posts


@pytest.mark.parametrize("rho", [0.3, 0.0])
def test_settle_reward_of_a_two_piece_price_path(rho):
    # Prepare: prices (1.5, 1.8) on [0, t1], then (1.7, 1.8) on [t1, t2]
    env = _env(rho=rho, init=[1.5, 1.8], seed=2)
    pi_a, pi_b = _hand_profits(1.5, 1.8), _hand_profits(1.7, 1.8)

    def piece(pi: float, s0: float, s1: float, t0: float) -> float:
        if rho == 0:
            return pi * (s1 - s0)
        return pi * math.exp(-rho * (s0 - t0)) * (1 - math.exp(-rho * (s1 - s0))) / rho

    # Execute
    t1, _ = env.next_revision()
    env.post(0, 1.7)
    r1_at_t1 = env.settle(1)
    t2, _ = env.next_revision()
    r0 = env.settle(0)
    r1 = env.settle(1)
    r_again = env.settle(0)

    # Assert
    expected0 = piece(pi_a[0], 0.0, t1, 0.0) + piece(pi_b[0], t1, t2, 0.0)
    assert r0 == pytest.approx((expected0, math.exp(-rho * t2), t2), rel=1e-12)
    assert r1_at_t1 == pytest.approx((piece(pi_a[1], 0.0, t1, 0.0), math.exp(-rho * t1), t1))
    assert r1 == pytest.approx(
        (piece(pi_b[1], t1, t2, t1), math.exp(-rho * (t2 - t1)), t2 - t1), rel=1e-12
    )
    assert r_again == (0.0, 1.0, 0.0)
    np.testing.assert_allclose(
        env.profit_integral(),
        [pi_a[0] * t1 + pi_b[0] * (t2 - t1), pi_a[1] * t1 + pi_b[1] * (t2 - t1)],
        rtol=1e-12,
    )


def _random_run(env: ContinuousMarket, seed: int, events: int, settle_movers: bool):
    rng = np.random.default_rng(seed)
    log = []
    for _ in range(events):
        t, movers = env.next_revision()
        obs = [env.observe(i) for i in movers]
        steps = [env.settle(i) for i in movers] if settle_movers else []
        for i in movers:
            env.post(i, float(rng.uniform(1.3, 2.1)))
        log.append((t, movers, [o.tolist() for o in obs], steps))
    return log


@pytest.mark.parametrize("synchronous", [False, True])
def test_profit_integral_is_the_sum_of_undiscounted_settles(synchronous):
    env = _env(rho=0.0, synchronous=synchronous, n=3, latency=0.5)
    log = _random_run(env, seed=9, events=400, settle_movers=True)
    totals = np.zeros(3)
    for _, movers, _, steps in log:
        for i, (reward, discount, _) in zip(movers, steps):
            totals[i] += reward
            assert discount == 1.0
    for i in range(3):
        totals[i] += env.settle(i)[0]

    np.testing.assert_allclose(env.profit_integral(), totals, rtol=1e-11)
    assert np.all(totals > 0)


def test_discounted_settles_compose_into_one_settle_over_the_whole_run():
    # Prepare: two runs with the same seeds; one settles at every revision, one only at the end
    many, once = _env(rho=0.2, n=2, seed=4), _env(rho=0.2, n=2, seed=4)
    log = _random_run(many, seed=1, events=200, settle_movers=True)
    _random_run(once, seed=1, events=200, settle_movers=False)

    # Execute: the return Σ_k (Π_{l<k} γ_l) r_k of firm 0's transitions
    ret, disc = 0.0, 1.0
    for _, movers, _, steps in log:
        for i, (reward, discount, _) in zip(movers, steps):
            if i == 0:
                ret += disc * reward
                disc *= discount
    reward, discount, elapsed = many.settle(0)
    ret += disc * reward
    disc *= discount

    # Assert
    whole = once.settle(0)
    assert whole == pytest.approx((ret, disc, many.now), rel=1e-10)


def test_continuous_market_is_reproducible_for_a_seed():
    a = _random_run(_env(latency=0.3, seed=6, n=3), seed=2, events=200, settle_movers=True)
    b = _random_run(_env(latency=0.3, seed=6, n=3), seed=2, events=200, settle_movers=True)
    c = _random_run(_env(latency=0.3, seed=7, n=3), seed=2, events=200, settle_movers=True)

    assert a == b and a != c


def test_continuous_market_validates_its_inputs():
    with pytest.raises(ValueError):
        _env(latency=-0.1)
    with pytest.raises(ValueError):
        _env(rho=-0.1)
    with pytest.raises(ValueError):
        _env(init=[1.5, 1.6, 1.7])
    env = _env()
    with pytest.raises(ValueError):
        env.post(0, math.nan)
    for call in (env.observe, env.observed_age, env.settle, lambda i: env.post(i, 1.5)):
        with pytest.raises(IndexError):
            call(-1)
        with pytest.raises(IndexError):
            call(2)
    assert env.n == 2 and env.now == 0.0
    prices = env.prices
    prices[0] = 99.0
    assert env.prices[0] == 1.6  # a copy
