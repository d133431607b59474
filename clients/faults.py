"""Fault injection for robustness runs: a Flower mod around the ClientApp's train handler.

The server asks a silo to misbehave through the train request's ``fault`` (``keys.FAULT``; the
kinds are ``server.config_lab.FAULT_KINDS``), so the server's intake can be tested against every
bad reply on the real message path:

- ``crash``: raise before training (Flower turns it into an error reply);
- ``replay``: answer, without training, with the reply kept from an earlier message (one sent
  with ``keep-reply``); with none kept yet the message is handled normally;
- ``nan``, ``wrong_shape``, ``huge_norm``: corrupt the trained delta (the first floating tensor
  becomes NaN; the first tensor loses its shape and an element; every floating tensor x 1e4);
- ``future_version``, ``unknown_silo``: lie in the metrics (base version + 1000; silo
  10000 + silo).

A refusal is never corrupted, and only an update is kept for a later replay. Without a fault
(and without ``keep-reply``) the mod passes the message through untouched. A node on its own
datalist (a hospital) refuses every fault (``clients.lab``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from clients.lab import LAB_SETTING, LabSettingRefused, instruments, refuse_instruments
from protocol import keys as P
from protocol.messages import TrainRefusal, TrainReply, TrainRequest, injected_fault, is_refusal
from protocol.reading import record

log = logging.getLogger("fedasync.client")

LAST_ARRAYS, LAST_METRICS = "last-reply-arrays", "last-reply-metrics"
"""Node-state keys of the reply kept for a replay."""
TAMPERING = ("nan", "wrong_shape", "huge_norm", "future_version", "unknown_silo")
"""Faults that alter the reply the handler built."""


def inject_fault(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The Flower mod (``@app.train(mods=[inject_fault])``): carry out the fault ``msg`` asks
    for around ``call_next`` (the handler), and keep the reply when asked to."""
    fault, keep = injected_fault(msg)
    if (fault or keep) and context.node_config.get(P.DATALIST):  # a hospital's node (clients.lab)
        req = TrainRequest.from_message(msg)
        silo = int(context.node_config.get("partition-id", -1))
        try:
            refuse_instruments(
                silo,
                instruments(None, fault=fault or "keep-reply"),
                handler="train",
                job=req.job_id,
                version=req.base_version,
            )
        except LabSettingRefused as e:
            log.warning("silo %d refuses training: %s", silo, e)
            refusal = TrainRefusal(silo, req.job_id, req.base_version, LAB_SETTING, str(e))
            return refusal.to_message(reply_to=msg)
    if fault == "replay" and LAST_ARRAYS in context.state:
        log.warning("fault injection: replaying the previous reply")
        old = RecordDict(
            {P.ARRAYS: context.state[LAST_ARRAYS], P.METRICS: context.state[LAST_METRICS]}
        )
        return Message(old, reply_to=msg)
    if fault == "crash":
        raise RuntimeError("fault injection: silo crashed mid-training")
    reply = call_next(msg, context)
    if reply.has_error() or is_refusal(reply):
        return reply
    if fault in TAMPERING:
        reply = tamper(TrainReply.from_message(reply), fault).to_message(reply_to=msg)
    if keep:
        metrics = record(reply.content, P.METRICS, MetricRecord)
        context.state[LAST_ARRAYS] = copy.deepcopy(record(reply.content, P.ARRAYS, ArrayRecord))
        context.state[LAST_METRICS] = MetricRecord(dict(metrics))
    return reply


def tamper(reply: TrainReply, fault: str) -> TrainReply:
    """``reply`` as the ``fault`` (one of ``TAMPERING``) corrupts it."""
    delta = dict(reply.delta)
    if fault == "nan":
        first = next(k for k, v in delta.items() if v.is_floating_point())
        delta[first] = delta[first].clone().fill_(float("nan"))
    elif fault == "wrong_shape":
        first = next(iter(delta))
        delta[first] = delta[first].flatten()[:-1].clone()
    elif fault == "huge_norm":
        delta = {k: v * 1e4 if v.is_floating_point() else v for k, v in delta.items()}
    elif fault == "future_version":
        return dataclasses.replace(reply, base_version=reply.base_version + 1000)
    elif fault == "unknown_silo":
        return dataclasses.replace(reply, silo=10_000 + reply.silo)
    else:
        raise ValueError(f"not a tampering fault: {fault[:50]!r}")
    return dataclasses.replace(reply, delta=delta, flat=None)
