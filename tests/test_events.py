"""The event log (``fedasync.events``) as a live reader sees it: whole lines, a torn tail left out.

CI once read a metrics.jsonl while the run was writing it and got half a line
(``{"event": "rollout", "version": 1, "g``); the reader must leave that out, not fail.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from fedasync.events import EventLog, EventLogError, read_events


def test_events_round_trip_with_non_finite_floats_as_null(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "m" / "metrics.jsonl")
    log.write("start", t=0.0, version=0)
    log.write("eval", t=1.5, version=3, loss=float("nan"), sizes=(1, 2))
    log.close()
    log.close()  # a second close is harmless
    assert read_events(tmp_path / "m" / "metrics.jsonl") == [
        {"event": "start", "t": 0.0, "version": 0},
        {"event": "eval", "t": 1.5, "version": 3, "loss": None, "sizes": [1, 2]},
    ]


def test_a_torn_last_line_is_left_out_and_a_corrupt_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "start", "version": 0}\n{"event": "rollout", "version": 1, "g')
    assert read_events(path) == [{"event": "start", "version": 0}]

    path.write_text('{"event": "start"}\n' + "x" * 100_000 + '\n{"event": "end"}\n')
    with pytest.raises(EventLogError, match=r"line 2 is not a JSON event") as e:
        read_events(path)
    assert len(str(e.value)) < 300  # the bad line is named, not echoed

    path.write_text('{"event": "start"}\n[1, 2]\n')
    with pytest.raises(EventLogError, match=r"line 2 is not a JSON object"):
        read_events(path)

    path.write_bytes(b'{"event": "start"}\n\xff\xfe\n')
    with pytest.raises(EventLogError, match=r"line 2"):
        read_events(path)


def test_offset_and_truncate_drop_what_came_after_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = EventLog(path)
    log.write("start", version=0)
    at = log.offset()
    assert at == path.stat().st_size
    log.write("update", version=1)
    log.write("update", version=2)
    log.truncate(at)
    log.write("resume", version=0)
    log.close()
    assert [e["event"] for e in read_events(path)] == ["start", "resume"]

    # A reopened log appends after what is there.
    log = EventLog(path)
    log.write("end", version=0)
    log.close()
    assert [e["event"] for e in read_events(path)] == ["start", "resume", "end"]


def _writer(path: str, n: int) -> None:
    log = EventLog(Path(path))
    for i in range(n):
        # Lines longer than a text file's 8 KiB buffer, which once reached the disk in pieces.
        log.write("rollout", version=i, payload="y" * (20_000 + 37 * i))
    log.close()


def test_a_reader_polling_a_live_log_only_ever_sees_whole_events(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.touch()
    n = 300
    proc = mp.get_context("spawn").Process(target=_writer, args=(str(path), n))
    proc.start()
    seen, polls = 0, 0
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            events = read_events(path)  # raises on a torn line before the last
            assert [e["version"] for e in events] == list(range(len(events)))
            assert all(len(e["payload"]) == 20_000 + 37 * e["version"] for e in events)
            seen, polls = len(events), polls + 1
            if not proc.is_alive() and seen == n:
                break
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    assert seen == n and polls > 1


def test_a_log_killed_mid_line_reads_back_to_its_last_whole_event(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = EventLog(path)
    log.write("start", version=0)
    log.close()
    whole = json.dumps({"event": "update", "version": 1}) + "\n"
    with open(path, "ab") as f:  # what a kill between two pieces of one line leaves
        f.write(whole.encode()[:10])
    assert not path.read_bytes().endswith(b"\n")  # the torn tail is there
    assert read_events(path) == [{"event": "start", "version": 0}]


def test_skip_bad_reads_every_whole_object_around_a_line_torn_in_the_middle(tmp_path: Path) -> None:
    # A crash tore a line, then the resumed run appended after it (the pipeline trainer's case)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"event": "a"}\n{"event": "b", "x\n[1]\n\xff\n{"event": "c"}\n{"event": "d"}'
    )
    with pytest.raises(EventLogError, match="line 2"):
        read_events(path)
    assert [e["event"] for e in read_events(path, skip_bad=True)] == ["a", "c", "d"]
