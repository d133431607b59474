"""The benchmarks' instruments, which a hospital's node never obeys.

A verification run of a built-in benchmark can ask a silo to stamp a trigger on its images and
relabel them (the setup's ``backdoor``), to wait after training as a slower silo would (the
setup's ``emulate_speeds``), to train on another silo's poisoned samples as well (a
train request's ``relearn``), or to misbehave on the wire (a train request's ``fault``:
crash, replay, corrupt its reply). They exist to test the erasure and the server's intake in
simulation and on one-machine deployments of a benchmark's partitions.

A node that trains on its own datalist (a hospital: ``datalist`` in its node config) trains on
that data as it is. The coordinator decides the model and the training settings, never what
the hospital's samples are or what its node answers: such a node refuses a request that asks
for an instrument, in one line, records the refusal in its node log, and leaves its data as it
read it. To a train request it answers with a typed refusal (``LAB_SETTING``), after which the
server sends it no more training; to a query, an evaluation or an erasure, with an error whose
reason is that line (the roster query names the silo and stops the run at its start).
"""

from __future__ import annotations

from typing import Any

from clients.node_log import record

LAB_SETTING = "lab_setting"
"""Refusal reason of a hospital's node asked for a benchmark instrument."""


class LabSettingRefused(ValueError):
    """A request asked a node on its own datalist for a benchmark instrument."""

    def __init__(self, silo: int, what: list[str]) -> None:
        self.silo, self.what = silo, what
        super().__init__(
            f"silo {silo} trains on its own datalist and refuses the benchmark instrument(s) "
            f"{', '.join(what)}: a verification setting for simulated silos only"
        )


def instruments(
    backdoor: dict[str, Any] | None,
    *,
    relearn: bool = False,
    fault: str | None = None,
    emulate: bool = False,
) -> list[str]:
    """The instruments a request asks for: ``backdoor`` (on), ``relearn``, ``fault=KIND``,
    ``emulate_speed`` (the setup's ``emulate_speeds``: wait after training, as a slower silo)."""
    asked = []
    if backdoor and backdoor.get("enabled"):
        asked.append("backdoor")
    if relearn:
        asked.append("relearn")
    if fault:
        asked.append(f"fault={str(fault)[:40]}")
    if emulate:
        asked.append("emulate_speed")
    return asked


def refuse_instruments(silo: int, asked: list[str], *, handler: str, **fields: Any) -> None:
    """Raise :class:`LabSettingRefused` when ``asked`` is not empty, after recording the
    refusal (``handler``: the message it came with, ``fields``: job and version) in the node's
    log."""
    if not asked:
        return
    record("refuse", silo=silo, reason=LAB_SETTING, handler=handler, asked=asked, **fields)
    raise LabSettingRefused(silo, asked)
