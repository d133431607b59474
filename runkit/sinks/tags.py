"""Which scalar each event becomes: the one table of tag names, for every run kind.

A row says a tag's name, the run kinds that have it, the event (and field) it comes from, what
it means, and how its value is taken: a field as it is, a count of events so far, a sum so far,
or a small computation (the mean of a staleness histogram). A ``<placeholder>`` in a name is
filled from the event (``<silo>``, ``<reason>``, ``<state>``, ``<firm>``). The sinks
(runkit.sinks.follow) write exactly what `scalars` gives; docs/metrics.md holds `markdown`'s
table (``python -m runkit.sinks`` prints it), and a test checks the page against it and
every tag a real run writes against `match`, so that neither can drift from the code.

The step of every scalar is the event's ``step`` (the pipeline's), else its ``version`` (the
federated global version, the RL policy version, the market's price revisions, the version a
node's job trained from), else the step of the stream's last event (runkit.sinks.follow).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Totals = dict[str, float]
"""What a stream has counted or summed so far, by filled tag name."""
Take = Callable[[str, dict[str, Any], Totals], Iterator[tuple[str, float]]]
"""How a row takes its values: (its tag, the event, the stream's totals) -> (tag, value)s."""

FAMILIES: dict[str, str] = {
    "fed": "`simulate`, `deploy local`",
    "node": "`node`",
    "rl": "`rl`",
    "pipeline": "`pipeline`",
    "market": "`market`",
    "trainer": "a trainer on `runkit.recipe.drive`",
}
"""Which run kinds write each family of events (a family's events share their names)."""

ERASURE_STATES: dict[str, float] = {
    "queued": 0.0,
    "removed": 0.5,
    "removed_more": 0.5,
    "erasing": 1.0,
    "calibrating": 2.0,
    "verified": 3.0,
    "unverified": -2.0,
    "failed": -1.0,
}
"""``fed/silo/<silo>/erasure_state``: an erasure's state as a number (a line that climbs)."""

_LABEL = re.compile(r"[^A-Za-z0-9_.-]+")


def label(value: Any) -> str:
    """``value`` as one part of a tag name: letters, digits, ``_.-`` only, 40 at most."""
    return _LABEL.sub("_", str(value))[:40] or "_"


def number(value: Any) -> float | None:
    """``value`` as a finite float; None for anything else (a bool, a string, null, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def fill(tag: str, e: dict[str, Any], *keys: str) -> str | None:
    """``tag`` with ``<key>`` replaced by the event's value of each of ``keys`` (None: the
    event lacks one)."""
    for k in keys:
        if e.get(k) is None:
            return None
        tag = tag.replace(f"<{k}>", label(e[k]))
    return tag


def field(name: str, *keys: str) -> Take:
    """The event's ``name`` as it is (placeholders ``keys`` filled from the event)."""

    def take(tag: str, e: dict[str, Any], totals: Totals) -> Iterator[tuple[str, float]]:
        x, t = number(e.get(name)), fill(tag, e, *keys)
        if x is not None and t is not None:
            yield t, x

    return take


def count(*keys: str) -> Take:
    """How many such events so far (one count per filled tag)."""

    def take(tag: str, e: dict[str, Any], totals: Totals) -> Iterator[tuple[str, float]]:
        t = fill(tag, e, *keys)
        if t is not None:
            totals[t] = totals.get(t, 0.0) + 1.0
            yield t, totals[t]

    return take


def total(name: str, *keys: str) -> Take:
    """The event's ``name`` summed so far (one sum per filled tag)."""

    def take(tag: str, e: dict[str, Any], totals: Totals) -> Iterator[tuple[str, float]]:
        x, t = number(e.get(name)), fill(tag, e, *keys)
        if x is not None and t is not None:
            totals[t] = totals.get(t, 0.0) + x
            yield t, totals[t]

    return take


def each(name: str, key: str) -> Take:
    """One value per entry of the event's list ``name``, ``<key>`` its index."""

    def take(tag: str, e: dict[str, Any], totals: Totals) -> Iterator[tuple[str, float]]:
        values = e.get(name)
        for i, v in enumerate(values if isinstance(values, list) else []):
            x = number(v)
            if x is not None:
                yield tag.replace(f"<{key}>", str(i)), x

    return take


def computed(fn: Callable[[dict[str, Any]], float | None], *keys: str) -> Take:
    """``fn(event)`` (None: nothing)."""

    def take(tag: str, e: dict[str, Any], totals: Totals) -> Iterator[tuple[str, float]]:
        x, t = fn(e), fill(tag, e, *keys)
        if x is not None and t is not None:
            yield t, x

    return take


def _histogram(e: dict[str, Any]) -> dict[float, float]:
    h = e.get("staleness_hist")
    if not isinstance(h, dict):
        return {}
    out = {}
    for k, v in h.items():
        try:
            out[float(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def staleness_mean(e: dict[str, Any]) -> float | None:
    """The mean staleness of an RL step's batch, from its ``staleness_hist``."""
    h = _histogram(e)
    n = sum(h.values())
    return sum(k * v for k, v in h.items()) / n if n > 0 else None


def staleness_max(e: dict[str, Any]) -> float | None:
    """The largest staleness in an RL step's batch, from its ``staleness_hist``."""
    h = _histogram(e)
    return max((k for k, v in h.items() if v > 0), default=None)


NOT_SCALARS = frozenset({"t", "step", "version", "wall"})
"""Fields a trainer's event carries as its place in the run, not as a measurement."""


def every_number(tag: str, e: dict[str, Any], totals: Totals) -> Iterator[tuple[str, float]]:
    """Every numeric field of a trainer's event, as ``<event>/<field>``."""
    event = label(e.get("event"))
    for k, v in e.items():
        x = number(v)
        if x is not None and k not in NOT_SCALARS:
            yield f"{event}/{label(k)}", x


def erasure_state(e: dict[str, Any]) -> float | None:
    """An ``erasure`` event's state as a number (`ERASURE_STATES`)."""
    return ERASURE_STATES.get(str(e.get("state")))


@dataclass(frozen=True)
class Tag:
    """One row of the table."""

    tag: str
    """The tag's name; ``<placeholder>`` parts are filled from the event."""
    family: str
    """Whose events (`FAMILIES`)."""
    events: tuple[str, ...]
    """The events it comes from."""
    source: str
    """Which field, and how (for the docs)."""
    meaning: str
    """What it says (for the docs)."""
    take: Take

    def pattern(self) -> re.Pattern[str]:
        """A regular expression for the names this row writes."""
        parts = re.split(r"(<[a-z_]+>)", self.tag)
        return re.compile(
            "".join("[A-Za-z0-9_.-]+" if p.startswith("<") else re.escape(p) for p in parts)
        )


def _t(tag: str, family: str, events: str, source: str, meaning: str, take: Take) -> Tag:
    return Tag(tag, family, tuple(events.split()), source, meaning, take)


TAGS: tuple[Tag, ...] = (
    # --- federated runs: the coordinator's metrics.jsonl (server/, simulations/)
    _t("fed/score", "fed", "eval", "`score`", "the global model's score on the held-out test set: accuracy, or Dice for segmentation", field("score")),
    _t("fed/loss", "fed", "eval", "`loss`", "the global model's loss on the held-out test set", field("loss")),
    _t("fed/staleness", "fed", "update", "`staleness`", "each accepted update's staleness τ (versions between its base and its arrival)", field("staleness")),
    _t("fed/time_s", "fed", "version", "`t`", "clock time each version was published (virtual seconds in simulation, wall seconds in deployment)", field("t")),
    _t("fed/updates/accepted", "fed", "update", "count", "updates accepted so far (folded in; FedBuff: held until the buffer's flush)", count()),
    _t("fed/updates/rejected/<reason>", "fed", "reject", "count by `reason`", "updates rejected so far, by reason (`too_stale`, `non_finite`, `norm_outlier`, `erased`, ...)", count("reason")),
    _t("fed/updates/rejected_total", "fed", "reject", "count", "updates rejected so far, all reasons", count()),
    _t("fed/updates/discarded", "fed", "reply_discarded", "count", "replies to jobs cancelled for an erasure, dropped unread", count()),
    _t("fed/versions/refused", "fed", "version_refused", "count", "folds whose model was not finite (refused; the model stayed)", count()),
    _t("fed/silo/<silo>/contribution", "fed", "update", "`weight`, summed by `silo`", "each silo's total weight in the global model so far (s(τ) × its factor, as in silo_contribution.png)", total("weight", "silo")),
    _t("fed/silo/<silo>/accepted", "fed", "update", "count by `silo`", "each silo's updates accepted so far", count("silo")),
    _t("fed/silo/<silo>/train_loss", "fed", "update", "`train_loss`", "the local training loss each silo reported with its update", field("train_loss", "silo")),
    _t("fed/silo/<silo>/epsilon", "fed", "update", "`dp-epsilon`", "the privacy budget epsilon each silo has spent under local DP (`client.dp`)", field("dp-epsilon", "silo")),
    _t("fed/silo/<silo>/central_epsilon", "fed", "update", "`central_epsilon`", "each silo's epsilon under central DP (`server.dp`)", field("central_epsilon", "silo")),
    _t("fed/silo/<silo>/score", "fed", "silo_eval", "`score`", "the final model's score on each silo's own data", field("score", "silo")),
    _t("fed/silos/stopped", "fed", "silo_stopped", "count", "silos stopped so far (privacy budget spent, or no data left)", count()),
    _t("fed/erasures/<state>", "fed", "erasure", "count by `state`", "erasure requests that entered each state so far (`queued`, `removed`: the server's removal in force, `erasing`, `calibrating`, `verified`, `unverified`, `failed`)", count("state")),
    _t("fed/silo/<silo>/erasure_state", "fed", "erasure", "`state` as a number", "the state of the silo's latest erasure: 0 queued, 0.5 the server's removal in force, 1 erasing, 2 calibrating, 3 verified, -2 unverified, -1 failed", computed(erasure_state, "silo")),
    _t("fed/silo/<silo>/forget_accuracy", "fed", "erasure erasure_watch", "`forget_accuracy`", "the global model's accuracy on the erased data, at calibration, at verification and at each watch", field("forget_accuracy", "silo")),
    _t("fed/silo/<silo>/mia_auc", "fed", "erasure erasure_watch", "`mia_auc`", "a membership-inference attack's AUC on the erased data (0.5: indistinguishable from unseen data)", field("mia_auc", "silo")),
    # --- a hospital's node: its own metrics.jsonl (clients/node_log.py)
    _t("node/train_loss", "node", "train", "`train_loss`", "the local training loss of each job this node ran", field("train_loss")),
    _t("node/train_score", "node", "train", "`train_score`", "the local training score of each job", field("train_score")),
    _t("node/train_seconds", "node", "train", "`train_seconds`", "seconds each job trained", field("train_seconds")),
    _t("node/samples", "node", "train", "`samples`", "the samples each job trained on", field("samples")),
    _t("node/epsilon", "node", "train", "`dp-epsilon`", "the privacy budget epsilon this node has spent under local DP", field("dp-epsilon")),
    _t("node/jobs", "node", "train", "count", "training jobs run so far", count()),
    _t("node/refused/<reason>", "node", "refuse", "count by `reason`", "training jobs this node refused so far, by reason (`budget_exhausted`, `no_training_data`)", count("reason")),
    _t("node/eval_score", "node", "evaluate", "`score`", "a model's score on this node's own held-out data, each time the coordinator asked", field("score")),
    _t("node/eval_loss", "node", "evaluate", "`loss`", "the same evaluation's loss", field("loss")),
    _t("node/unlearn_jobs", "node", "unlearn", "count", "erasure (unlearning) jobs run so far", count()),
    # --- fedasync rl (trainers/rl)
    _t("rl/accuracy", "rl", "eval", "`accuracy`", "the policy's greedy accuracy on the held-out prompts", field("accuracy")),
    _t("rl/teacher_rkl", "rl", "eval", "`teacher_rkl`", "KL(student ‖ teacher) on the held-out prompts (on-policy distillation)", field("teacher_rkl")),
    _t("rl/teacher_fkl", "rl", "eval", "`teacher_fkl`", "KL(teacher ‖ student) on the held-out prompts (on-policy distillation)", field("teacher_fkl")),
    _t("rl/reward", "rl", "step", "`reward`", "the mean reward of each learner step's batch", field("reward")),
    _t("rl/train_accuracy", "rl", "step", "`accuracy`", "the share of the batch's completions that were right", field("accuracy")),
    _t("rl/kl_behav", "rl", "step", "`kl_behav`", "KL between the policy that generated the batch and the learner's (how far stale rollouts drifted)", field("kl_behav")),
    _t("rl/staleness_mean", "rl", "step", "`staleness_hist`, mean", "the batch's mean staleness (learner version − the version that generated it)", computed(staleness_mean)),
    _t("rl/staleness_max", "rl", "step", "`staleness_hist`, max", "the batch's largest staleness", computed(staleness_max)),
    _t("rl/loss", "rl", "step", "`loss`", "the learner's loss", field("loss")),
    _t("rl/entropy", "rl", "step", "`entropy`", "the policy's entropy on the batch", field("entropy")),
    _t("rl/ess", "rl", "step", "`ess`", "the importance weights' effective sample size (share of the batch)", field("ess")),
    _t("rl/grad_norm", "rl", "step", "`grad_norm`", "the gradient's norm", field("grad_norm")),
    _t("rl/clip_frac", "rl", "step", "`clip_frac`", "the share of tokens the PPO clip cut", field("clip_frac")),
    _t("rl/response_length", "rl", "step", "`response_length`", "the batch's mean completion length (tokens)", field("response_length")),
    _t("rl/tokens_per_s", "rl", "step", "`tokens_per_s`", "the learner's tokens per second", field("tokens_per_s")),
    _t("rl/rejected", "rl", "reject", "count", "trajectories rejected so far (malformed, or past the staleness bound)", count()),
    _t("rl/dropped", "rl", "drop", "count", "rollout groups dropped so far", count()),
    # --- fedasync pipeline (trainers/pipeline)
    _t("pipeline/loss", "pipeline", "step", "`loss`", "the training loss of each step's batch", field("loss")),
    _t("pipeline/val_loss", "pipeline", "eval", "`val_loss`", "the whole model's held-out loss", field("val_loss")),
    _t("pipeline/bubble", "pipeline", "measured", "`bubble_fraction`", "the measured bubble: the share of the stages' time spent idle (at the end of the run)", field("bubble_fraction")),
    _t("pipeline/bubble_simulated", "pipeline", "measured", "`simulated_bubble_fraction`", "the bubble the simulator predicts from the measured stage costs", field("simulated_bubble_fraction")),
    _t("pipeline/tokens_per_s", "pipeline", "measured", "`tokens_per_s`", "training tokens per second over the pipeline's span", field("tokens_per_s")),
    _t("pipeline/max_drift", "pipeline", "measured", "`max_drift_seen`", "the largest weight-version drift a micro-batch crossed", field("max_drift_seen")),
    # --- fedasync market (trainers/market): one stream per seed
    _t("market/delta", "market", "window", "`delta`", "the collusion index Δ over each window (0: Nash prices, 1: monopoly)", field("delta")),
    _t("market/price/<firm>", "market", "window", "`prices`", "each firm's mean price over the window", each("prices", "firm")),
    _t("market/profit/<firm>", "market", "window", "`profit`", "each firm's mean profit over the window", each("profit", "firm")),
    _t("market/noise", "market", "window", "`noise`", "the agents' exploration noise", field("noise")),
    _t("market/critic_loss", "market", "window", "`critic_loss`", "the DDPG critics' mean loss over the window", field("critic_loss")),
    _t("market/actor_loss", "market", "window", "`actor_loss`", "the DDPG actors' mean loss over the window", field("actor_loss")),
    _t("market/q_mean", "market", "window", "`q_mean`", "the critics' mean Q value", field("q_mean")),
    _t("market/final_delta", "market", "end", "`delta`", "the seed's collusion index at the end", field("delta")),
    _t("market/diverged", "market", "diverged", "count", "times the seed's agents diverged (corrupted)", count()),
    # --- a new trainer written on runkit.recipe (docs/architecture.md): no rows of its own yet
    _t("<event>/<field>", "trainer", "*", "every number", "every numeric field of every event (but `t`, `step`, `version`), as it is", every_number),
)  # fmt: skip
"""Every scalar the sinks write."""

IMAGES = "images/<png>"
"""The run folder's PNGs, written once at the end (TensorBoard images, MLflow artifacts)."""


def _by_event() -> dict[tuple[str, str], tuple[Tag, ...]]:
    out: dict[tuple[str, str], list[Tag]] = {}
    for row in TAGS:
        for ev in row.events:
            out.setdefault((row.family, ev), []).append(row)
    return {k: tuple(v) for k, v in out.items()}


BY_EVENT = _by_event()
"""The rows of each (family, event)."""


def scalars(family: str, e: dict[str, Any], totals: Totals) -> list[tuple[str, float]]:
    """The (tag, value)s of event ``e`` of a ``family`` stream, counting into ``totals``."""
    out: list[tuple[str, float]] = []
    for row in BY_EVENT.get((family, str(e.get("event"))), ()) + BY_EVENT.get((family, "*"), ()):
        out.extend(row.take(row.tag, e, totals))
    return out


def match(tag: str, family: str) -> Tag | None:
    """The row of ``family`` a written tag name comes from (None: it is not in the table)."""
    return next((r for r in TAGS if r.family == family and r.pattern().fullmatch(tag)), None)


def markdown() -> str:
    """The table of docs/metrics.md: every tag, its run kinds, its source and meaning."""
    lines = ["| tag | run kinds | from (event: field) | meaning |", "|---|---|---|---|"]
    for r in TAGS:
        events = ", ".join(f"`{e}`" if e != "*" else "every event" for e in r.events)
        lines.append(f"| `{r.tag}` | {FAMILIES[r.family]} | {events}: {r.source} | {r.meaning} |")
    lines.append(
        f"| `{IMAGES}` | every kind | the run folder's `*.png`, once at the end | the run's "
        "plots (MLflow: artifacts under `plots/`) |"
    )
    return "\n".join(lines) + "\n"
