"""The erasure certificate of one request: what a data-protection officer reads to learn that a
silo's data (or some of its samples) was erased from the federated model, and how that is known.

``build(store, request_id, events=..., references=...)`` assembles it as a plain dict, written
as ``certificate.json`` (``to_json``); ``certificate_html.render`` turns that dict into a page
that needs nothing else to be read (``certificate.html``). Its parts:

- the request: who asked, when, for which silo and which samples, as digests (never the ids);
- the verdict (``verdict``): ``verified`` only when every figure with a rule reads ``within``
  its reference (readings.py), else ``not verified`` with the checks and figures not within;
  a request in progress reads as its state (queued, erasing, calibrating), a failed one as
  ``failed``;
- the timeline: requested -> silo started -> (the server's removal, at once) -> its part in
  the global model -> calibration
  -> checked again after the relearning window, from the store's audit rows (wall clock) and the run's events (run clock);
- the global model's version and SHA-256 just before the erasure boundary, at it and when
  checked again (facts the server records with the audit rows: server/unlearning/attest.py);
- every check the system ran for the request, each figure beside its reference with its
  reading (``within``, ``not within`` or ``informational``, the rule and the tolerance), and,
  apart, every check that did not run and why (certificate_checks.py, certificate_gaps.py);
- the request's audit rows and the refused calls that name it.

Only the erasure store and the event log are read (and, offline, retraining reference runs), so
the same files give the same certificate later: the JSON is deterministic (no time of making,
sorted keys, non-finite numbers as null). Every text is cut and every list bounded
(``Bounds``): a certificate's size is bounded whatever the store holds.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from server.erasure.certificate_checks import (
    CHECKED_EVENTS,
    checked,
    checks,
    last,
    num,
    transitions,
)
from server.erasure.certificate_events import RunEvents, read_reference, read_run_events
from server.erasure.certificate_gaps import not_verified
from server.erasure.limits import Bounds
from server.erasure.readings import NOT_VERIFIED, TOLERANCES, summary, verdict
from server.erasure.records import AuditRow, Refusal, Request, RequestNotFound
from server.erasure.refusals import REFUSALS_KEPT
from server.erasure.states import CHECKED, REMOVAL_NOTE, UNFINISHED, State
from server.erasure.store import ErasureStore

FORMAT = "fedasync-erasure-certificate"
VERSION = 1
DIGEST = "HMAC-SHA256 keyed with the request id, of the sample id; first 16 bytes, hex"


BOUNDS = Bounds()


def cut(text: object, limit: int) -> str:
    """``str(text)``, cut to ``limit`` characters with the full length said when longer."""
    s = str(text)
    return s if len(s) <= limit else f"{s[:limit]}… ({len(s)} characters)"


def iso(ms: int | None) -> str | None:
    """Milliseconds since the epoch as an ISO 8601 UTC time (to the millisecond)."""
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def sample_digest(request_id: str, sample_id: str) -> str:
    """``HMAC-SHA256(request id, sample id)``, its first 16 bytes in hex: how a certificate
    names a sample (``protocol.ids.digest`` with the request id as the salt). Whoever holds a
    sample id checks that it is listed by computing the same; digests of two requests cannot
    be matched with each other. Like any digest of a guessable id, it can be tested by someone
    who guesses the id (protocol/ids.py)."""
    return hmac.digest(request_id.encode(), sample_id.encode(), "sha256")[:16].hex()


def build(
    store: ErasureStore,
    request_id: str,
    *,
    events: Path | None = None,
    references: Sequence[Path] = (),
    bounds: Bounds = BOUNDS,
) -> dict[str, Any]:
    """The certificate of request ``request_id`` as a JSON-ready dict, from ``store``, the
    run's event log ``events`` (None: without it; the certificate says what that leaves out)
    and retraining reference run folders ``references``. RequestNotFound for an unknown id."""
    with store.changed:  # the store's lock: one consistent reading of the request
        r = store.get(request_id)
        if r is None:
            raise RequestNotFound(request_id)
        rows = store.audit(request_id)
        refused = store.refusals_naming(r.id, bounds.refusals)
    run = None if events is None else read_run_events(events, r.id, r.silo, _window(rows))
    refs = [read_reference(Path(p)) for p in references]
    found = checks(r, rows, run, refs, bounds)
    missing = not_verified(r, rows, run, refs, found)
    reading = _verdict(r, found)
    cert = {
        "format": FORMAT,
        "version": VERSION,
        "request": _request(r, rows, bounds),
        "verdict": reading,
        "outcome": _outcome(r, rows, found, missing, reading),
        "timeline": _timeline(r, rows, run, bounds),
        "model": _model(r, rows),
        "checks": found,
        "not_verified": missing,
        "audit": _audit(rows, bounds),
        "refusals": _refusals(refused, bounds),
        "sources": _sources(store, rows, events, run, refs),
    }
    return _safe(cert)


def _verdict(r: Request, found: list[dict[str, Any]]) -> dict[str, Any]:
    """The certificate's verdict: ``reading`` is ``verified`` or ``not verified`` once the
    request was checked after its relearning window (readings.verdict over every figure of
    ``found``; an ``unverified`` request is never read as verified), else its state
    (``queued``, ``erasing``, ``calibrating``: in progress; ``failed``). ``not_within``: each
    check with figures not within, and those figures."""
    v = verdict(found)
    if r.state in CHECKED:
        reading = NOT_VERIFIED if r.state is State.UNVERIFIED else v["verdict"]
    else:
        reading = r.state.value
    return {
        "reading": reading,
        "verified": reading == "verified",
        "in_progress": r.state in UNFINISHED,
        "not_within": v["not_within"],
        "judged": v["judged"],
        "summary": summary(v),
        "tolerances": asdict(TOLERANCES),
        "rules": "each figure's rule and tolerance are with it (docs/erasure.md, Readings)",
    }


def _window(rows: Sequence[AuditRow]) -> tuple[int, float] | None:
    """The versions whose updates were calibrated for the request: from its boundary to its
    check after the relearning window (``inf`` while not checked); None before the erasure
    was applied."""
    boundary, verified = last(rows, State.CALIBRATING), checked(rows)
    if boundary is None:
        return None
    return boundary.model_version, math.inf if verified is None else verified.model_version


def to_json(cert: dict[str, Any]) -> str:
    """The certificate as JSON text: sorted keys, strict (no NaN), one trailing newline."""
    return json.dumps(cert, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False) + "\n"


def _safe(v: Any) -> Any:
    """``v`` with non-finite floats as None and tuples as lists (strict JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_safe(x) for x in v]
    return v


def _request(r: Request, rows: Sequence[AuditRow], b: Bounds) -> dict[str, Any]:
    digests = sorted(sample_digest(r.id, s) for s in r.sample_ids)
    boundary = last(rows, State.CALIBRATING)
    reported = None if boundary is None else num(boundary.metrics.get("silo_num-samples"))
    return {
        "id": cut(r.id, b.text_chars),
        "silo": r.silo,
        "scope": "whole_silo" if r.whole_silo else "samples",
        "samples": {
            "count": None if r.whole_silo else len(r.sample_ids),
            "forget_set_reported_by_silo": reported,
            "digest": DIGEST,
            "digests": digests[: b.digests],
            "digests_left_out": max(0, len(digests) - b.digests),
        },
        "requester": cut(r.requester, b.text_chars),
        "submitted_at": iso(r.created_at_ms),
        "submitted_at_ms": r.created_at_ms,
        "reason": cut(r.reason, b.text_chars),
        "idempotency_key_given": r.idempotency_key is not None,
        "model_version_at_submit": r.model_version_at_submit,
        "state": r.state.value,
        "failure_reason": cut(r.failure_reason, b.text_chars),
        "boundary_version": None if r.boundary_version < 0 else r.boundary_version,
    }


def _outcome(
    r: Request,
    rows: Sequence[AuditRow],
    found: list[dict[str, Any]],
    missing: list[Any],
    reading: dict[str, Any],
) -> dict[str, Any]:
    what = "the whole silo" if r.whole_silo else f"{len(r.sample_ids)} sample(s)"
    head = (
        f"Erasure request {r.id}, made by {cut(r.requester, 64)} on {iso(r.created_at_ms)}, "
        f"to erase {what} of silo {r.silo}"
    )
    verified, boundary = checked(rows), last(rows, State.CALIBRATING)
    if r.state in CHECKED and verified is not None:
        when = (
            f"the erased model entered the global model at version {r.boundary_version} and "
            f"was checked again at version {verified.model_version}"
        )
        if reading["verified"]:
            text = f"{head}, is verified: every judged figure is within its tolerance; {when}."
        else:
            text = f"{head}, is NOT verified ({reading['summary']}); {when}."
    elif r.state is State.FAILED:
        text = f"{head}, failed: {cut(r.failure_reason, 256)}."
    else:
        text = f"{head}, is {r.state.value}: not verified yet."
    facts = {} if boundary is None else boundary.facts
    if facts.get("model_sha256") and facts.get("model_sha256") == facts.get("model_before_sha256"):
        text += (
            " The erasure changed no weight of the global model (its SHA-256 is the one "
            "before): read the checks for whether the samples were still recognisable."
        )
    ran = sum(1 for c in found if c["ran"])
    text += (
        f" {ran} of {len(found)} checks ran; {len(missing)} things were not verified "
        "(listed in their own section)."
    )
    return {
        "state": r.state.value,
        "reading": reading["reading"],
        "verified": reading["verified"],
        "statement": text,
    }


def _clock(run: RunEvents | None, *states: str) -> float | None:
    """The run-clock time of the request's last ``erasure`` event entering one of
    ``states``."""
    if run is None:
        return None
    times = [num(e.get("t")) for e in run.erasure if e.get("state") in states]
    return times[-1] if times else None


def _step(
    step: str, label: str, row: AuditRow | None, clock_t: float | None, detail: str, b: Bounds
) -> dict[str, Any]:
    return {
        "step": step,
        "label": label,
        "reached": row is not None,
        "at": None if row is None else iso(row.time_ms),
        "time_ms": None if row is None else row.time_ms,
        "model_version": None if row is None else row.model_version,
        "clock_t": clock_t,
        "actor": None if row is None else cut(row.actor, 64),
        "detail": cut(detail if row is not None else "", b.text_chars),
    }


def _timeline(
    r: Request, rows: Sequence[AuditRow], run: RunEvents | None, b: Bounds
) -> list[dict[str, Any]]:
    submit = next((a for a in rows if a.action == "submit"), None)
    starts = transitions(rows, State.ERASING)
    started = starts[-1] if starts else None
    boundary, verified = last(rows, State.CALIBRATING), checked(rows)
    again = f"; started {len(starts)} times (see the audit rows)" if len(starts) > 1 else ""
    cal = _calibration_step(boundary, verified, run)
    steps = [
        _step(
            "requested",
            "Request received and stored",
            submit,
            None,
            f"by {submit.requester}" + (f": {submit.detail}" if submit.detail else "")
            if submit is not None
            else "",
            b,
        ),
        _step(
            "silo_started",
            "The silo started erasing (its training stopped)",
            started,
            _clock(run, "erasing"),
            _detail(started) + again,
            b,
        ),
        *_removal_step(rows, run, b),
        _step(
            "in_global_model",
            "The silo's part in the global model (the erasure boundary)",
            boundary,
            _clock(run, "calibrating"),
            _detail(boundary),
            b,
        ),
        _step("calibration", "Calibration of every later update", boundary, cal[0], cal[1], b),
        _step(
            "checked",
            "Checked again after the relearning window"
            + ("" if verified is None else f": {verified.to_state.value}"),
            verified,
            _clock(run, *CHECKED_EVENTS),
            _detail(verified),
            b,
        ),
    ]
    failed = last(rows, State.FAILED)
    if failed is not None:
        steps.append(_step("failed", "Failed", failed, _clock(run, "failed"), failed.detail, b))
    return steps


def _removal_step(
    rows: Sequence[AuditRow], run: RunEvents | None, b: Bounds
) -> list[dict[str, Any]]:
    """The server's removal of what persists of the silo's work, in force at the request
    (before the silo's reply), when there was one: its audit note; none otherwise."""
    notes = [a for a in rows if a.action == "note" and a.detail.startswith(REMOVAL_NOTE)]
    if not notes:
        return []
    row = notes[-1]  # (the last says how much of it is in force: steps follow a bounded one)
    label = "The server's removal of the silo's work in the global model (at the request)"
    if len(notes) > 1:
        label = (
            "The server's removal of the silo's work in the global model (at the request, "
            "the rest in steps after it)"
        )
    clock = _clock(run, "removed", "removed_more")
    return [_step("server_removal", label, row, clock, row.detail, b)]


def _detail(row: AuditRow | None) -> str:
    return "" if row is None else row.detail


def _calibration_step(
    boundary: AuditRow | None, verified: AuditRow | None, run: RunEvents | None
) -> tuple[float | None, str]:
    """The calibration step's run-clock time (the first update calibrated) and its detail."""
    if boundary is None:
        return None, ""
    facts = boundary.facts
    held = (
        f"lab.erasure.protect={facts['calibration_protect']}, "
        f"calibration_target={facts.get('calibration_target', '?')}"
        if "calibration_protect" in facts
        else "settings not recorded"
    )
    text = f"from version {boundary.model_version}, every accepted update is calibrated ({held})"
    if run is None:
        return None, text + "; the event log was not read"
    calibrated = run.calibrated
    until = "verification" if verified is not None else "now"
    text += f"; {len(calibrated)} update(s) calibrated before {until}"
    return (min(t for t, _ in calibrated) if calibrated else None), text


def _model(r: Request, rows: Sequence[AuditRow]) -> dict[str, Any]:
    boundary, verified = last(rows, State.CALIBRATING), checked(rows)

    def at(version: object, sha: str | None) -> dict[str, Any] | None:
        if sha is None:
            return None
        return {"version": int(str(version)), "sha256": cut(sha, 64)}

    facts = {} if boundary is None else boundary.facts
    before, after = facts.get("model_before_sha256"), facts.get("model_sha256")
    return {
        "changed": None if before is None or after is None else before != after,
        "hash": (
            "SHA-256 of the global model's named tensors, sorted by name, each fed as name, "
            "dtype, shape and bytes (server/unlearning/attest.py model_sha256); a MONAI "
            "bundle of the same version gives it as fedasync.weights_sha256"
        ),
        "version_at_submit": r.model_version_at_submit,
        "before": at(facts.get("model_before_version", -1), facts.get("model_before_sha256")),
        "after": at(
            None if boundary is None else boundary.model_version, facts.get("model_sha256")
        ),
        "checked": (
            None
            if verified is None
            else at(verified.model_version, verified.facts.get("model_sha256"))
        ),
    }


def _audit_row(a: AuditRow, b: Bounds) -> dict[str, Any]:
    metrics = dict(sorted(a.metrics.items())[: b.metrics])
    return {
        "seq": a.seq,
        "at": iso(a.time_ms),
        "time_ms": a.time_ms,
        "actor": cut(a.actor, 64),
        "requester": cut(a.requester, 64),
        "action": cut(a.action, 32),
        "from_state": None if a.from_state is None else a.from_state.value,
        "to_state": a.to_state.value,
        "model_version": a.model_version,
        "detail": cut(a.detail, b.text_chars),
        "metrics": {cut(k, 64): num(v) for k, v in metrics.items()},
        "metrics_left_out": max(0, len(a.metrics) - b.metrics),
        "facts": {cut(k, 64): cut(v, 128) for k, v in sorted(a.facts.items())[: b.metrics]},
    }


def _audit(rows: Sequence[AuditRow], b: Bounds) -> dict[str, Any]:
    keep = list(rows)
    left_out = max(0, len(keep) - b.audit_rows)
    if left_out:
        half = b.audit_rows // 2
        keep = keep[:half] + keep[len(keep) - (b.audit_rows - half) :]
    return {
        "rows": [_audit_row(a, b) for a in keep],
        "total": len(rows),
        "left_out": left_out,
        "note": "append-only: the store refuses to change or delete an audit row",
    }


def _refusals(rows: Sequence[Refusal], b: Bounds) -> dict[str, Any]:
    return {
        "rows": [
            {
                "at": iso(x.time_ms),
                "time_ms": x.time_ms,
                "who": cut(x.who, 64),
                "peer": cut(x.peer, 128),
                "method": cut(x.method, 128),
                "code": cut(x.code, 32),
                "reason": cut(x.reason, b.text_chars),
            }
            for x in rows
        ],
        "note": (
            f"refused calls to the erasure service whose reason names this request, newest "
            f"first (at most {b.refusals}); the store keeps the newest {REFUSALS_KEPT} refused "
            "calls of all requests, and a call refused before its request id was read "
            "(no valid token) names none"
        ),
    }


def _sources(
    store: ErasureStore,
    rows: Sequence[AuditRow],
    events: Path | None,
    run: RunEvents | None,
    refs: Sequence[Any],
) -> dict[str, Any]:
    return {
        "store": {
            "file": Path(store.path).name,
            "audit_rows": len(rows),
            "last_seq": max((a.seq for a in rows), default=0),
        },
        "event_log": None
        if events is None or run is None
        else {"file": Path(events).name, "sha256": run.sha256, "clock": run.clock},
        "references": [{"run": cut(x.name, 128), "sha256": x.sha256} for x in refs],
    }
