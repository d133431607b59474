"""The fedasync ClientApp: one per silo (a SuperNode in deployment, a virtual node in simulation).

It holds no state between messages except caches (the silo's data and the network object)
and, only when a replay fault is injected, its last reply. Its silo id is the SuperNode's
``partition-id`` node config; everything else (benchmark, split, training settings) arrives
with every message, so the same app runs unchanged under Flower's simulation and deployment
engines.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.local import train_local
from clients.privacy import BudgetExhausted, Refusal, ledger_path
from fedasync.tensors import sub
from medical_data.federation import Federation, SiloData
from medical_data.networks import build_network
from medical_data.tasks import concat, evaluate, pick_device, select, training_data
from protocol import keys as P
from protocol import wire
from protocol.config import ClientConfig, DataConfig, DPConfig, build_silos
from protocol.keys import DP_DELTA, DP_EPSILON, REFUSAL, REFUSAL_DETAIL

log = logging.getLogger("fedasync.client")

app = ClientApp()

LAST_ARRAYS, LAST_METRICS = "last-reply-arrays", "last-reply-metrics"
NO_DATA = "no_training_data"
"""Refusal reason of a silo whose training set is empty (every sample erased): a typed reply,
once, after which the server sends it no more training (not an error it would retry)."""


@lru_cache(maxsize=4)
def _federation(setup_json: str) -> Federation:
    setup = P.loads(setup_json)
    return build_silos(DataConfig(**setup["data"]), setup["num_silos"], setup["seed"])


@lru_cache(maxsize=4)
def _network(setup_json: str) -> torch.nn.Module:
    setup = P.loads(setup_json)
    spec = _federation(setup_json).spec
    name = setup["data"].get("network") or spec.network
    return build_network(name, spec.in_channels, spec.num_classes, spec.image_size)


def _silo(context: Context, setup_json: str) -> tuple[int, SiloData]:
    if "partition-id" not in context.node_config:
        raise ValueError("this SuperNode has no 'partition-id' in its node config")
    silo = int(context.node_config["partition-id"])
    return silo, _silo_data(setup_json, silo)


@lru_cache(maxsize=8)
def _silo_data(setup_json: str, silo: int) -> SiloData:
    setup = P.loads(setup_json)
    return training_data(_federation(setup_json), silo, setup.get("backdoor"), int(setup["seed"]))


@lru_cache(maxsize=4)
def _client_cfg(setup_json: str) -> ClientConfig:
    c = dict(P.loads(setup_json)["client"])
    return ClientConfig(**{**c, "dp": DPConfig(**c.get("dp", {}))})


def training_kwargs(
    ccfg: ClientConfig, *, task: str, steps: int, device: torch.device
) -> dict[str, Any]:
    """The keyword arguments local training takes with and without DP (``train_local`` and
    ``clients.dp.train_private``): built once, so the two cannot drift apart."""
    return {
        "task": task,
        "steps": steps,
        "batch_size": ccfg.batch_size,
        "lr": ccfg.lr,
        "momentum": ccfg.momentum,
        "weight_decay": ccfg.weight_decay,
        "proximal_mu": ccfg.proximal_mu,
        "device": device,
    }


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Say which silo this node is and how many samples it holds."""
    setup = str(msg.content[P.CONFIG][P.SETUP])
    silo, data = _silo(context, setup)
    metrics = MetricRecord({P.SILO: silo, P.NUM_SAMPLES: len(data)})
    return Message(RecordDict({P.METRICS: metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received global model locally and reply with the delta."""
    cfg = msg.content[P.CONFIG]
    setup = str(cfg[P.SETUP])
    fault = str(cfg.get(P.FAULT, ""))
    if fault == "replay" and LAST_ARRAYS in context.state:
        log.warning("fault injection: replaying the previous reply")
        old = RecordDict(
            {P.ARRAYS: context.state[LAST_ARRAYS], P.METRICS: context.state[LAST_METRICS]}
        )
        return Message(old, reply_to=msg)
    if fault == "crash":
        raise RuntimeError("fault injection: silo crashed mid-training")

    fed = _federation(setup)
    silo, data = _silo(context, setup)
    held = len(data)
    data = select(data, [str(x) for x in cfg.get(P.EXCLUDE, [])])  # type: ignore[union-attr]
    if len(data) == 0:
        detail = f"silo {silo} has no training data left (all {held} samples erased)"
        return _refuse(msg, silo, NO_DATA, detail)
    if bool(cfg.get(P.RELEARN, False)):  # a relearning attack in a verification run
        setup_d = P.loads(setup)
        poisoned = _silo_data(setup, int(setup_d["backdoor"]["silo"]))
        data = concat(data, poisoned)
    ccfg = _client_cfg(setup)
    torch.set_num_threads(ccfg.num_threads)
    device = pick_device(ccfg.device)
    model = _network(setup)
    base = wire.decode(P.array_record(msg.content, P.ARRAYS))
    model.load_state_dict(base)
    steps = P.as_int(cfg.get(P.LOCAL_STEPS, ccfg.local_steps))
    common = training_kwargs(ccfg, task=fed.spec.task, steps=steps, device=device)
    t_train = time.perf_counter()
    if ccfg.dp.enabled:
        from clients.dp import train_private  # opacus only when DP is on

        try:
            model, stats = train_private(
                model,
                data,
                ccfg.dp,
                ledger=ledger_path(context.node_config, cfg, silo),
                silo=silo,
                job_id=P.as_int(cfg[P.JOB_ID]),  # (no seed: DP draws from the OS's entropy)
                **common,
            )
        except BudgetExhausted as e:
            return _refuse(msg, silo, Refusal.BUDGET_EXHAUSTED, str(e), e)
    else:
        stats = train_local(model, data, seed=P.as_int(cfg[P.SEED]), **common)
    trained_s = time.perf_counter() - t_train
    stats = {**stats, P.TRAIN_SECONDS: trained_s}
    speeds = P.loads(setup).get("emulate_speeds")
    if speeds:  # a deployment on one machine made heterogeneous: silo i takes 1/speed as long
        wait = max(0.0, min(trained_s * (1.0 / float(speeds[silo]) - 1.0), 3600.0))
        time.sleep(wait)
        stats["train_emulated_wait_s"] = wait  # every silo reports it (FedAvg wants equal keys)
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    delta = sub(local, base)
    base_version = P.as_int(cfg[P.BASE_VERSION])
    claimed_silo = silo
    if fault == "nan":
        first = next(k for k, v in delta.items() if v.is_floating_point())
        delta[first] = delta[first].clone().fill_(float("nan"))
    elif fault == "wrong_shape":
        first = next(iter(delta))
        delta[first] = delta[first].flatten()[:-1].clone()
    elif fault == "huge_norm":
        delta = {k: v * 1e4 if v.is_floating_point() else v for k, v in delta.items()}
    elif fault == "future_version":
        base_version += 1000
    elif fault == "unknown_silo":
        claimed_silo = 10_000 + silo
    metrics = MetricRecord(
        {
            P.SILO: claimed_silo,
            P.BASE_VERSION: base_version,
            P.JOB_ID: P.as_int(cfg[P.JOB_ID]),
            P.NUM_SAMPLES: len(data),
            **stats,
        }
    )
    content = RecordDict({P.ARRAYS: wire.encode(delta), P.METRICS: metrics})
    if bool(cfg.get(P.KEEP_REPLY, False)):
        context.state[LAST_ARRAYS] = wire.encode(delta)
        context.state[LAST_METRICS] = MetricRecord(dict(metrics))
    return Message(content, reply_to=msg)


def _refuse(
    msg: Message, silo: int, reason: str, detail: str, e: BudgetExhausted | None = None
) -> Message:
    """A typed refusal (no arrays): the silo cannot do the work (its privacy budget, ``e``, does
    not allow it, or it has no data left); the server stops sending it training."""
    log.warning("silo %d refuses training: %s", silo, detail)
    cfg = msg.content[P.CONFIG]
    metrics = MetricRecord(
        {
            P.SILO: silo,
            P.BASE_VERSION: P.as_int(cfg[P.BASE_VERSION]),
            P.JOB_ID: P.as_int(cfg[P.JOB_ID]),
            **({DP_EPSILON: e.spent, DP_DELTA: e.delta} if e is not None else {}),
        }
    )
    why = ConfigRecord({REFUSAL: reason, REFUSAL_DETAIL: detail})
    return Message(RecordDict({P.METRICS: metrics, P.CONFIG: why}), reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this silo's own data."""
    cfg = msg.content[P.CONFIG]
    setup = str(cfg[P.SETUP])
    fed = _federation(setup)
    silo, data = _silo(context, setup)
    ccfg = _client_cfg(setup)
    torch.set_num_threads(ccfg.num_threads)
    model = _network(setup)
    model.load_state_dict(wire.decode(P.array_record(msg.content, P.ARRAYS)))
    res = evaluate(model, data, task=fed.spec.task, device=pick_device(ccfg.device))
    metrics = MetricRecord({P.SILO: silo, P.NUM_SAMPLES: len(data), **res})
    return Message(RecordDict({P.METRICS: metrics}), reply_to=msg)


@app.train("unlearn")
def unlearn(msg: Message, context: Context) -> Message:
    """Erase the forget set from the received model on this silo; reply with the delta and the
    forget data's gradient signature (an orthonormal basis, never the data)."""
    from clients.unlearn import erase_pga, erase_relabel, forget_signature

    cfg = msg.content[P.CONFIG]
    setup = str(cfg[P.SETUP])
    fed = _federation(setup)
    silo, data = _silo(context, setup)
    ucfg = P.loads(str(cfg[P.UNLEARN_JSON]))
    forget_ids = [str(x) for x in cfg.get(P.FORGET, [])]  # type: ignore[union-attr]
    forget = select(data, forget_ids, keep=True)
    if len(forget) == 0:
        raise ValueError("none of the sample ids to erase is held by this silo")
    ccfg = _client_cfg(setup)
    torch.set_num_threads(ccfg.num_threads)
    device = pick_device(ccfg.device)
    model = _network(setup)
    base = wire.decode(P.array_record(msg.content, P.ARRAYS))
    model.load_state_dict(base)
    reference = (
        wire.decode(P.array_record(msg.content, P.REFERENCE))
        if P.REFERENCE in msg.content
        else base
    )
    seed = P.as_int(cfg[P.SEED])
    steps, lr = int(ucfg["steps"]), float(ucfg["lr"])
    if ucfg["method"] == "pga":
        stats = erase_pga(
            model,
            forget,
            reference=reference,
            radius=float(ucfg["radius"]),
            task=fed.spec.task,
            seed=seed,
            device=device,
            steps=steps,
            lr=lr,
            batch_size=ccfg.batch_size,
        )
    else:
        retain = select(data, forget_ids) if forget_ids else None
        stats = erase_relabel(
            model,
            forget,
            retain=retain,
            num_classes=fed.spec.num_classes,
            task=fed.spec.task,
            seed=seed,
            device=device,
            steps=steps,
            lr=lr,
            batch_size=ccfg.batch_size,
        )
    signature = forget_signature(
        model,
        forget,
        task=fed.spec.task,
        batches=int(ucfg["signature_batches"]),
        batch_size=ccfg.batch_size,
        rank=int(ucfg["signature_rank"]),
        seed=seed,
        device=device,
    )
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    delta = sub(local, base)
    metrics = MetricRecord(
        {
            P.SILO: silo,
            P.BASE_VERSION: P.as_int(cfg[P.BASE_VERSION]),
            P.JOB_ID: P.as_int(cfg[P.JOB_ID]),
            P.NUM_SAMPLES: len(forget),
            "signature_rank": signature.rank,
            **{k: float(v) for k, v in stats.items()},
        }
    )
    content = RecordDict(
        {
            P.ARRAYS: wire.encode(delta),
            P.SIGNATURE: wire.encode(
                {"basis": signature.basis.to(getattr(torch, ucfg["signature_dtype"]))}
            ),
            P.METRICS: metrics,
            P.CONFIG: ConfigRecord({P.SIGNATURE_NAMES: list(signature.names)}),
        }
    )
    return Message(content, reply_to=msg)
