"""Unlearning arithmetic: flat vectors of ``Params``, L2 balls, gradient signatures, one-sided
projections and the server's record of the silos' contributions, one module per job:

- :mod:`~fedasync.unlearning.vectors`: ``Params`` as one flat vector and back, and spans of
  such vectors (the convention every other module here works on);
- :mod:`~fedasync.unlearning.ball`: the erasing silo's L2 ball (Halimi et al. 2022);
- :mod:`~fedasync.unlearning.signature`: the erased data's gradient signature (AFU-IC, SFU);
- :mod:`~fedasync.unlearning.one_sided`: directions a later change may not move against
  (PCGrad, FedOSD);
- :mod:`~fedasync.unlearning.sketch`: a bounded streaming sketch of the span of the silos'
  accepted updates, by silo (what the others' training moves the model along);
- :mod:`~fedasync.unlearning.federaser`: the contribution ledger and FedEraser's retained
  norms and rebuild step (Liu et al. 2021).

Papers:

- Halimi et al. 2022, "Federated Unlearning: How to Efficiently Erase a Client in FL?"
  (arXiv:2207.05521): the erasing silo runs projected gradient *ascent* on its data, kept in
  an L2 ball around a reference model. Here: :func:`project_to_ball` (the silo-side loop is
  ``clients.unlearn.erase_pga``).
- Liu et al. 2021, FedEraser (IWQoS 2021): the server keeps each silo's past contributions and
  removes/calibrates them. Here: :class:`ContributionLedger` keeps one running *sum* per silo
  (not FedEraser's per-round history), enough for a first-order removal.
- Cai & Zhang 2026, AFU-IC, "Asynchronous Federated Unlearning with Invariance Calibration for
  Medical Imaging" (only the abstract is public): the target silo unlearns without stopping
  global training, and a server-side invariance calibration stops the model from relearning
  the erased data. Our reading, not the paper's code: the silo sends a low-rank
  :class:`GradientSignature` (an orthonormal basis of the span of per-batch loss gradients on
  its forget set, never the data) and the server projects every later update out of that
  subspace (:meth:`GradientSignature.project_out`), so neither other silos nor stale work can
  move the model back along the erased data's directions.
- Li et al. 2023, SFU, "Subspace-based Federated Unlearning" (arXiv:2302.12448): updates kept
  orthogonal to the other clients' subspace. Adapted here: the *signature* loses the span of
  the other silos' recent updates (:meth:`GradientSignature.without_span`).
- PCGrad (Yu et al. 2020, arXiv:2001.06782) and FedOSD (arXiv:2412.20200): one-sided
  projections (:class:`OneSided`: the erasure's jump, :class:`ErasureJump`, and the forget
  set's mean loss gradient, :class:`ForgetGradient`; several at once, :func:`block_one_sided`).

Conventions follow ``fedasync.tensors``: functions return new tensors and never mutate their
inputs; only floating-point tensors take part (integer buffers are copied unchanged). A flat
vector is the concatenation of the floating tensors in ``names`` order (sorted key order by
default), in the widest floating dtype present but at least float32.

Every public name is importable from here (``from fedasync.unlearning import ...``), as
before the split; ``server.unlearning`` and ``clients.unlearn`` import them so.
"""

from fedasync.unlearning.ball import SHARE_RULES, forget_share_scale, l2_distance, project_to_ball
from fedasync.unlearning.federaser import ContributionLedger, UpdateHistory, federaser_step
from fedasync.unlearning.one_sided import ErasureJump, ForgetGradient, OneSided, block_one_sided
from fedasync.unlearning.signature import GradientSignature
from fedasync.unlearning.sketch import Span, SpanSketch
from fedasync.unlearning.vectors import (
    BasisSpan,
    Projector,
    outside,
    outside_span,
    params_to_vector,
    span_basis,
    vector_to_params,
)

__all__ = [
    "SHARE_RULES",
    "BasisSpan",
    "Projector",
    "Span",
    "SpanSketch",
    "outside",
    "ContributionLedger",
    "ErasureJump",
    "ForgetGradient",
    "GradientSignature",
    "OneSided",
    "UpdateHistory",
    "block_one_sided",
    "federaser_step",
    "forget_share_scale",
    "l2_distance",
    "outside_span",
    "params_to_vector",
    "project_to_ball",
    "span_basis",
    "vector_to_params",
]
