"""What a run that can erase keeps of each accepted update, added in the fold's own pass.

Two running sums take every accepted update: the span sketch (`fedasync.unlearning.SpanSketch`,
the update into one row) and the silo's ledger sum (`fedasync.unlearning.ContributionLedger`,
the change the fold made to the model, when the removal reads it). Added separately they cost
a pass each over the update or the change, read again from memory; a FedAsync fold adds them
in its own chunked pass, while each chunk is in cache (`fedasync.flat.axpy_sunk`), and never
writes the change as a model-sized tensor. Where the fold cannot (FedBuff's buffer, central DP,
a projected change after an erasure, tensors on a GPU), `UpdateSinks.unfused` adds the update
into the sketch and the change goes into the ledger by the fold's contributions, as before.
"""

from __future__ import annotations

from fedasync import Params
from fedasync.flat import FlatParams, Sink
from fedasync.unlearning import ContributionLedger, SpanSketch


class UpdateSinks:
    """The sinks of one accepted update of ``silo`` (`fedasync.aggregators.FoldSink`): the
    sketch's row (None: no sketch kept) and the ledger's sum, counted at ``version``."""

    def __init__(
        self, sketch: SpanSketch | None, ledger: ContributionLedger, silo: int, version: int
    ):
        self.sketch, self.ledger, self.silo, self.version = sketch, ledger, silo, version

    def sinks(self, x: FlatParams, norm: float | None, change: bool) -> list[Sink] | None:
        """The sketch's row for ``x`` and, with ``change``, the silo's sum of changes; None,
        and nothing taken, when either cannot take ``x`` in one pass."""
        key = str(self.silo)
        if change and not self.ledger.fusable(key, x):
            return None
        if self.sketch is not None and not self.sketch.fusable(x):
            return None
        out = [] if self.sketch is None else self.sketch.sink(self.silo, x, norm)
        if change:
            out.append(Sink(self.ledger.sink(key, x, self.version), 1.0, "change"))
        return out

    def unfused(self, x: Params, norm: float | None) -> None:
        """``x`` into the sketch (the change goes into the ledger by the contributions)."""
        if self.sketch is not None:
            self.sketch.add(self.silo, x, norm)
