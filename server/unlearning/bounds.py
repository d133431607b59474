"""Bounds, so that an erasure cannot wreck everyone's model (a silo could otherwise do it on
purpose, and even an honest tiny erasure did: see docs/erasure.md). Arithmetic only: the
erasure coordinator (lifecycle.py) calls it with what it knows of the silo and the server.

- its scope: a request whose ids, with those erased before, cover every sample the silo
  holds is carried out as a whole-silo erasure (a silo left without data could only fail
  every training job); the ``erasing`` event and the audit row say so (``size``);
- its size follows the forget set's share of the silo's data
  (`fedasync.unlearning.forget_share_scale`, ``lab.erasure.radius_scaling``): PGA's ball
  radius, relabelling's steps (``size``);
- its delta is bounded like any update, and more: clipped (not rejected: the erasure still
  happens) to the smallest of ``NORM_OUTLIER_FACTOR`` x the median accepted update
  norm, ``server.clip_norm``, and for PGA the radius it was sent (an honest delta lies in
  that ball); the clip is reported (``delta_norm``, ``delta_bound``, ``clip_factor``;
  ``bound_delta``);
- the test score just before and just after the boundary, and their difference
  (``score_before``, ``score_after``, ``boundary_dip``), are in every report (lifecycle.py).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from fedasync import Params
from fedasync.tensors import clip_by_norm, global_norm
from fedasync.unlearning import forget_share_scale
from protocol.config import SiloErasure

if TYPE_CHECKING:
    from server.config import UnlearningConfig
    from server.config_lab import ErasureLab
    from server.unlearning.requests import Erasure

log = logging.getLogger("fedasync.server")


def size(
    e: Erasure, u: UnlearningConfig, lab: ErasureLab, held: set[str], n_samples: int, gone: set[str]
) -> str:
    """Scope and size of ``e`` before it is sent, by ``u`` and ``lab`` (``lab.erasure``): a
    request whose ids (with those erased before, ``gone``) cover every sample of the silo
    (``held``: its ids; without them, ``n_samples``: its count) becomes a whole-silo erasure;
    a sample-level one is scaled to its share of the silo's data (``e.overrides``,
    ``e.start_report``). Returns a note for the audit row."""
    n_held = len(held) if held else n_samples
    n_left = n_held - (len(gone & held) if held else len(gone))
    note = ""
    if e.sample_ids:
        covered = set(e.sample_ids) | gone
        if (held and held <= covered) or (not held and n_held and len(covered) >= n_held):
            why = (
                f"its ids cover all {n_held} samples silo {e.silo} holds"
                + (f" ({len(gone)} erased before)" if gone else "")
                + ": erased as a whole silo (the silo is retired)"
            )
            log.warning("erasure %s of silo %d: %s", e.request_id, e.silo, why)
            e.sample_ids = []
            e.start_report["whole_silo"] = why
            note = f"; {why}"
    if e.sample_ids:
        n = len(set(e.sample_ids) - gone)
        scale = forget_share_scale(n, max(n_left, 1), lab.radius_scaling, lab.radius_floor)
        e.overrides = {
            "radius": lab.radius * scale,
            "steps": max(1, math.ceil(u.steps * scale)) if u.method == "relabel" else u.steps,
        }
        e.start_report.update(share=n / max(n_left, 1), size_scale=scale, **e.overrides)
        note += f"; {n} of {n_left} samples: size x{scale:.3g}"
    return note


def bound_delta(
    erasure: Erasure,
    delta: Params,
    u: UnlearningConfig,
    lab: ErasureLab,
    *,
    threshold: float | None,
    clip_norm: float | None,
) -> tuple[Params, dict[str, float]]:
    """``delta`` clipped to the erasure bound, and what was done (``delta_norm``: its L2
    norm as sent; ``delta_bound``; ``clip_factor`` < 1 when it was clipped).

    The bound is the smallest of: ``threshold``, ``NORM_OUTLIER_FACTOR`` x the median
    norm of recently accepted updates (None: not enough yet), ``clip_norm``
    (``server.clip_norm``), and, for PGA, the ball radius the erasure was sent (1e-3 relative
    slack for float rounding). An erasure delta is applied at full weight, not at a
    staleness-weighted mixing rate, so it gets at least the bounds any update gets. Clipped
    rather than rejected: the request is still carried out (bounded) and the clip is
    reported, where a rejection would have to fail or retry an erasure the requester is owed.
    """
    bounds: list[float] = []
    if threshold is not None:
        bounds.append(threshold)
    if clip_norm is not None:
        bounds.append(float(clip_norm))
    if u.method == "pga":
        bounds.append(SiloErasure.of(erasure.overrides, u, lab).radius * (1 + 1e-3))
    norm = global_norm(delta)
    report = {"delta_norm": norm}
    if not bounds:
        return delta, report
    bound = min(bounds)
    clipped, factor = clip_by_norm(delta, bound, norm)
    report["delta_bound"] = bound
    if factor < 1.0:
        report["clip_factor"] = factor
        log.warning(
            "erasure %s of silo %d: delta norm %.4g clipped to the bound %.4g",
            erasure.request_id,
            erasure.silo,
            norm,
            bound,
        )
    return clipped, report
