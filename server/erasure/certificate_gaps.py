"""What an erasure certificate says was NOT verified for one request, and why, in plain words.

Every check of certificate_checks.py that did not run (or ran in part) for the request has an
entry, with the reason the system knows: the request is not that far yet, the run had no
backdoor, the server holds no silo data (a deployment), the silo took fixed steps, no
retraining reference was given, the calibration measures no overlap one-sidedly, no event log
was read. Three entries are always there, as they are outside what fedasync can check: the
benchmarks' shadow-model measures, the deletion of the records at the hospital, and models
released before the boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from server.erasure.certificate_checks import MIN_BAND, SUBSPACE, checked, last, num
from server.erasure.states import CHECKED, ENDED_UNCHECKED, State

if TYPE_CHECKING:
    from server.erasure.certificate_events import Reference, RunEvents
    from server.erasure.records import AuditRow, Request

Miss = Callable[[str, str], None]
"""``miss(what, why)``: note one thing that was not verified."""


def not_verified(
    r: Request,
    rows: Sequence[AuditRow],
    run: RunEvents | None,
    refs: Sequence[Reference],
    found: list[dict[str, Any]],
) -> list[dict[str, str]]:
    """Every check that did not run for this request, and why (plain words)."""
    out: list[dict[str, str]] = []

    def miss(what: str, why: str) -> None:
        out.append({"check": what, "why": why})

    boundary, verified = last(rows, State.CALIBRATING), checked(rows)
    m = {} if boundary is None else boundary.metrics
    facts = ({} if boundary is None else boundary.facts) | _erasing_facts(rows)
    ran = {c["id"]: c["ran"] for c in found}
    if boundary is None:
        miss("the erasure itself", f"the request is {r.state.value}: no erased model is in force")
    else:
        _boundary_gaps(m, miss)
    ended = [a for a in rows if a.action == "note" and a.detail.startswith(ENDED_UNCHECKED)]
    if r.state not in CHECKED and ended and r.state is State.CALIBRATING:
        miss("the relearning check", ended[-1].detail)
    elif r.state not in CHECKED:
        miss(
            "the relearning check",
            f"the request is {r.state.value}: it is verified "
            f"{facts.get('relearn_versions', 'lab.erasure.relearn_versions')} versions after "
            "the boundary",
        )
    _retraining_gaps(refs, run, ran, miss)
    if boundary is not None and not ran["silo_membership"]:
        miss("the silo's membership test", _why_no_membership(facts))
    if boundary is not None and not ran["bound"]:
        miss("the bound on the erasure's delta", "no delta bound recorded (FedEraser rebuilds)")
    _calibration_gaps(boundary, facts, run, found, miss)
    _resurfacing_gaps(boundary, verified, run, miss)
    if boundary is not None and "model_sha256" not in boundary.facts:
        miss(
            "the global model's SHA-256 before and after",
            "not recorded for this request: applied by an older fedasync, or finished after a "
            "server restart",
        )
    if run is None:
        miss(
            "the run's clock times and the silo's work",
            "no event log was read (the run's metrics.jsonl)",
        )
    miss(
        "per-example membership inference with shadow models (U-LiRA), output divergence and "
        "the Anamnesis index",
        "benchmark measures against retrained models (fedasync/erasure_metrics.py), not run by "
        "the server for a request",
    )
    miss(
        "deletion of the records at the silo",
        "fedasync removes the data's influence from the federated model; the hospital's own "
        "copies of the records are for its own process",
    )
    miss(
        "models released before the boundary",
        "models of earlier versions that silos, checkpoints or exports hold still carry the "
        "data; this certificate covers the global model from the boundary on",
    )
    return out


def _erasing_facts(rows: Sequence[AuditRow]) -> dict[str, str]:
    started = last(rows, State.ERASING)
    return {} if started is None else dict(started.facts)


def _boundary_gaps(m: dict[str, float], miss: Miss) -> None:
    if "forget_accuracy" not in m or "mia_auc" not in m:
        miss(
            "forget-set score and membership-inference AUC on the server",
            "the server holds none of the silo's data (a deployment): it cannot measure the "
            "erased samples; the silo's own membership test stands for it",
        )
    if "asr" not in m:
        miss(
            "backdoor attack success rate",
            "measured only in verification runs whose silo carries a trigger (backdoor.*)",
        )


def _retraining_gaps(
    refs: Sequence[Reference], run: RunEvents | None, ran: dict[str, bool], miss: Miss
) -> None:
    if not refs:
        miss(
            "distance to retraining",
            "no retraining reference run was given: a run of the same config without the "
            "erased data (lab.exclude or lab.exclude_samples, lab.backdoor.watch=true), named "
            "with --reference when the certificate is built offline",
        )
    elif run is None:
        miss("distance to retraining", "the boundary's run-clock time is in the event log")
    elif not ran["retraining"]:
        miss("distance to retraining", "the reference runs have no bd_* evaluations to compare")
    elif len(refs) < 2:
        miss(
            "retraining's noise floor",
            f"one reference run: the floor needs two seeds, so the band is {MIN_BAND}",
        )


def _why_no_membership(facts: dict[str, str]) -> str:
    method, stop = facts.get("erasure_method"), facts.get("erasure_stop")
    if method == "federaser":
        return "FedEraser rebuilds the model on the server; the silo runs no test"
    if method == "relabel":
        return "relabelling (unlearning.method=relabel) takes fixed steps, with no test"
    if stop == "fixed":
        return "unlearning.stop=fixed: the silo took fixed steps, with no test"
    return "the silo reported none (no held-out samples: a datalist without a validation list)"


def _calibration_gaps(
    boundary: AuditRow | None,
    facts: dict[str, str],
    run: RunEvents | None,
    found: list[dict[str, Any]],
    miss: Miss,
) -> None:
    if boundary is None:
        return
    cal = next(c for c in found if c["id"] == "calibration")
    measured = any(f["name"] == "overlap_mean" for f in cal["figures"])
    if measured:
        return
    protect = facts.get("calibration_protect")
    if run is None:
        why = "no event log was read"
    elif protect is not None and protect not in SUBSPACE:
        why = (
            f"measured only against a signature subspace (lab.erasure.protect=subspace or "
            f"both); this calibration is protect={protect}, one-sided"
        )
    elif not run.calibrated:
        why = "no update was calibrated between the boundary and verification"
    else:
        why = (
            "no calibrated update carries an overlap: it is measured only against a signature "
            "subspace (lab.erasure.protect=subspace or both)"
        )
    miss("calibration overlap of later updates", why)


def _resurfacing_gaps(
    boundary: AuditRow | None, verified: AuditRow | None, run: RunEvents | None, miss: Miss
) -> None:
    if run is not None and not run.watch:
        miss(
            "checks between the boundary and verification",
            "none were asked for (lab.erasure.watch_every=0)",
        )
    if verified is not None and num(verified.metrics.get("reversion_ratio")) is None:
        facts = {} if boundary is None else boundary.facts
        before, after = facts.get("model_before_sha256"), facts.get("model_sha256")
        if before is not None and before == after:
            why = (
                "not defined: the erasure did not move the model (the same SHA-256 before "
                "and after)"
            )
        elif before is not None:
            why = (
                "not reported: verified after a server restart (the models around the "
                "boundary are not checkpointed)"
            )
        else:
            why = (
                "not defined or not reported: the erasure did not move the model, or it was "
                "verified after a server restart (the models around the boundary are not "
                "checkpointed)"
            )
        miss("reversion toward the pre-erasure model", why)
