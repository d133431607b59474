"""Strategies: the rule that folds an update, and what the server sends when.

Paper: each strategy's own (below). In the spirit of Flower's ``Strategy``, kept apart from
the Grid: the loop (server/loop.py) keeps the Grid, the clock and the version, takes each
reply in order and has it corrected (server/corrections.py); a strategy decides the rest, and
the loop and its parts never ask which one runs:

- ``aggregator``: the core rule that folds a corrected update into the model
  (fedasync/aggregators.py), built with what every rule shares (the server optimiser, central
  DP's mechanism, whether each silo's share is attributed for an erasure);
- ``evaluates``: whether a new version is evaluated;
- ``replies_taken``: what is sent once the replies of one poll are taken (their silos are
  ``ready``);
- ``failed``: what happens to a silo whose job failed (``down_s``: how long it is down);
- ``free``: a silo that may train again outside that flow (its retry is due, an erasure
  released it, a resumed run found it between two jobs).

The interface is strategy.py. builtin.py: ``FedAsync`` (Xie et al. 2019) folds every update
at once and sends its silo the newest model; ``FedBuff`` (Nguyen et al. 2022) buffers K
updates per server step; ``SyncFedAvg`` is synchronous FedAvg (McMahan et al. 2017) on the
same silos and clock: a round waits for every silo's reply, so one straggler stalls everyone.
ca2fl.py: ``CA2FL`` (Wang et al. 2024), cached update calibration. federaser.py:
``HaltingFedEraser`` (Liu et al. 2021), the erasure benchmarks' baseline: synchronous FedAvg
that halts while a silo erases and rebuilds the model without it (its erasure policy:
``halts_for_erasure``, ``rebuilds_for_erasure``, which the erasure part is given). Adding a rule is a file
here (a ``Strategy`` with its aggregator) and its name in ``STRATEGIES`` (``server.mode``).
"""

from __future__ import annotations

from server.config import FedAsyncConfig
from server.strategies.builtin import FedAsync, FedBuff, SyncFedAvg
from server.strategies.ca2fl import CA2FL
from server.strategies.federaser import HaltingFedEraser
from server.strategies.strategy import Strategy, StrategyHost

STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (FedAsync, FedBuff, SyncFedAvg, CA2FL, HaltingFedEraser)
}
"""The strategies by ``server.mode``."""


def strategy_for(cfg: FedAsyncConfig) -> Strategy:
    """The strategy ``server.mode`` names."""
    return STRATEGIES[cfg.server.mode](cfg)


__all__ = [
    "CA2FL",
    "STRATEGIES",
    "FedAsync",
    "FedBuff",
    "HaltingFedEraser",
    "Strategy",
    "StrategyHost",
    "SyncFedAvg",
    "strategy_for",
]
