"""The dispatcher's indexes and its bound on kept weights (server/dispatch.py), by hand; and,
on the real loop, what the bound does to delay compensation and to a resumed run."""

from __future__ import annotations

from pathlib import Path

import torch
from inprocess import InProcessGrid

import server.loop
from clients.app import app as client_app
from fedasync.clock import VirtualClock
from fedasync.events import EventLog, read_events
from protocol import keys as P
from server.app import run_server
from server.checkpoint import load_state
from server.dispatch import Dispatcher
from server.intake import Job


class _Grid:
    """Message ids m1, m2, ... and nothing else."""

    def __init__(self) -> None:
        self.n = 0

    def push_messages(self, msgs):
        out = []
        for _ in msgs:
            self.n += 1
            out.append(f"m{self.n}")
        return out


def _dispatcher(tmp_path: Path, max_snapshots: int | None = None) -> Dispatcher:
    clock = VirtualClock([1.0] * 4, 1.0)
    return Dispatcher(_Grid(), clock, EventLog(tmp_path / "events.jsonl"), max_snapshots)


def _send(d: Dispatcher, silo: int, base: int, finishes: float = 1.0) -> str | None:
    job = Job("", silo, silo + 1, d.new_job_id(), base, 0.0, finishes, 0.0)
    return job.msg_id if d.send(None, job, version=base) else None  # type: ignore[arg-type]


def _params(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2,), v)}


def test_holding_follows_sends_takes_and_retries(tmp_path):
    # Prepare
    d = _dispatcher(tmp_path)
    # Execute / Assert: a job in flight
    mid = _send(d, 1, 0)
    assert d.holding(1) == "its train job 0 is in flight"
    assert d.holding(2) is None and not d.is_down(1)
    # a second job for the busy silo is refused, and the first stays the one held
    assert _send(d, 1, 0) is None
    assert d.refused == 1 and d.holding(1) == "its train job 0 is in flight"
    # taken (replied or abandoned): idle
    assert d.take(mid).silo == 1
    assert d.holding(1) is None and len(d.inflight) == 0 and not d.unanswered
    # down: two failures waiting (10 and 20), the earlier taken first
    d.retry_after(1, 20.0)
    d.retry_after(1, 10.0)
    assert d.is_down(1) and d.holding(1) == "it is down until t=20.0"
    assert d.next_retry() == (10.0, 1)
    assert d.is_down(1)
    assert d.next_retry() == (20.0, 1)
    assert not d.is_down(1) and d.holding(1) is None and d.retries == []


def test_answered_and_taken_messages_leave_the_unanswered_in_send_order(tmp_path):
    d = _dispatcher(tmp_path)
    a, b, c = (_send(d, s, 0) for s in (0, 1, 2))

    d.answered(b)
    d.take(c)

    assert list(d.unanswered) == [a]
    assert list(d.inflight) == [a, b]


def test_sent_weights_live_while_a_job_refers_to_them(tmp_path):
    # Prepare: two jobs from version 0, one from version 1, and version 2 kept but refused
    d = _dispatcher(tmp_path)
    d.keep_sent(0, _params(0))
    a, b = _send(d, 0, 0), _send(d, 1, 0)
    d.keep_sent(1, _params(1))
    c = _send(d, 2, 1)
    d.keep_sent(2, _params(2))
    assert _send(d, 2, 2) is None  # silo 2 is busy: version 2 has no job
    # Execute / Assert
    d.prune_sent()
    assert sorted(d.sent) == [0, 1]
    d.take(a)
    d.prune_sent()
    assert sorted(d.sent) == [0, 1]  # b still refers to version 0
    d.take(b)
    d.prune_sent()
    assert sorted(d.sent) == [1]
    d.take(c)
    d.prune_sent()
    assert d.sent == {}
    assert d.snapshots_dropped == 0


def test_max_snapshots_drops_the_unreferenced_first_then_the_oldest(tmp_path):
    # Prepare: at most 2 versions kept
    d = _dispatcher(tmp_path, max_snapshots=2)
    jobs = {}
    for v in range(3):
        d.keep_sent(v, _params(v))
        jobs[v] = _send(d, v, v)
        assert len(d.sent) <= 2
    # Assert: version 0 (oldest, still referred to) was dropped for version 2
    assert sorted(d.sent) == [1, 2] and d.snapshots_dropped == 1
    # Execute: version 1's job is taken, then version 3 is kept
    d.take(jobs[1])
    d.keep_sent(3, _params(3))
    _send(d, 3, 3)
    # Assert: the unreferenced version 1 made room, not the older-but-referenced one
    assert sorted(d.sent) == [2, 3] and d.snapshots_dropped == 1
    # the checkpoint has the weights of the kept versions only
    state = d.state_dict(_params(3), version=3)
    assert sorted(state["base_params"]) == [2, 3]
    assert state["snapshots_dropped"] == 1
    fresh = _dispatcher(tmp_path, max_snapshots=2)
    fresh.load_state_dict(state)
    assert sorted(fresh.sent) == [2, 3] and fresh.snapshots_dropped == 1


def test_max_snapshots_zero_keeps_none(tmp_path):
    d = _dispatcher(tmp_path, max_snapshots=0)

    d.keep_sent(0, _params(0))
    _send(d, 0, 0)

    assert d.sent == {}


def _run(cfg):
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = InProcessGrid(client_app, cfg.silos.count)
    return run_server(grid, cfg, run_dir), run_dir, grid


def test_an_update_whose_base_was_dropped_is_folded_without_delay_compensation(
    small_cfg, monkeypatch
):
    # Prepare: stragglers, delay compensation on, no weights kept
    monkeypatch.setattr(server.loop, "MAX_SNAPSHOTS", 0)
    cfg = small_cfg(
        "run.max_versions=8",
        "lab.speed.profile=stragglers",
        "lab.speed.straggler_fraction=0.34",
        "lab.corrections.delay_compensation=0.1",
    )
    # Execute
    summary, run_dir, _ = _run(cfg)
    # Assert: every stale update says so, and the summary counts them
    updates = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"]
    stale = [e for e in updates if e["staleness"] > 0]
    assert stale, "the straggler's update must arrive stale"
    assert all(e.get("dc_skipped") for e in stale)
    assert not any(e.get("dc_skipped") for e in updates if e["staleness"] == 0)
    assert summary["dc_skipped"] == len(stale)


def test_the_default_bound_skips_no_delay_compensation(small_cfg):
    cfg = small_cfg(
        "run.max_versions=8",
        "lab.speed.profile=stragglers",
        "lab.speed.straggler_fraction=0.34",
        "lab.corrections.delay_compensation=0.1",
    )

    summary, _, _ = _run(cfg)

    assert summary["staleness_max"] >= 1 and summary["dc_skipped"] == 0


def test_resume_re_sends_a_job_whose_base_was_dropped_from_the_checkpoint_model(
    small_cfg, tmp_path, monkeypatch
):
    # Prepare: a checkpoint at version 4 that keeps the weights of one version only
    monkeypatch.setattr(server.loop, "MAX_SNAPSHOTS", 1)
    common = (
        "run.name=r",
        "lab.speed.profile=lognormal",
        "lab.corrections.delay_compensation=0.1",
    )
    _run(small_cfg(*common, "run.max_versions=4", "server.checkpoint_every=4"))
    state = load_state(tmp_path / "r" / "checkpoint.pt")
    kept = state.parts["dispatcher"]["base_params"]
    dropped = {j["job_id"] for j in state.jobs if j["base_version"] not in kept}
    assert state.version == 4 and dropped, "some job in flight must have lost its weights"
    # Execute
    summary, _, grid = _run(small_cfg(*common, "run.max_versions=8", "run.resume=true"))
    # Assert: those jobs went out again under their job ids, from the version-4 model
    trains = [m.content[P.CONFIG] for m in grid.pushed if m.metadata.message_type == P.TRAIN]
    resent = {int(c[P.JOB_ID]): int(c[P.BASE_VERSION]) for c in trains[: len(state.jobs)]}
    assert set(resent) == {j["job_id"] for j in state.jobs}
    assert all(resent[j] == 4 for j in dropped)
    assert all(
        resent[j["job_id"]] == j["base_version"] for j in state.jobs if j["job_id"] not in dropped
    )
    assert summary["versions"] == 8 and summary["updates_rejected_total"] == 0


def test_timed_out_jobs_are_taken_oldest_first_and_answered_ones_are_left(tmp_path, monkeypatch):
    import server.dispatch as dispatch

    now = [100.0]
    monkeypatch.setattr(dispatch.time, "monotonic", lambda: now[0])
    d = _dispatcher(tmp_path)
    a = _send(d, 0, 0)
    now[0] = 105.0
    b = _send(d, 1, 0)
    now[0] = 110.0
    c = _send(d, 2, 0)
    d.answered(b)  # its reply is here: not waiting, whatever its age
    now[0] = 112.0
    # a waited 12 s and c 2 s: with a limit of 5 s only a is taken
    assert [j.msg_id for j in d.take_timed_out(5.0)] == [a]
    assert list(d.inflight) == [b, c] and list(d.unanswered) == [c]
    assert d.take_timed_out(5.0) == [] and d.holding(0) is None


def test_jobs_to_resend_are_the_train_jobs_in_job_order(tmp_path):
    d = _dispatcher(tmp_path)
    _send(d, 2, 0, finishes=3.0)
    _send(d, 0, 0, finishes=1.5)
    got = d.jobs_to_resend()
    assert [(j["silo"], j["job_id"], j["finishes_at"]) for j in got] == [(2, 0, 3.0), (0, 1, 1.5)]
    assert set(got[0]) == {
        "silo",
        "job_id",
        "base_version",
        "dispatched_at",
        "finishes_at",
        "fault",
    }
