"""How each figure of an erasure check is read, and the verdict over all of them.

Every figure of a certificate (certificate_checks.py) carries a reading:

- ``within``: its rule holds (the figure is within its reference, by at most its tolerance);
- ``not within``: its rule does not hold (``side`` says whether it is above or below);
- ``informational``: no rule makes sense for it (a count, a setting, a reading before the
  erasure); it is shown, never judged.

Each judged figure also carries its ``rule`` (in words, e.g. ``value <= reference +
tolerance``) and its ``tolerance``. The tolerances live here, once (``Tolerances``).

``verdict(checks)`` reads them all: ``verified`` when at least one figure was judged and every
judged figure is within, else ``not verified`` with the checks (and their figures) not within.
The certificate's top line and the lifecycle's ``calibrating -> verified | unverified`` both
use it (server/unlearning/lifecycle.py), on the same figures, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WITHIN = "within"
NOT_WITHIN = "not within"
INFORMATIONAL = "informational"
READINGS = (WITHIN, NOT_WITHIN, INFORMATIONAL)
"""The only words a figure's ``verdict`` takes."""

VERIFIED = "verified"
NOT_VERIFIED = "not verified"


@dataclass(frozen=True)
class Tolerances:
    """How far a figure may lie from its reference and still be within it. Scores, rates and
    AUCs are fractions in [0, 1]."""

    score: float = 0.05
    """The forget-set score above the same model's unseen-test score (at the boundary and at
    verification). A model retrained without the samples scores them like unseen data; an
    accuracy over about a hundred samples has a standard deviation near 0.05, so a smaller
    excess is not evidence of memory, a larger one is."""
    mia_auc: float = 0.1
    """|membership-inference AUC - 0.5|, both sides: above is under-erasure (the samples are
    still recognised), below is over-erasure, which an attacker detects as well (the
    Streisand effect). 0.1 is about two null standard deviations of an AUC over 50 against
    50 samples (sqrt(101 / (12 * 50 * 50)) = 0.058)."""
    asr: float = 0.05
    """The backdoor's attack success rate above the same images' rate without the trigger:
    what the trigger still adds. 0.05, as for a score (a rate over about a hundred images)."""
    dip: float = 0.1
    """The global test score's drop at the boundary (``boundary_dip``, and ``score_after``
    below ``score_before``). Erasing removes the data's own contribution, so some drop is
    expected; a drop above 0.1 in one version is damage to the model to be flagged."""
    reversion: float = 0.5
    """The reversion ratio toward the pre-erasure model at verification: 0 none, 1 all the
    way back. Past half-way the erased model has mostly come back."""
    delta: float = 0.0
    """The silo's erasure delta above its bound (``delta_norm - delta_bound``). The bound has
    its float slack already (bounds.py); a delta above it was clipped, so less than the
    erasure the silo computed was applied."""
    silo_updates: float = 0.0
    """Updates of a retired (whole-silo erased) silo taken after the boundary: none."""


TOLERANCES = Tolerances()


def within(ok: bool, rule: str, tolerance: float | None, side: str | None = None) -> dict[str, Any]:
    """A judged figure's reading: ``within`` when ``ok``, else ``not within`` (on ``side``)."""
    out: dict[str, Any] = {
        "verdict": WITHIN if ok else NOT_WITHIN,
        "rule": rule,
        "tolerance": tolerance,
    }
    if not ok and side is not None:
        out["side"] = side
    return out


def informational(why: str) -> dict[str, Any]:
    """The reading of a figure no rule judges, with why."""
    return {"verdict": INFORMATIONAL, "rule": why, "tolerance": None}


def at_most(
    value: float | None, limit: float | None, tolerance: float, rule: str
) -> dict[str, Any]:
    """``value <= limit + tolerance`` (one-sided: only above is not within). A figure with no
    value or no limit cannot be judged: it is informational, saying so."""
    if value is None or limit is None:
        return informational(f"not judged: no {'value' if value is None else 'reference'}")
    return within(value <= limit + tolerance, rule, tolerance, "above")


def at_least(
    value: float | None, limit: float | None, tolerance: float, rule: str
) -> dict[str, Any]:
    """``value >= limit - tolerance`` (one-sided: only below is not within)."""
    if value is None or limit is None:
        return informational(f"not judged: no {'value' if value is None else 'reference'}")
    return within(value >= limit - tolerance, rule, tolerance, "below")


def around(value: float | None, centre: float, tolerance: float, rule: str) -> dict[str, Any]:
    """``|value - centre| <= tolerance`` (two-sided)."""
    if value is None:
        return informational("not judged: no value")
    gap = value - centre
    return within(abs(gap) <= tolerance, rule, tolerance, "above" if gap > 0 else "below")


def verdict(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict over ``checks`` (certificate_checks.py's dicts): ``verified`` when at least
    one figure was judged and all judged figures are within; else ``not verified``, with each
    check that has figures not within (its id, title and those figures' names). ``judged``
    counts the figures with a rule."""
    judged = 0
    failing: list[dict[str, Any]] = []
    for c in checks:
        names = []
        for f in c["figures"]:
            v = f.get("verdict")
            if v not in READINGS:
                raise ValueError(f"figure {f.get('name')!r} has no reading: {v!r}")
            judged += v != INFORMATIONAL
            if v == NOT_WITHIN:
                names.append(f["name"])
        if names:
            failing.append({"check": c["id"], "title": c["title"], "figures": names})
    ok = judged > 0 and not failing
    return {"verdict": VERIFIED if ok else NOT_VERIFIED, "not_within": failing, "judged": judged}


def summary(v: dict[str, Any]) -> str:
    """``verdict``'s result in one line: what is not within (or that nothing was judged)."""
    if v["verdict"] == VERIFIED:
        return f"all {v['judged']} judged figures within"
    if not v["not_within"]:
        return "no figure with a rule was measured"
    parts = [f"{x['check']} ({', '.join(x['figures'])})" for x in v["not_within"]]
    return "not within: " + "; ".join(parts)
