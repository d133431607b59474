"""The core clocks (fedasync.clock), by hand: durations, event order, ties, wall order."""

import math

import pytest

from fedasync.clock import JobTiming, VirtualClock, WallClock


def test_duration_is_units_times_unit_time_over_speed_plus_latency():
    clock = VirtualClock([1.0, 0.5], 0.2, latency_s=0.1, seed=3)

    assert clock.duration(0, 7, 10) == pytest.approx(10 * 0.2 / 1.0 + 0.1)
    assert clock.duration(1, 7, 10) == pytest.approx(10 * 0.2 / 0.5 + 0.1)


def test_jitter_is_seeded_per_worker_and_job_and_bounded():
    a = VirtualClock([1.0], 1.0, jitter=0.2, seed=5)
    b = VirtualClock([1.0], 1.0, jitter=0.2, seed=5)

    ds = [a.duration(0, j, 100) for j in range(50)]

    assert ds == [b.duration(0, j, 100) for j in range(50)]
    assert all(80.0 <= d <= 120.0 for d in ds)
    assert len(set(ds)) > 1


def test_select_takes_every_job_that_finishes_first_only_when_all_have_arrived():
    clock = VirtualClock([1.0, 1.0, 1.0], 1.0)
    inflight = {"a": JobTiming(0, 2.0), "b": JobTiming(0, 1.0), "c": JobTiming(0, 1.0)}

    assert clock.select(inflight, {"b"}) is None
    assert clock.select(inflight, {"a", "b", "c"}) == ["b", "c"]
    assert clock.next_event_time(inflight) == 1.0
    clock.advance_to(1.0)
    clock.advance_to(0.5)
    assert clock.now == 1.0
    assert clock.schedule(0, 1, 3).finishes_at == 4.0


def test_wall_clock_takes_arrivals_in_dispatch_order_and_never_schedules_a_finish():
    clock = WallClock()
    inflight = {"x": JobTiming(2.0, math.inf), "y": JobTiming(1.0, math.inf)}

    assert clock.select(inflight, set()) is None
    assert clock.select(inflight, {"x", "y", "z"}) == ["y", "x"]
    assert clock.schedule(0, 0, 5).finishes_at == math.inf


def test_bad_speeds_or_times_are_refused():
    with pytest.raises(ValueError):
        VirtualClock([1.0, 0.0], 1.0)
    with pytest.raises(ValueError):
        VirtualClock([1.0], -1.0)
    with pytest.raises(ValueError):
        VirtualClock([1.0], 1.0, jitter=1.0)


def test_state_round_trip_keeps_virtual_time():
    a = VirtualClock([1.0], 1.0)
    a.advance_to(12.5)
    b = VirtualClock([1.0], 1.0)
    b.load_state_dict(a.state_dict())

    assert b.now == 12.5
