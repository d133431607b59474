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

import math
from dataclasses import dataclass
from statistics import NormalDist
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
    AUCs are fractions in [0, 1].

    Where the figures come with the sample counts they were measured on (the server's
    verification reports them: ``forget_samples``, ``test_samples``), the forget-set score
    gets a tolerance from its own noise at those counts, at significance ``alpha``
    (``score_band``): a few samples cannot tell a residue from chance, and a figure is only
    called not within when chance alone would rarely put it there. ``score`` is then a floor
    under that band (a difference too small to matter is not flagged however many samples
    show it); without the counts it is the tolerance itself. Each figure says which it used
    (``tolerance_from``: ``noise``, ``floor``, ``fixed``).

    The server's membership-inference AUC is not judged: its non-members are the global
    test set, not the silo's own unseen data, so a gap between the two reads as membership
    (a model retrained without the silo shows it too: 0.20 on the breast-fna benchmark's
    backdoored silo). Membership is judged by the silo's own test, which compares its
    samples with its own held-out ones, and against retraining where reference runs are
    given."""

    alpha: float = 0.05
    """Significance of the noise bands, two-sided: a band is z = 1.96 standard deviations of
    the figure's spread under "the erased samples look like unseen ones" (about two standard
    errors). The silo's own membership test stops at the same default
    (``protocol.config.STOP_ALPHA``, fedasync.membership)."""
    score: float = 0.05
    """The forget-set score above the same model's unseen-test score (at the boundary and at
    verification). A model retrained without the samples scores them like unseen data. With
    the counts the tolerance is the spread of a difference of two proportions, ``z *
    sqrt(p (1 - p) (1 / n_forget + 1 / n_test))`` with ``p`` the two scores pooled (a score
    averaged over samples in [0, 1] spreads no more than a proportion; a pooled Dice is
    read the same way, an image a trial); 0.05 is its floor, and the tolerance without
    counts (an accuracy over about a hundred samples has a standard deviation near 0.05)."""
    asr: float = 0.05
    """The backdoor's attack success rate above the same images' rate without the trigger:
    what the trigger still adds. 0.05, as for a score (a rate over about a hundred images)."""
    dip: float = 0.1
    """The global test score at verification below the score just before the erasure
    (``score_recovered``): a lasting loss above 0.1 is damage to the model. The dip at the
    boundary itself is shown, not judged: removing a silo's data may cost score at once, as
    retraining without it does, and the other silos' training brings it back."""
    reversion: float = 0.5
    """The reversion ratio toward the pre-erasure model at verification: 0 none, 1 all the
    way back. Past half-way the erased model has mostly come back."""
    delta: float = 1e-6
    """The applied erasure delta's norm above its bound, relative to the bound (float
    rounding only). The server clips a delta larger than its bound to it (bounds.py), so the
    applied delta is within by construction; a clip is the bound doing its job, and is
    reported beside it (how much of the sent delta was applied), not judged: whether the
    erasure worked is the forgetting checks' to say."""
    silo_updates: float = 0.0
    """Updates of a retired (whole-silo erased) silo taken after the boundary: none."""

    @property
    def z(self) -> float:
        """The two-sided normal quantile of ``alpha`` (1.96 at 0.05)."""
        return NormalDist().inv_cdf(1.0 - self.alpha / 2.0)


TOLERANCES = Tolerances()

NOISE, FLOOR, FIXED = "noise", "floor", "fixed"
"""Where a tolerance came from (a figure's ``tolerance_from``): the figure's noise at its
sample counts, the floor under it (wider than the noise), or the fixed value (no counts)."""


def _count(v: object) -> int | None:
    """A sample count from a metrics dict: a positive whole number, else None."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return int(v) if v >= 1 and float(v).is_integer() else None


def score_band(
    m: dict[str, Any],
    forget: object,
    test: object,
    tol: Tolerances = TOLERANCES,
) -> tuple[float, str, str]:
    """The tolerance of the forget-set score ``forget`` above the test score ``test`` for
    metrics ``m`` (their counts ``forget_samples``, ``test_samples``): (tolerance,
    ``tolerance_from``, in words). ``z`` standard errors of the difference of two
    proportions, pooled, when the counts are there (at least ``tol.score``), else
    ``tol.score``."""
    n, k = _count(m.get("forget_samples")), _count(m.get("test_samples"))
    p1, p2 = _fraction(forget), _fraction(test)
    if n is None or k is None or p1 is None or p2 is None:
        return tol.score, FIXED, "fixed: no sample counts"
    p = (p1 * n + p2 * k) / (n + k)
    noise = tol.z * math.sqrt(p * (1.0 - p) * (1.0 / n + 1.0 / k))
    where = (
        f"{tol.z:.3g} standard errors of a difference of two proportions over {n} and {k} samples"
    )
    if noise >= tol.score:
        return noise, NOISE, where
    return tol.score, FLOOR, f"the floor ({where} is {noise:.3g})"


def _fraction(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return min(max(float(v), 0.0), 1.0)


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
