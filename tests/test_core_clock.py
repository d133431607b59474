"""The core clocks (fedasync.clock), by hand: durations, event order, ties, wall order."""

import math
import random

import pytest

from fedasync.clock import InFlight, JobTiming, VirtualClock, WallClock


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


def test_in_flight_answers_as_a_scan_of_a_dict_would():
    # Prepare: jobs finishing on a coarse grid (many ties, some within 1e-9), sent and taken
    rng = random.Random(0)
    clock = VirtualClock([1.0], 1.0)
    heap: InFlight[JobTiming] = InFlight()
    plain: dict[str, JobTiming] = {}
    for i in range(2000):
        # Execute
        if plain and rng.random() < 0.45:
            key = rng.choice(sorted(plain))
            del heap[key], plain[key]
        else:
            t = rng.randrange(40) * 0.5 + rng.choice([0.0, 0.0, 1e-10, 1e-6])
            heap[f"m{i}"] = plain[f"m{i}"] = JobTiming(0.0, t)
        arrived = {k for k in plain if rng.random() < 0.9}
        # Assert
        assert clock.next_event_time(heap) == clock.next_event_time(plain)
        assert clock.select(heap, arrived) == clock.select(plain, arrived)
        assert clock.select(heap, set(plain)) == clock.select(plain, set(plain))
    assert list(heap) == list(plain) and len(heap) == len(plain)


def test_in_flight_drops_the_entries_of_taken_jobs():
    heap: InFlight[JobTiming] = InFlight()
    for i in range(1000):
        heap[f"m{i}"] = JobTiming(0.0, math.inf)  # the wall clock: never taken from the top
        if i >= 10:
            del heap[f"m{i - 10}"]

    assert len(heap) == 10 and len(heap._heap) <= 2 * 10 + 64
    assert heap.earliest() == math.inf and len(heap.first_event()) == 10


def test_kinds_due_is_the_earliest_kind_virtually_and_every_pending_one_on_the_wall():
    virtual, wall = VirtualClock([1.0], 1.0), WallClock()
    inf = math.inf

    assert virtual.kinds_due([inf, 2.0, 1.0]) == [2]
    assert virtual.kinds_due([1.0, 1.0, 0.5]) == [2]
    assert virtual.kinds_due([1.0, 1.0, 1.0]) == [0]  # a tie goes to the kind listed first
    assert virtual.kinds_due([inf, inf]) == []
    assert wall.kinds_due([inf, 2.0, 1.0]) == [1, 2]  # all due: the loop's order decides
    assert wall.kinds_due([inf, inf]) == []


def test_finish_ends_and_queue_time_work_virtually_and_say_now_on_the_wall():
    clock = VirtualClock([1.0, 0.5], 2.0, jitter=0.1, seed=4)
    clock.advance_to(3.0)

    assert clock.finish_at(1, 9, 1.0, 5) == 1.0 + clock.duration(1, 9, 5)
    assert clock.ends_at(3.0, 0.25) == 3.25
    free = [4.0, 2.0]
    assert clock.queue(free, 1.0, 1.5) == (1, 3.5)  # the earliest-free server, once free
    assert clock.queue(free, 5.0, 1.0) == (1, 6.0)  # ready after both are free: server 1
    assert free == [4.0, 6.0]
    wall = WallClock()
    free = [0.0]
    server, end = wall.queue(free, 0.0, 9.0)
    assert server == -1 and end <= wall.now and free == [0.0]
    assert wall.finish_at(0, 1, 0.0, 9.0) <= wall.now and wall.ends_at(0.0, 9.0) <= wall.now
