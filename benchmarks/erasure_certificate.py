"""Time to make an erasure certificate from the store and the event log (goal: under 1 s).

What is timed is what ``fedasync erase certificate ID --run RUN_DIR`` and the Certificate RPC
do: open the store (read-only), read the request, its audit rows and the refusals naming it,
scan the event log, assemble the certificate (``server.erasure.certificate.build``), write its
JSON and render its HTML (``certificate_html.render``). Interpreter start-up and imports are
not counted. Median of ``--repeats`` runs, in wall seconds and in CPU seconds (the latter
is what to read on a busy machine).

By default on a worst case made here, in a temporary folder: one request for the most sample
ids the service accepts (65 536, so as many digests), walked through every state with the
metrics and facts the server records (checked after its window by the server's own verdict,
``certificate_checks.server_checks`` read by ``readings.verdict``, as the lifecycle does: its
figures are within, so it is verified, and its certificate reads so), 200 audit notes, 1000 refused calls naming it, and an
event log of ``--updates`` update lines (200 000: a long run) with a check after every
version of the relearning window. ``--run RUN_DIR`` times a real run's certificate instead
(``--request ID``: which; default its first request).

    .venv/bin/python benchmarks/erasure_certificate.py [--updates 200000] [--repeats 5]
    .venv/bin/python benchmarks/erasure_certificate.py --run runs/erase
Last line: ``certificate_render_s=<float>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.erasure.certificate import build, to_json  # noqa: E402
from server.erasure.certificate_checks import server_checks  # noqa: E402
from server.erasure.certificate_html import render  # noqa: E402
from server.erasure.readings import VERIFIED as WITHIN_ALL  # noqa: E402
from server.erasure.readings import summary, verdict  # noqa: E402
from server.erasure.states import State  # noqa: E402
from server.erasure.store import ErasureStore  # noqa: E402

SILO = 2
BOUNDARY, VERIFIED = 1000, 1020


def _worst_case(folder: Path, updates: int) -> str:
    """A store and an event log as large as a certificate ever reads; the request's id."""
    store = ErasureStore(folder / "erasures.sqlite")
    ids = [f"patient-{i:06d}/slide-{i % 7}" for i in range(65_536)]
    r, _ = store.submit(SILO, ids, "silo-2", 900, reason="consent withdrawn")
    store.transition(r.id, State.ERASING, actor="server", model_version=900, detail="sent")
    for i in range(200):
        store.note(r.id, actor="server", model_version=900 + i // 10, detail=f"note {i}")
    metrics = {f"silo_m{i}": 0.5 for i in range(24)} | {
        "forget_accuracy": 0.4,
        "test_accuracy": 0.6,
        "mia_auc": 0.52,
        "asr": 0.1,
        "asr_without_trigger": 0.08,
        "silo_auc": 0.51,
        "silo_auc_band": 0.1,
        "silo_indistinguishable": 1.0,
        "delta_norm": 0.2,
        "delta_bound": 0.5,
        "score_before": 0.61,
        "score_after": 0.6,
        "boundary_dip": 0.01,
        # the sample counts the server's verification reports beside its figures
        "forget_samples": 65_536.0,
        "test_samples": 2000.0,
        "mia_members": 2000.0,
        "mia_nonmembers": 2000.0,
    }
    facts = {
        "model_before_version": str(BOUNDARY - 1),
        "model_before_sha256": "a" * 64,
        "model_sha256": "b" * 64,
        "calibration_protect": "subspace",
        "calibration_target": "applied",
    }
    store.transition(
        r.id,
        State.CALIBRATING,
        actor="server",
        model_version=BOUNDARY,
        boundary_version=BOUNDARY,
        metrics=metrics,
        facts=facts,
    )
    after = {
        "forget_accuracy": 0.41,
        "test_accuracy": 0.6,
        "mia_auc": 0.5,
        "reversion_ratio": 0.02,
        **{
            k: metrics[k]
            for k in ("forget_samples", "test_samples", "mia_members", "mia_nonmembers")
        },
    }
    # checked after the window as the lifecycle checks it (lifecycle._checked), on the same
    # figures: verified only when every one is within
    v = verdict(server_checks(metrics, after, whole_silo=False))
    state = State.VERIFIED if v["verdict"] == WITHIN_ALL else State.UNVERIFIED
    store.transition(
        r.id,
        state,
        actor="server",
        model_version=VERIFIED,
        metrics=after,
        detail=f"{state.value} after 20 versions: {summary(v)}",
        facts={"model_sha256": "c" * 64},
    )
    for _ in range(1000):
        store.record_refusal("silo-0", "ipv4:10.0.0.1:5", "/x/Certificate", "NOT_FOUND", r.id)
    store.close()
    _event_log(folder / "metrics.jsonl", r.id, updates)
    return r.id


def _event_log(path: Path, rid: str, updates: int) -> None:
    lines = [{"event": "start", "t": 0.0, "version": 0, "clock": "virtual"}]
    for v in range(updates):
        lines.append(
            {
                "event": "update",
                "t": v * 0.5,
                "version": v,
                "silo": v % 6,
                "job": v,
                "staleness": 1,
                "weight": 0.2,
                "action": "accept",
                "norm": 0.1,
                "train_loss": 0.9,
                **({"calibration_overlap": 0.01} if v >= BOUNDARY else {}),
            }
        )
        if v == BOUNDARY:
            lines.append({"event": "erasure", "t": v * 0.5, "version": v, "request": rid,
                          "silo": SILO, "state": "calibrating"})  # fmt: skip
        if BOUNDARY < v < VERIFIED:
            lines.append({"event": "erasure_watch", "t": v * 0.5, "version": v, "request": rid,
                          "silo": SILO, "since_boundary": v - BOUNDARY, "mia_auc": 0.5})  # fmt: skip
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def _once(
    store_path: Path, events: Path | None, rid: str, out: Path
) -> tuple[float, float, int, str]:
    """One certificate made and written: wall seconds, CPU seconds, bytes, its verdict."""
    t0, c0 = time.perf_counter(), time.process_time()
    with ErasureStore(store_path, readonly=True) as store:
        cert = build(store, rid, events=events)
    text, page = to_json(cert), render(cert)
    (out / "certificate.json").write_text(text)
    (out / "certificate.html").write_text(page)
    size = len(text.encode()) + len(page.encode())
    return time.perf_counter() - t0, time.process_time() - c0, size, cert["verdict"]["reading"]


def main() -> None:
    """Time it (module docstring); print each run and the median last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a real run folder instead of the worst case")
    parser.add_argument("--request", help="the request (with --run; default: its first)")
    parser.add_argument("--updates", type=int, default=200_000, help="update lines (worst case)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if args.run is None:
            rid = _worst_case(out, args.updates)
            store, events = out / "erasures.sqlite", out / "metrics.jsonl"
            what = f"worst case: 65536 digests, {args.updates} update lines"
        else:
            store, events = args.run / "erasures.sqlite", args.run / "metrics.jsonl"
            with ErasureStore(store, readonly=True) as s:
                rid = args.request or s.list()[0].id
            what = f"run {args.run}, request {rid}"
        log_mb = events.stat().st_size / 1e6 if events.is_file() else 0.0
        times, cpu = [], []
        for _ in range(args.repeats):
            seconds, used, size, reading = _once(
                store, events if events.is_file() else None, rid, out
            )
            times.append(seconds)
            cpu.append(used)
            print(
                f"  {seconds:.3f} s wall, {used:.3f} s CPU ({size / 1e6:.2f} MB of JSON + HTML;"
                f" it reads {reading})",
                flush=True,
            )
    print(f"{what}; event log {log_mb:.1f} MB; median of {args.repeats}")
    print(f"certificate_cpu_s={statistics.median(cpu):.3f}")
    print(f"certificate_render_s={statistics.median(times):.3f}")


if __name__ == "__main__":
    main()
