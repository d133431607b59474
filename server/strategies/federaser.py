"""Halting FedEraser (Liu et al. 2021), the erasure benchmarks' baseline: synchronous FedAvg
whose federation halts while a silo's erasure is carried out, and whose erasure rebuilds the
model without the silo.

Paper: FedEraser: Enabling Efficient Client-Level Data Removal from Federated Learning Models
(IWQoS 2021). The server keeps every ``lab.erasure.federaser_interval``-th round's update norms;
on a whole-silo request nobody trains until the rebuild is done: from the initial model, one
calibration round per retained round, in which the remaining silos train briefly
(``lab.erasure.federaser_steps_ratio`` of the local steps) and each update keeps its retained
norm with the new direction (server/unlearning/rebuild.py). Then training resumes in rounds
without the silo. What the halt costs is what asynchronous erasure avoids.
"""

from __future__ import annotations

from server.strategies.builtin import SyncFedAvg


class HaltingFedEraser(SyncFedAvg):
    """Synchronous FedAvg that halts for an erasure and erases by FedEraser's rebuild."""

    name = "federaser"
    halts_for_erasure = True
    rebuilds_for_erasure = True
