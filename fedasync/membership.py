"""When an erasure has done enough: a membership test the erasing silo runs alone.

A model retrained without the forget samples treats them as it treats any sample it never
trained on. The erasing silo holds such samples of its own: its held-out (validation) samples,
which no model of the federation trained on. So during the erasure it compares the two sets'
per-sample membership statistic (the logit-scaled confidence in the true label, the statistic
of LiRA, Carlini et al. 2022) with a two-sided Mann–Whitney test at significance ``alpha``:

- ``member``: the forget samples still score higher than held-out ones (AUC above the band):
  they are recognisably trained on; the erasure goes on;
- ``indistinguishable``: the AUC lies within the band around 0.5: at this significance the two
  sets cannot be told apart, as for a retrained model; the erasure stops;
- ``over``: the forget samples now score *lower* than unseen ones (AUC below the band). That is
  over-erasure, which a membership attack also detects (the "Streisand effect" of the unlearning
  literature); the erasure returns to its reading closest to 0.5 and stops.

Here AUC is the probability that a random forget sample outscores a random held-out one (ties
one half), i.e. the U statistic over ``n_f · n_h``. Under the null hypothesis (both sets drawn
alike) it is close to normal with mean 0.5 and standard deviation
``sqrt((n_f + n_h + 1) / (12 n_f n_h))`` (ties only lower it, so the band is conservative); the
band is ``z_{1−alpha/2}`` of those. Nothing here needs a retrained model or sends data
anywhere: the statistic is computed where the samples are.

The assumption is that forget and held-out samples come from the same distribution, as a
whole silo's training and validation data do, or a random subset of them. Where the forget
samples differ on purpose (a backdoor's triggered samples), the held-out samples must be
transformed the same way before they are compared.

    rule = MembershipStop(alpha=0.05)
    track = rule.track()
    for step in ...:
        reading = rule.read(forget_stat, heldout_stat)   # per-sample statistics, numpy
        decision = track.add(step, reading)
        if decision.stop: ... (decision.revert_to: the step whose state to restore, or None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Literal

import numpy as np

from fedasync.erasure_metrics import rank_auc

Verdict = Literal["member", "indistinguishable", "over"]


def null_sd(n_forget: int, n_heldout: int) -> float:
    """Standard deviation of the AUC when both sets are drawn alike (no ties)."""
    if n_forget < 1 or n_heldout < 1:
        raise ValueError(f"need samples in both sets, got {n_forget} and {n_heldout}")
    return math.sqrt((n_forget + n_heldout + 1) / (12.0 * n_forget * n_heldout))


def band(n_forget: int, n_heldout: int, alpha: float) -> float:
    """Half-width of the two-sided acceptance band around AUC 0.5 at significance ``alpha``."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    return NormalDist().inv_cdf(1.0 - alpha / 2.0) * null_sd(n_forget, n_heldout)


@dataclass(frozen=True)
class Reading:
    """One comparison of the forget samples' statistics with the held-out samples'."""

    auc: float
    """P(a forget sample outscores a held-out one); 0.5: indistinguishable."""
    band: float
    """Half-width of the acceptance band around 0.5."""
    n_forget: int
    n_heldout: int

    @property
    def verdict(self) -> Verdict:
        """``member`` above the band, ``over`` below it, ``indistinguishable`` within."""
        if self.auc > 0.5 + self.band:
            return "member"
        if self.auc < 0.5 - self.band:
            return "over"
        return "indistinguishable"

    @property
    def gap(self) -> float:
        """|AUC − 0.5|: how far from a retrained model's expected reading."""
        return abs(self.auc - 0.5)

    @property
    def p_value(self) -> float:
        """Two-sided p-value of the normal approximation (1: no evidence of a difference)."""
        z = self.gap / null_sd(self.n_forget, self.n_heldout)
        return 2.0 * (1.0 - NormalDist().cdf(z))


@dataclass(frozen=True)
class Decision:
    """What the erasure does after a reading."""

    stop: bool
    reason: str
    """``member`` (go on), ``indistinguishable``, ``over`` (reverted), ``budget``."""
    revert_to: int | None = None
    """With ``over``: the step of the best earlier reading, whose state to restore."""


@dataclass
class Track:
    """The readings of one erasure, in order, and the decision after each."""

    readings: list[tuple[int, Reading]] = field(default_factory=list)

    def add(self, step: int, reading: Reading) -> Decision:
        """Record the reading taken after ``step`` steps and decide."""
        self.readings.append((step, reading))
        verdict = reading.verdict
        if verdict == "member":
            return Decision(False, "member")
        if verdict == "indistinguishable":
            return Decision(True, "indistinguishable")
        return Decision(True, "over", revert_to=self.best()[0])

    def best(self) -> tuple[int, Reading]:
        """The reading closest to 0.5 (the latest among equals)."""
        if not self.readings:
            raise ValueError("no reading yet")
        return min(self.readings, key=lambda sr: (sr[1].gap, -sr[0]))

    def summary(self) -> dict[str, float]:
        """First and last AUC, the band, and how many readings were taken."""
        if not self.readings:
            return {}
        first, last = self.readings[0][1], self.readings[-1][1]
        return {
            "auc_before": first.auc,
            "auc": last.auc,
            "auc_band": last.band,
            "readings": float(len(self.readings)),
        }


@dataclass(frozen=True)
class MembershipStop:
    """The stopping rule: stop when the forget samples' statistics cannot be told apart from
    held-out samples' at significance ``alpha``; revert past an overshoot."""

    alpha: float = 0.05

    def __post_init__(self) -> None:
        band(1, 1, self.alpha)  # validates alpha

    def read(self, forget_stat: np.ndarray, heldout_stat: np.ndarray) -> Reading:
        """Compare per-sample statistics (higher: more member-like), one value per sample."""
        f = np.asarray(forget_stat, dtype=np.float64).ravel()
        h = np.asarray(heldout_stat, dtype=np.float64).ravel()
        auc = rank_auc(f, h)
        return Reading(auc, band(f.size, h.size, self.alpha), f.size, h.size)

    def track(self) -> Track:
        """An empty track for one erasure's readings."""
        return Track()
