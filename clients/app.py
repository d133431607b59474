"""The fedasync ClientApp: one per silo (a SuperNode in deployment, a virtual node in simulation).

It holds no state between messages except caches (the silo's data and the network object,
keyed by the run's setup JSON) and, only when a replay fault is injected, its last reply
(``clients.faults``, a Flower mod on the train handler). Every handler reads its request with
the protocol's ``from_message`` (validated once) and answers with its reply's ``to_message``. Its silo id is the SuperNode's
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
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.faults import inject_fault
from clients.local import train_local
from clients.privacy import BudgetExhausted, Refusal, ledger_path
from fedasync.tensors import sub
from medical_data.federation import Federation, SiloData
from medical_data.networks import build_network
from medical_data.tasks import (
    concat,
    evaluate,
    pick_device,
    relearning_data,
    select,
    training_data,
)
from protocol import keys as P
from protocol.config import ClientConfig, build_silos, parse_setup
from protocol.messages import (
    EvaluateReply,
    EvaluateRequest,
    QueryReply,
    QueryRequest,
    TrainRefusal,
    TrainReply,
    TrainRequest,
    UnlearnReply,
    UnlearnRequest,
)

log = logging.getLogger("fedasync.client")

app = ClientApp()

NO_DATA = "no_training_data"
"""Refusal reason of a silo whose training set is empty (every sample erased): a typed reply,
once, after which the server sends it no more training (not an error it would retry)."""


@lru_cache(maxsize=4)
def _federation(setup_json: str) -> Federation:
    setup = parse_setup(setup_json)
    return build_silos(setup.data, setup.num_silos, setup.seed)


@lru_cache(maxsize=4)
def _network(setup_json: str) -> torch.nn.Module:
    spec = _federation(setup_json).spec
    name = parse_setup(setup_json).data.network or spec.network
    return build_network(name, spec.in_channels, spec.num_classes, spec.image_size)


def _silo(context: Context, setup_json: str) -> tuple[int, SiloData]:
    if "partition-id" not in context.node_config:
        raise ValueError("this SuperNode has no 'partition-id' in its node config")
    silo = int(context.node_config["partition-id"])
    return silo, _silo_data(setup_json, silo)


@lru_cache(maxsize=8)
def _silo_data(setup_json: str, silo: int) -> SiloData:
    setup = parse_setup(setup_json)
    return training_data(_federation(setup_json), silo, setup.backdoor, setup.seed)


@lru_cache(maxsize=2)
def _relearning_data(setup_json: str) -> SiloData:
    setup = parse_setup(setup_json)
    if not setup.backdoor or "silo" not in setup.backdoor:
        raise ValueError("a relearning job in a run whose setup names no backdoored silo")
    return relearning_data(_federation(setup_json), setup.backdoor, setup.seed)


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
    req = QueryRequest.from_message(msg)
    silo, data = _silo(context, req.setup_json)
    return QueryReply(silo, len(data)).to_message(reply_to=msg)


@app.train(mods=[inject_fault])
def train(msg: Message, context: Context) -> Message:
    """Train the received global model locally and reply with the delta (faults: the mod)."""
    req = TrainRequest.from_message(msg)
    setup = req.setup
    fed = _federation(req.setup_json)
    silo, data = _silo(context, req.setup_json)
    held = len(data)
    data = select(data, list(req.exclude))
    if len(data) == 0:
        detail = f"silo {silo} has no training data left (all {held} samples erased)"
        return _refuse(msg, req, silo, NO_DATA, detail)
    if req.relearn:  # a relearning attack in a verification run
        data = concat(data, _relearning_data(req.setup_json))
    ccfg = setup.client
    torch.set_num_threads(ccfg.num_threads)
    device = pick_device(ccfg.device)
    model = _network(req.setup_json)
    base = req.params
    model.load_state_dict(base)
    steps = ccfg.local_steps if req.local_steps is None else req.local_steps
    common = training_kwargs(ccfg, task=fed.spec.task, steps=steps, device=device)
    t_train = time.perf_counter()
    if ccfg.dp.enabled:
        from clients.dp import train_private  # opacus only when DP is on

        sent = {} if req.privacy_dir is None else {P.PRIVACY_DIR: req.privacy_dir}
        try:
            model, stats = train_private(
                model,
                data,
                ccfg.dp,
                ledger=ledger_path(context.node_config, sent, silo),
                silo=silo,
                job_id=req.job_id,  # (no seed: DP draws from the OS's entropy)
                **common,
            )
        except BudgetExhausted as e:
            return _refuse(msg, req, silo, Refusal.BUDGET_EXHAUSTED, str(e), e)
    else:
        stats = train_local(model, data, seed=req.seed, **common)
    trained_s = time.perf_counter() - t_train
    stats = {**stats, P.TRAIN_SECONDS: trained_s}
    speeds = setup.emulate_speeds
    if speeds:  # a deployment on one machine made heterogeneous: silo i takes 1/speed as long
        wait = max(0.0, min(trained_s * (1.0 / speeds[silo] - 1.0), 3600.0))
        time.sleep(wait)
        stats["train_emulated_wait_s"] = wait  # every silo reports it (FedAvg wants equal keys)
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    reply = TrainReply(silo, req.job_id, req.base_version, len(data), sub(local, base), stats)
    return reply.to_message(reply_to=msg)


def _refuse(
    msg: Message,
    req: TrainRequest,
    silo: int,
    reason: str,
    detail: str,
    e: BudgetExhausted | None = None,
) -> Message:
    """A typed refusal (no arrays): the silo cannot do the work (its privacy budget, ``e``, does
    not allow it, or it has no data left); the server stops sending it training."""
    log.warning("silo %d refuses training: %s", silo, detail)
    refusal = TrainRefusal(
        silo,
        req.job_id,
        req.base_version,
        reason,
        detail,
        epsilon=None if e is None else e.spent,
        delta=None if e is None else e.delta,
    )
    return refusal.to_message(reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this silo's own data."""
    req = EvaluateRequest.from_message(msg)
    fed = _federation(req.setup_json)
    silo, data = _silo(context, req.setup_json)
    ccfg = req.setup.client
    torch.set_num_threads(ccfg.num_threads)
    model = _network(req.setup_json)
    model.load_state_dict(req.params)
    res = evaluate(model, data, task=fed.spec.task, device=pick_device(ccfg.device))
    rest = {k: v for k, v in res.items() if k not in ("loss", "score")}
    reply = EvaluateReply(silo, len(data), res["loss"], res["score"], rest)
    return reply.to_message(reply_to=msg)


@app.train("unlearn")
def unlearn(msg: Message, context: Context) -> Message:
    """Erase the forget set from the received model on this silo; reply with the delta and the
    forget data's gradient signature (an orthonormal basis, never the data)."""
    from clients.unlearn import erase_pga, erase_relabel, forget_signature_with_gradient

    req = UnlearnRequest.from_message(msg)
    erase = req.erasure
    fed = _federation(req.setup_json)
    silo, data = _silo(context, req.setup_json)
    forget_ids = list(req.forget)
    forget = select(data, forget_ids, keep=True)
    if len(forget) == 0:
        raise ValueError("none of the sample ids to erase is held by this silo")
    ccfg = req.setup.client
    torch.set_num_threads(ccfg.num_threads)
    device = pick_device(ccfg.device)
    model = _network(req.setup_json)
    base = req.params
    model.load_state_dict(base)
    reference = base if req.reference is None else req.reference
    seed = req.seed
    if erase.method == "pga":
        stats = erase_pga(
            model,
            forget,
            reference=reference,
            radius=erase.radius,
            task=fed.spec.task,
            seed=seed,
            device=device,
            steps=erase.steps,
            lr=erase.lr,
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
            steps=erase.steps,
            lr=erase.lr,
            batch_size=ccfg.batch_size,
        )
    signature, gradient = forget_signature_with_gradient(
        model,
        forget,
        task=fed.spec.task,
        batches=erase.signature_batches,
        batch_size=ccfg.batch_size,
        rank=erase.signature_rank,
        seed=seed,
        device=device,
    )
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    reply = UnlearnReply(
        silo,
        req.job_id,
        req.base_version,
        len(forget),
        delta=sub(local, base),
        basis=signature.basis.to(getattr(torch, erase.signature_dtype)),
        names=tuple(signature.names),
        metrics={"signature_rank": signature.rank, **{k: float(v) for k, v in stats.items()}},
        gradient=gradient.to(getattr(torch, erase.signature_dtype)),
    )
    return reply.to_message(reply_to=msg)
