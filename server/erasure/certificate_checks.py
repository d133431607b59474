"""The checks of an erasure certificate: every figure the system has for one request, each
beside its reference, and every check that did not run for it, with why.

What exists (docs/erasure.md) and where it is stored:

- at the erasure boundary, the server's verification of the model just after the erasure
  (forget-set score, membership-inference AUC, backdoor success, the global test score
  before and after): the metrics of the store's ``calibrating`` audit row;
- distance to retraining, per forgetting metric, against retraining's noise floor: only
  where retraining reference runs are given (offline; their ``bd_*`` evaluations);
- the silo's own membership test (``unlearning.stop=membership``): the ``silo_*`` metrics
  the silo reported, in the same row;
- the bound on the erasure's delta (``delta_norm`` as sent, ``delta_bound``, ``clip_factor``
  when clipped): the same row; the delta applied is judged against the bound, a clip shown;
- the calibration in force (the row's facts) and the overlap of each later update with the
  erased data's signature subspace (``calibration_overlap`` of ``update`` events);
- resurfacing: the checks between the boundary and verification (``erasure_watch``
  events, ``lab.erasure.watch_every``) and the verification after the relearning window (the
  ``verified`` row), with the reversion ratio toward the pre-erasure model;
- what the server did with the silo's work (cancelled jobs, updates refused or taken).

What did not run, and why, is certificate_gaps.py's.

Every figure carries its reading (readings.py): ``within`` or ``not within`` its reference
by the rule and tolerance it states, or ``informational`` where no rule makes sense (a count,
a setting, a reading before the erasure). ``server_checks`` are the checks the training
server has when the relearning window ends; the lifecycle reads the same figures with the
same ``readings.verdict`` to move a request to ``verified`` or ``unverified``.

One file (over 500 lines) because it is one thing: the certificate's checks in their fixed
order, each built from the same figure and reading helpers on the same store rows and run
events, and the server's own subset of them (``server_checks``) that the lifecycle's verdict
reads, so that the certificate and the lifecycle can never judge a figure two ways.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from server.erasure.readings import (
    INFORMATIONAL,
    TOLERANCES,
    Tolerances,
    around,
    at_least,
    at_most,
    informational,
    score_band,
    within,
)
from server.erasure.states import CHECKED, State

if TYPE_CHECKING:
    from server.erasure.certificate_events import Reference, RunEvents
    from server.erasure.limits import Bounds
    from server.erasure.records import AuditRow, Request

MIN_BAND = 0.01
"""A retraining noise floor under 0.01 counts as 0.01 (benchmarks/unlearning_vs_retrain.py)."""
FORGETTING = ("forget_accuracy", "mia_auc", "asr")
SUBSPACE = ("subspace", "both")
"""``lab.erasure.protect`` values whose calibration measures each update's overlap."""

_BOUNDARY = (
    (
        "forget_accuracy",
        "Score on the erased samples (forget set)",
        "test_accuracy",
        "the same model's score on unseen test data",
    ),
    (
        "mia_auc",
        "Membership-inference AUC, erased samples against unseen data",
        0.5,
        "0.5: an attacker cannot tell them from data the model never saw",
    ),
    (
        "asr",
        "Backdoor attack success rate (the erased silo's trigger)",
        "asr_without_trigger",
        "the same images without the trigger",
    ),
    (
        "score_after",
        "Global test score just after the boundary",
        "score_before",
        "just before the boundary",
    ),
)


def num(v: object) -> float | None:
    """``v`` as a finite float, or None (not a number, NaN, infinite)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(float(v)) else None


def transitions(rows: Sequence[AuditRow], to: State) -> list[AuditRow]:
    """The audit rows that moved the request into ``to``, in order."""
    return [a for a in rows if a.action == "transition" and a.to_state is to]


def last(rows: Sequence[AuditRow], to: State) -> AuditRow | None:
    """The last audit row that moved the request into ``to`` (None: never)."""
    found = transitions(rows, to)
    return found[-1] if found else None


def checked(rows: Sequence[AuditRow]) -> AuditRow | None:
    """The audit row that ended the relearning window (into ``verified`` or ``unverified``,
    whichever the checks then read; None: not checked yet)."""
    found = [a for a in rows if a.action == "transition" and a.to_state in CHECKED]
    return found[-1] if found else None


def figure(
    name: str,
    label: str,
    value: object,
    reference: object = None,
    reference_label: str = "",
    *,
    reading: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """One figure: its value, its reference and what the reference is, and its reading
    (``verdict``, ``rule``, ``tolerance``; readings.py)."""
    v, ref = num(value), num(reference)
    diff = None if v is None or ref is None else v - ref
    return {
        "name": name,
        "label": label,
        "value": v,
        "reference": ref,
        "reference_label": reference_label,
        "difference": diff,
        **reading,
        **extra,
    }


def check(
    cid: str, title: str, source: str, figures: list[dict[str, Any]], **kw: Any
) -> dict[str, Any]:
    """One check: ``ran`` when it has a figure; ``notes`` say what to keep in mind."""
    return {
        "id": cid,
        "title": title,
        "source": source,
        "ran": bool(figures),
        "figures": figures,
        "notes": list(kw.get("notes", [])),
        **{k: v for k, v in kw.items() if k != "notes"},
    }


def checks(
    r: Request,
    rows: Sequence[AuditRow],
    run: RunEvents | None,
    refs: Sequence[Reference],
    b: Bounds,
    tol: Tolerances = TOLERANCES,
) -> list[dict[str, Any]]:
    """Every check a certificate reports, in a fixed order (ran or not)."""
    boundary, verified = last(rows, State.CALIBRATING), checked(rows)
    at_b = {} if boundary is None else boundary.metrics
    after = {} if verified is None else verified.metrics
    return [
        _at_boundary(at_b, tol),
        _retraining(at_b, after, run, refs),
        _membership(at_b, r.whole_silo),
        _bound(at_b, tol),
        _calibration(boundary, at_b, run),
        _resurfacing(at_b, after, verified, run, b, tol),
        _silo_work(r, boundary, run, b, tol),
    ]


def server_checks(
    at_b: dict[str, float],
    after: dict[str, float],
    whole_silo: bool,
    tol: Tolerances = TOLERANCES,
) -> list[dict[str, Any]]:
    """The checks the training server has itself when a request's relearning window ends:
    the boundary's metrics ``at_b`` (its calibrating row), the silo's membership test and the
    delta bound in them, and the metrics ``after`` the window. The lifecycle reads their
    verdict (``readings.verdict``); a certificate shows the same figures among its checks."""
    return [
        _at_boundary(at_b, tol),
        _membership(at_b, whole_silo),
        _bound(at_b, tol),
        _resurfacing(at_b, after, None, None, None, tol),
    ]


MIA_UNJUDGED = (
    "not judged: its non-members are the global test set, not the silo's own unseen data, so "
    "a gap between the silo's data and the test set reads as membership (a retrained model "
    "shows it too); membership is judged by the silo's own test, and against retraining "
    "when reference runs are given"
)
DIP_UNJUDGED = (
    "not judged here: removing a silo's data may cost score at once, as retraining without it "
    "does; the score must come back by verification (score_recovered)"
)


def _boundary_reading(
    key: str, m: dict[str, float], v: object, ref: object, tol: Tolerances
) -> dict[str, Any]:
    """The reading of one forgetting figure (or ``score_after``) of metrics ``m``: the
    forget-set score's and the membership AUC's tolerances follow their noise at ``m``'s
    sample counts when it has them (readings.score_band)."""
    value, reference = num(v), num(ref)
    if key == "forget_accuracy":
        t, source, where = score_band(m, value, reference, tol)
        rule = f"value <= reference + tolerance ({where})"
        return _source(at_most(value, reference, t, rule), source)
    if key == "mia_auc":
        return informational(MIA_UNJUDGED)
    if key == "asr":
        return at_most(value, reference, tol.asr, "value <= reference + tolerance")
    return informational(DIP_UNJUDGED)  # score_after: the score must come back (resurfacing)


def _source(reading: dict[str, Any], source: str) -> dict[str, Any]:
    """``reading`` with where its tolerance came from (``tolerance_from``: ``noise``,
    ``floor`` or ``fixed``; readings.py), when it was judged."""
    return reading if reading["verdict"] == INFORMATIONAL else {**reading, "tolerance_from": source}


def _at_boundary(m: dict[str, float], tol: Tolerances) -> dict[str, Any]:
    figures = []
    for key, label, ref, ref_label in _BOUNDARY:
        if key in m:
            ref_value = m.get(ref) if isinstance(ref, str) else ref
            reading = _boundary_reading(key, m, m[key], ref_value, tol)
            figures.append(figure(key, label, m[key], ref_value, ref_label, reading=reading))
    if "boundary_dip" in m:
        figures.append(
            figure(
                "boundary_dip",
                "Dip of the global test score at the boundary",
                m["boundary_dip"],
                0.0,
                "no dip (positive: a drop)",
                reading=informational(DIP_UNJUDGED),
            )
        )
    return check(
        "at_boundary",
        "Forgetting at the erasure boundary",
        "erasure store: the calibrating audit row's metrics",
        figures,
        notes=["measured by the server on the model just after the erasure"],
    )


def _retraining(
    at_b: dict[str, float],
    after: dict[str, float],
    run: RunEvents | None,
    refs: Sequence[Reference],
) -> dict[str, Any]:
    figures: list[dict[str, Any]] = []
    if refs and run is not None:
        moments = (("boundary", at_b, ("calibrating",)), ("verified", after, CHECKED_EVENTS))
        for moment, metrics, states in moments:
            times = [num(e.get("t")) for e in run.erasure if e.get("state") in states]
            t = times[-1] if times else None
            for key in FORGETTING:
                if t is None or num(metrics.get(key)) is None:
                    continue
                fig = _against_retraining(key, moment, metrics[key], t, refs)
                if fig is not None:
                    figures.append(fig)
    return check(
        "retraining",
        "Distance to retraining, against retraining's noise floor",
        "the event log's boundary time and the reference runs' evaluations",
        figures,
        references=len(refs),
        notes=[
            "within: |value - retraining| <= the noise floor (how far retrainings on "
            f"different seeds land apart; at least {MIN_BAND}); not within above: "
            "under-erased; not within below: over-erased"
        ]
        if figures
        else [],
    )


CHECKED_EVENTS = ("verified", "unverified")
"""The ``erasure`` events of a request checked after its relearning window."""


def _against_retraining(
    key: str,
    moment: str,
    value: float,
    t: float,
    refs: Sequence[Reference],
) -> dict[str, Any] | None:
    """``value`` against the retrainings' mean at ``t``; the noise floor is their spread at
    that same moment (the mean pairwise gap), so the boundary's and the verification's
    figures each get their own."""
    values = [v for v in (x.at(key, t) for x in refs) if v is not None]
    if not values:
        return None
    mean = sum(values) / len(values)
    pairs = [abs(a - c) for i, a in enumerate(values) for c in values[i + 1 :]]
    floor = sum(pairs) / len(pairs) if pairs else None
    band = max(floor or 0.0, MIN_BAND)
    return figure(
        f"{key}@{moment}",
        f"{key} at the {moment} against retraining",
        value,
        mean,
        f"retraining ({len(values)} run(s)) at t={t:.1f}",
        reading=around(
            num(value), mean, band, "|value - reference| <= tolerance (the noise floor)"
        ),
        noise_floor=floor,
        band=band,
    )


def _membership(m: dict[str, float], whole_silo: bool) -> dict[str, Any]:
    figures = []
    band = num(m.get("silo_auc_band"))
    if "silo_auc" in m:
        if "silo_auc_before" in m:
            figures.append(
                figure(
                    "silo_auc_before",
                    "AUC before erasing",
                    m["silo_auc_before"],
                    0.5,
                    "0.5: forget samples look like the silo's held-out samples",
                    reading=informational("the reading before the erasure: what it started from"),
                )
            )
        if band is not None:
            reading = around(
                num(m["silo_auc"]), 0.5, band, "|value - 0.5| <= tolerance (the test's band)"
            )
        else:  # (a band not reported: the silo's own verdict)
            indist = num(m.get("silo_indistinguishable")) == 1.0
            over = num(m.get("silo_overshoot")) == 1.0
            reading = within(
                indist, "the silo's test found them indistinguishable", None,
                "below" if over else "above",
            )  # fmt: skip
        figures.append(
            figure(
                "silo_auc",
                "AUC when the silo stopped",
                m["silo_auc"],
                0.5,
                "0.5 ± the test's band",
                reading=reading,
                band=band,
            )
        )
        for key, label in (
            ("silo_steps", "Erasure steps taken"),
            ("silo_readings", "Readings taken"),
            ("silo_compared", "Samples compared (forget + held-out)"),
        ):
            if key in m:
                figures.append(
                    figure(key, label, m[key], reading=informational("a count: no rule"))
                )
    notes = []
    if figures and whole_silo:
        notes.append(
            "a whole silo's influence also lives in its distribution (its site, a trigger on "
            "all its samples), which shows on its held-out samples too: this test cannot see "
            "it (docs/erasure.md); the server's removal and the checks above stand for it"
        )
    return check(
        "silo_membership",
        "The silo's own membership test",
        "erasure store: the metrics the silo reported (silo_*)",
        figures,
        notes=notes,
    )


def _bound(m: dict[str, float], tol: Tolerances) -> dict[str, Any]:
    """The bound on the silo's delta. The server clips a delta above its bound to it
    (bounds.py), so the applied delta is within its bound by construction: that is the
    judged figure; the delta as sent and how much of it was applied are shown beside it. A
    clip is the bound doing its job, not a verdict on the erasure (the forgetting checks
    give that)."""
    figures, notes = [], []
    sent, bound = num(m.get("delta_norm")), num(m.get("delta_bound"))
    if sent is not None and bound is not None:
        factor = num(m.get("clip_factor"))
        applied = sent * (1.0 if factor is None else factor)
        figures += [
            figure(
                "delta_applied",
                "Norm of the erasure delta applied",
                applied,
                bound,
                "its bound",
                reading=at_most(
                    applied,
                    bound,
                    bound * tol.delta,
                    "value <= reference + tolerance (a delta above its bound is clipped to it; "
                    "the tolerance is float rounding)",
                ),
            ),
            figure(
                "delta_norm",
                "Norm of the silo's erasure delta, as sent",
                sent,
                bound,
                "its bound (larger is clipped to it)",
                reading=informational(
                    "what the silo sent: above its bound it was clipped, and the applied "
                    "delta is judged"
                ),
            ),
        ]
        if factor is not None:
            figures.append(
                figure(
                    "clip_factor",
                    "Share of the sent delta applied (clipped)",
                    factor,
                    1.0,
                    "1: all of it (not clipped)",
                    reading=informational(
                        "how much of the sent delta the bound let through: the bound doing its "
                        "job; the forgetting checks judge whether the erasure worked"
                    ),
                )
            )
            notes.append(
                f"the silo's delta (norm {sent:.4g}) was clipped to its bound ({bound:.4g}): "
                f"{factor:.1%} of it was applied; whether the erasure worked is judged by the "
                "forgetting checks, not by the clip"
            )
    return check(
        "bound",
        "The erasure's size is bounded",
        "erasure store: the calibrating audit row's metrics",
        figures,
        notes=notes,
    )


def _calibration(
    boundary: AuditRow | None,
    m: dict[str, float],
    run: RunEvents | None,
) -> dict[str, Any]:
    figures = []
    facts = {} if boundary is None else boundary.facts
    laps = [] if run is None or boundary is None else run.overlaps
    projected = informational(
        "what was projected out of later updates: no rule says how much is too much; "
        "resurfacing judges the outcome"
    )
    if laps:
        figures += [
            figure(
                "overlap_mean",
                "Mean share of a later update's norm in the erased data's subspace",
                sum(laps) / len(laps),
                0.0,
                "0: none of it (that part is projected out)",
                reading=projected,
                count=len(laps),
            ),
            figure(
                "overlap_max",
                "Largest share of one update's norm in it",
                max(laps),
                0.0,
                "0: none",
                reading=projected,
            ),
        ]
    if "signature_shared" in m:
        figures.append(
            figure(
                "signature_shared",
                "Share of the signature other silos' updates span",
                m["signature_shared"],
                0.0,
                "0: all of it unique to the erased data",
                reading=informational(
                    "what the calibration keeps of other silos' learning: a cost, not a residue"
                ),
            )
        )
    if "forget_gradient" in m:
        figures.append(
            figure(
                "forget_gradient",
                "The silo sent its forget gradient",
                m["forget_gradient"],
                1.0,
                "1: sent (protect=gradient or onesided)",
                reading=informational(
                    "without it the one-sided calibration protects nothing; resurfacing "
                    "judges the outcome"
                ),
            )
        )
    settings = {k: v for k, v in sorted(facts.items()) if k.startswith("calibration_")}
    return check(
        "calibration",
        "Calibration of later updates",
        "the calibrating audit row's facts; update events' calibration_overlap",
        figures,
        settings=settings,
        notes=["with several erasures the signature is merged: an overlap is against all of them"]
        if figures
        else [],
    )


def _resurfacing(
    at_b: dict[str, float],
    after: dict[str, float],
    verified: AuditRow | None,
    run: RunEvents | None,
    b: Bounds | None,
    tol: Tolerances,
) -> dict[str, Any]:
    figures = []
    for key, label, ref, ref_label in _BOUNDARY[:3]:  # the forgetting metrics, read as there
        if key in after:
            ref_value = after.get(ref) if isinstance(ref, str) else ref
            figures.append(
                figure(
                    key,
                    f"{label}, at verification",
                    after[key],
                    ref_value,
                    f"{ref_label}, at verification" if isinstance(ref, str) else ref_label,
                    reading=_boundary_reading(key, after, after[key], ref_value, tol),
                    at_boundary=num(at_b.get(key)),
                )
            )
    if "test_accuracy" in after:
        figures.append(
            figure(
                "test_accuracy",
                "Global test score at verification",
                after["test_accuracy"],
                at_b.get("test_accuracy"),
                "at the boundary",
                reading=informational("the model's own score over the window: training goes on"),
                at_boundary=num(at_b.get("test_accuracy")),
            )
        )
    if num(after.get("score")) is not None:
        figures.append(
            figure(
                "score_recovered",
                "Global test score at verification, against just before the erasure",
                after["score"],
                at_b.get("score_before"),
                "just before the erasure (the server's removal, when there was one)",
                reading=at_least(
                    num(after["score"]),
                    num(at_b.get("score_before")),
                    tol.dip,
                    "value >= reference - tolerance",
                ),
            )
        )
    if num(after.get("reversion_ratio")) is not None:
        figures.append(
            figure(
                "reversion_ratio",
                "Reversion toward the pre-erasure model",
                after["reversion_ratio"],
                0.0,
                "0: none; 1: all the way back",
                reading=at_most(
                    num(after["reversion_ratio"]), 0.0, tol.reversion, "value <= tolerance"
                ),
            )
        )
    points = []
    if run is not None and b is not None:
        for w in run.watch[: b.points]:
            keys = (*FORGETTING, "test_accuracy", "reversion_ratio")
            points.append(
                {
                    "since_boundary": w.get("since_boundary"),
                    "version": w.get("version"),
                    "t": num(w.get("t")),
                    **{k: num(w.get(k)) for k in keys if k in w},
                }
            )
    left_out = 0 if run is None or b is None else max(0, len(run.watch) - b.points)
    return check(
        "resurfacing",
        "Resurfacing: checks after the boundary",
        "erasure store: the verified (or unverified) audit row's metrics; erasure_watch events",
        figures,
        points=points,
        points_left_out=left_out,
        verified_version=None if verified is None else verified.model_version,
    )


def _silo_work(
    r: Request, boundary: AuditRow | None, run: RunEvents | None, b: Bounds, tol: Tolerances
) -> dict[str, Any]:
    figures = []
    if run is not None:
        count = informational("a count of what the server did: no rule")
        figures += [
            figure(
                "jobs_cancelled",
                "Training jobs of the silo cancelled for the erasure",
                len(run.cancelled),
                reading=count,
            ),
            figure(
                "replies_discarded",
                "Replies of cancelled jobs dropped",
                run.discarded,
                reading=count,
            ),
            figure(
                "refused_erased",
                "Updates of the silo refused as erased",
                run.refused_erased,
                reading=count,
            ),
        ]
        if boundary is not None:
            figures.append(
                figure(
                    "silo_updates_after",
                    "Updates of the silo taken after the boundary",
                    run.silo_after,
                    0.0 if r.whole_silo else None,
                    "none: the silo is retired"
                    if r.whole_silo
                    else "the silo trains on without the erased samples",
                    reading=at_most(
                        float(run.silo_after), 0.0, tol.silo_updates, "value <= tolerance"
                    )
                    if r.whole_silo
                    else informational("the silo trains on without the erased samples"),
                )
            )
    return check(
        "silo_work",
        "What the server did with the silo's work",
        "event log: job_cancelled, reply_discarded, reject, update",
        figures,
        cancelled=[] if run is None else [_job(j) for j in run.cancelled[: b.points]],
    )


def _job(e: dict[str, Any]) -> dict[str, Any]:
    return {
        "job": e.get("job"),
        "t": num(e.get("t")),
        "would_finish_at": num(e.get("would_finish_at")),
    }
