"""tools/server_parity.py's comparison on synthetic fingerprints (its recording runs six
simulations: minutes, run by hand around a redesign of server/)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "server_parity.py"
_spec = importlib.util.spec_from_file_location("server_parity", _PATH)
assert _spec is not None and _spec.loader is not None
parity = importlib.util.module_from_spec(_spec)
sys.modules["server_parity"] = parity
_spec.loader.exec_module(parity)


def _run(tmp_path: Path, name: str, events: list[dict], summary: dict) -> Path:
    run = tmp_path / name
    (run / "models").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "models" / "version-3.pt").write_bytes(b"weights")
    return run


def test_noise_is_left_out_and_paths_lose_their_run_folder(tmp_path):
    run = _run(
        tmp_path,
        "a",
        [
            {"event": "roster", "t": 0.0, "silos": {"0": {"node": 123, "num_samples": 5}}},
            {"event": "update", "t": 1.0, "silo": 0, "train_seconds": 0.37},
        ],
        {"wall_time_s": 33.0, "bundles": {"final": str(tmp_path / "a" / "bundle")}},
    )
    got = parity.fingerprint(run)
    assert got["events"][0]["silos"] == {"0": {"num_samples": 5}}
    assert "train_seconds" not in got["events"][1]
    assert got["summary"] == {"bundles.final": "<run>/bundle"}
    assert list(got["models"]) == ["version-3.pt"]


def _recording(tmp_path: Path, side: str, runs: dict[str, dict]) -> Path:
    out = tmp_path / side
    out.mkdir()
    (out / "fingerprint.json").write_text(json.dumps(runs))
    return out


def _print(events, summary, models=None):
    return {"events": events, "summary": summary, "models": models or {"v.pt": "ab"}}


def test_identical_recordings_pass_and_a_changed_event_or_summary_fails(tmp_path, capsys):
    ev = [{"event": "version", "t": 1.0, "version": 1}]
    a = _recording(tmp_path, "a", {"fedasync": _print(ev, {"final_accuracy": 0.6})})
    same = _recording(tmp_path, "same", {"fedasync": _print(ev, {"final_accuracy": 0.6})})
    assert parity.compare(a, same, {}) == 0
    assert "fedasync: identical (1 events)" in capsys.readouterr().out
    moved = [{"event": "version", "t": 1.5, "version": 1}]
    b = _recording(tmp_path, "b", {"fedasync": _print(moved, {"final_accuracy": 0.7})})
    assert parity.compare(a, b, {}) == 1
    out = capsys.readouterr().out
    assert "event 0 (version at t=1.0): differs in ['t']" in out
    assert "summary final_accuracy: 0.6 -> 0.7" in out


def test_a_renamed_key_reads_as_its_new_name_and_nothing_else_passes_for_it(tmp_path, capsys):
    ev = [{"event": "eval", "t": 0.0, "final_accuracy": 0.5}]
    a = _recording(tmp_path, "a", {"sync": _print(ev, {"x": {"final_accuracy": 0.6}})})
    renamed = [{"event": "eval", "t": 0.0, "final_score": 0.5}]
    b = _recording(tmp_path, "b", {"sync": _print(renamed, {"x": {"final_score": 0.6}})})
    assert parity.compare(a, b, {}) == 1
    capsys.readouterr()
    assert parity.compare(a, b, {"final_accuracy": "final_score"}) == 0
    # other weights, or a configuration recorded on one side only, are differences
    c = _recording(
        tmp_path, "c", {"sync": _print(renamed, {"x": {"final_score": 0.6}}, {"v.pt": "cd"})}
    )
    assert parity.compare(a, c, {"final_accuracy": "final_score"}) == 1
    assert "models differ" in capsys.readouterr().out
    d = _recording(tmp_path, "d", {})
    assert parity.compare(a, d, {}) == 1
    assert "recorded on one side only" in capsys.readouterr().out


def test_a_malformed_rename_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parity.main(["compare", str(tmp_path), str(tmp_path), "--rename", "nope" * 100])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--rename takes OLD=NEW" in err and len(err) < 200


def test_request_ids_are_named_by_appearance_and_a_cancelled_jobs_discard_is_unordered(tmp_path):
    rid = "2d2edcf0812247d09e3885a53cf7c777"
    cancelled = {
        "event": "reply_discarded",
        "silo": 1,
        "job": 16,
        "reason": f"its job was cancelled for erasure {rid}",
    }
    upd = {"event": "update", "t": 40.8, "silo": 0}
    early = _run(
        tmp_path, "early", [{"event": "erasure", "request": rid}, {**cancelled, "t": 40.0}, upd], {}
    )
    other_id = "f" * 32  # another run draws another id for the same request
    late_cancel = {**cancelled, "t": 42.1, "reason": cancelled["reason"].replace(rid, other_id)}
    late = _run(tmp_path, "late", [{"event": "erasure", "request": other_id}, upd, late_cancel], {})
    a, b = parity.fingerprint(early), parity.fingerprint(late)
    assert a["events"][0]["request"] == "<id 1>"
    assert a["discarded"][0]["reason"] == "its job was cancelled for erasure <id 1>"
    assert parity.differences(a, b) == []
    # a discard of another job is a difference
    other = _run(
        tmp_path, "other", [{"event": "erasure", "request": rid}, upd, {**cancelled, "job": 17}], {}
    )
    assert parity.differences(a, parity.fingerprint(other)) == [
        "the discarded replies of cancelled jobs differ"
    ]
