"""An erasure whose silo goes down mid-erasure is not lost: it goes back to ``queued`` (the
audit log says why) and runs again when the silo is back, and is applied exactly once.

In-process (real ServerApp loop, real ClientApp): the grid plays what a SuperLink does when a
SuperNode goes down while it holds a ``train.unlearn`` message: an error reply (the ClientApp
crashed, or the node is reported offline), or no reply at all.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode
from inprocess import CHECKED, InProcessGrid, checked_rows

import server.unlearning.lifecycle
from clients.app import app as client_app
from fedasync.events import read_events
from server.app import run_server
from server.erasure.states import State
from server.erasure.store import ErasureStore
from server.unlearning import WENT_DOWN, WENT_OFFLINE

ERASE = (
    "erasures=[{silo: 1, at_s: 10}]",
    "lab.erasure.relearn_versions=4",
    "unlearning.steps=2",  # short erasures: an attempt costs about 4 versions of the others
    "lab.erasure.signature_batches=2",
    "server.eval_every=5",
)
SILO_1 = 1001  # InProcessGrid's node of silo 1


class _SiloDownMidErasure(InProcessGrid):
    """Silo 1 goes down while holding its first ``lose`` train.unlearn messages: each is
    answered with an error reply of ``code``, or (``code=None``) never answered."""

    def __init__(self, *args, lose: int = 1, code: int | None = ErrorCode.CLIENT_APP_CRASHED):
        super().__init__(*args)
        self.lose, self.code = lose, code
        self.unlearn_sent = 0

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            if msg.metadata.message_type != "train.unlearn" or msg.metadata.dst_node_id != SILO_1:
                ids.extend(super().push_messages([msg]))
                continue
            self.unlearn_sent += 1
            if self.unlearn_sent > self.lose:
                ids.extend(super().push_messages([msg]))
                continue
            mid = f"lost-{self.unlearn_sent}"
            msg.metadata.__dict__["_message_id"] = mid
            self.pushed.append(msg)
            if self.code is not None:
                err = Error(code=self.code, reason="the SuperNode went down")
                self.replies[mid] = Message(err, reply_to=msg)
            ids.append(mid)
        return ids


def _transitions(run_dir: Path, rid: str) -> list[tuple[str | None, str, str]]:
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        return [
            (None if a.from_state is None else a.from_state.value, a.to_state.value, a.detail)
            for a in store.audit(rid)
            if a.action != "note"
        ]


def _erasure_states(run_dir: Path) -> list[str]:
    return [e["state"] for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "erasure"]


def test_silo_down_mid_erasure_requeues_and_the_erasure_runs_again_once(small_cfg):
    # Prepare: silo 1's SuperNode crashes while erasing, the first time only
    cfg = small_cfg("run.max_versions=40", *ERASE)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = _SiloDownMidErasure(client_app, 3, lose=1)
    # Execute
    summary = run_server(grid, cfg, run_dir)
    # Assert: checked after its window, after a second start
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and req["failure_reason"] == ""
    assert grid.unlearn_sent == 2
    moves = _transitions(run_dir, req["id"])
    assert [(a, b) for a, b, _ in moves] == [
        (None, "queued"),
        ("queued", "erasing"),
        ("erasing", "queued"),
        ("queued", "erasing"),
        ("erasing", "calibrating"),
        ("calibrating", req["state"]),
    ]
    why = moves[2][2]
    assert why.startswith(WENT_DOWN) and "will retry when it returns" in why
    assert "the SuperNode went down" in why
    # ...applied exactly once: one boundary, one calibrating event, one report; the server's
    # removal once, at the first start (the second start has nothing to remove)
    # (and steps of what the held-out bound withheld of the removal, if any, only while the
    # request is in progress: never while it waits, queued, for its silo)
    states = ["removed", "erasing", "queued", "erasing", "calibrating", req["state"]]
    seen = _erasure_states(run_dir)
    assert [s for s in seen if s != "removed_more"] == states
    waiting = seen[seen.index("queued") : seen.index("queued") + 2]
    assert waiting == ["queued", "erasing"]
    (row,) = checked_rows(summary)
    events = read_events(run_dir / "metrics.jsonl")
    after = [
        e for e in events if e["event"] == "update" and e["version"] >= row["boundary_version"]
    ]
    assert after and all(e["silo"] != 1 for e in after), "the erased silo never trains again"


def test_no_reply_mid_erasure_is_requeued_too(small_cfg):
    # Prepare: the first train.unlearn is never answered; the loop gives up after 0.5 s wall
    cfg = small_cfg("run.max_versions=40", "server.reply_timeout_s=0.5", *ERASE)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = _SiloDownMidErasure(client_app, 3, lose=1, code=None)
    # Execute
    summary = run_server(grid, cfg, run_dir)
    # Assert
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and grid.unlearn_sent == 2
    moves = _transitions(run_dir, req["id"])
    (requeue,) = [d for a, b, d in moves if (a, b) == ("erasing", "queued")]
    assert requeue.startswith(WENT_DOWN) and "no reply within" in requeue
    assert [(a, b) for a, b, _ in moves].count(("erasing", "calibrating")) == 1


def test_offline_silo_is_retried_after_a_pause_and_not_counted(small_cfg):
    # Prepare: the SuperLink reports silo 1 offline for 4 erasure messages, more than
    # max_attempts (3): being offline is waiting, not failing
    cfg = small_cfg("run.max_versions=60", "lab.offline_retry_s=4", *ERASE)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = _SiloDownMidErasure(client_app, 3, lose=4, code=ErrorCode.NODE_UNAVAILABLE)
    # Execute
    summary = run_server(grid, cfg, run_dir)
    # Assert
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and grid.unlearn_sent == 5
    requeues = [
        d for a, b, d in _transitions(run_dir, req["id"]) if (a, b) == ("erasing", "queued")
    ]
    assert len(requeues) == 4 and all(d.startswith(WENT_OFFLINE) for d in requeues)
    # each new start waited lab.offline_retry_s (virtual seconds here) after the refusal
    events = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "erasure"]
    back = [e["t"] for e in events if e["state"] == "queued"]
    starts = [e["t"] for e in events if e["state"] == "erasing"]
    assert all(s - b >= 4.0 - 1e-9 for b, s in zip(back, starts[1:], strict=True))
    assert [e["state"] for e in events].count("calibrating") == 1


def test_a_silo_that_keeps_going_down_fails_the_erasure_after_max_attempts(small_cfg):
    # Prepare: every erasure message is lost (the ClientApp crashes each time)
    cfg = small_cfg("run.max_versions=40", *ERASE)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = _SiloDownMidErasure(client_app, 3, lose=100)
    # Execute
    summary = run_server(grid, cfg, run_dir)
    # Assert: three attempts (MAX_ATTEMPTS), then failed with the reason
    (req,) = summary["erasures"]["requests"]
    assert req["state"] == "failed" and grid.unlearn_sent == 3
    assert req["failure_reason"].startswith(f"{WENT_DOWN} 3 times")
    assert "max_attempts=3" in req["failure_reason"]
    moves = [(a, b) for a, b, _ in _transitions(run_dir, req["id"])]
    assert moves.count(("erasing", "queued")) == 2 and moves[-1] == ("erasing", "failed")
    assert summary["erasures"]["applied"] == []
    # a failed erasure does not retire the silo: it trains again
    events = read_events(run_dir / "metrics.jsonl")
    failed_t = next(e["t"] for e in events if e["event"] == "erasure" and e["state"] == "failed")
    assert any(e["event"] == "update" and e["silo"] == 1 and e["t"] > failed_t for e in events)


def test_max_attempts_is_the_constant(small_cfg, monkeypatch):
    monkeypatch.setattr(server.unlearning.lifecycle, "MAX_ATTEMPTS", 1)
    cfg = small_cfg("run.max_versions=20", *ERASE)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = _SiloDownMidErasure(client_app, 3, lose=100)
    summary = run_server(grid, cfg, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] == "failed" and grid.unlearn_sent == 1
    assert "max_attempts=1" in req["failure_reason"]


def test_resume_while_requeued_neither_loses_nor_repeats_the_erasure(small_cfg):
    # Prepare: run A ends while the request is back in the queue (silo 1 offline, its retry
    # pause longer than what is left of the run)
    common = (*ERASE, "lab.offline_retry_s=30")
    first = small_cfg("run.max_versions=20", *common)
    run_dir = Path(first.run.out_dir) / first.run.name
    summary = run_server(
        _SiloDownMidErasure(client_app, 3, lose=1, code=ErrorCode.NODE_UNAVAILABLE),
        first,
        run_dir,
    )
    (req,) = summary["erasures"]["requests"]
    assert req["state"] == "queued", "run A stopped while the request was requeued"
    assert summary["erasures"]["applied"] == []
    # Execute: the server restarts from its checkpoint; silo 1 is back
    second = small_cfg("run.max_versions=70", "run.resume=true", *common)
    grid = _SiloDownMidErasure(client_app, 3, lose=0)
    summary = run_server(grid, second, run_dir)
    # Assert: started again (once silo 1 is back), checked after its window, applied once
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and grid.unlearn_sent == 1
    moves = [(a, b) for a, b, _ in _transitions(run_dir, req["id"])]
    assert moves == [
        (None, "queued"),
        ("queued", "erasing"),
        ("erasing", "queued"),
        ("queued", "erasing"),
        ("erasing", "calibrating"),
        ("calibrating", req["state"]),
    ]
    assert len(summary["erasures"]["applied"]) == 1
    assert _erasure_states(run_dir).count("calibrating") == 1
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        assert store.get(req["id"]).state is State(req["state"])
