"""The fedasync ClientApp: one per silo (a SuperNode in deployment, a virtual node in simulation).

It holds no state between messages except caches (the silo's data and a template of the
network, keyed by what they are built from) and, only when a replay fault is injected, its last
reply (``clients.faults``, a Flower mod on the train handler). Every message works on a fresh
copy of the network template (``copy.deepcopy``) into which the received weights are loaded,
so nothing of one message (training state, opacus's hooks and per-sample attributes, a DP
wrapper) can reach the next; opacus's engine, optimiser and loader are made per message
(``clients.dp``). Every handler reads its request with the protocol's ``from_message``
(validated once) and answers with its reply's ``to_message``.

Which data a silo holds comes from its SuperNode's node config:
- ``datalist`` (deployment): the hospital's own data, a Decathlon-format datalist read only
  here (``medical_data.datalist``); the task, network, channels, classes and image size are the
  run's benchmark's (``medical_data.registry``), never the coordinator's data. Its
  ``validation`` list, when there is one, is what the silo evaluates on.
- otherwise ``partition-id`` of the run's benchmark, split as in simulation (the demo and the
  simulation engine).
``partition-id`` is always the silo's id. Everything else (benchmark, split, training settings)
arrives with every message, so the same app runs unchanged under Flower's simulation and
deployment engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from clients.faults import inject_fault
from clients.lab import LAB_SETTING, LabSettingRefused
from clients.node_log import record
from clients.node_task import _relearning_data, _task
from clients.preempt import JobStop, Preempted
from clients.privacy import BudgetExhausted, Refusal, ledger_path
from clients.task import ArrayTask, SiloTask
from clients.unlearn import ArraySamples
from fedasync.devices import pick_device
from fedasync.membership import MembershipStop
from fedasync.tensors import sub
from medical_data.tasks import (
    concat,
    select,
)
from protocol import keys as P
from protocol.config import ClientConfig, SiloErasure
from protocol.erasure_messages import WORK_UNITS
from protocol.ids import digest_all
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

if TYPE_CHECKING:
    from clients.unlearn import Samples

log = logging.getLogger("fedasync.client")

app = ClientApp()

NO_DATA = "no_training_data"
"""Refusal reason of a silo whose training set is empty (every sample erased): a typed reply,
once, after which the server sends it no more training (not an error it would retry)."""


def training_kwargs(
    ccfg: ClientConfig,
    *,
    task: str,
    steps: int,
    device: torch.device,
    stop: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The keyword arguments local training takes with and without DP (``train_local`` and
    ``clients.dp.train_private``): built once, so the two cannot drift apart. ``stop``: the
    check before each local step (``clients.preempt.JobStop.check``)."""
    return {
        "stop": stop,
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
    """Say which silo this node is, how many samples it trains on and of which classes, and
    (when the query brings a salt) the salted digests of their ids (``protocol.ids``)."""
    req = QueryRequest.from_message(msg)
    task = _task(context, req.setup_json, handler="query")
    silo = int(context.node_config["partition-id"])
    ids = task.sample_ids()
    digests = digest_all(req.salt, ids) if req.salt else b""
    return QueryReply(silo, len(ids), tuple(task.class_counts()), digests).to_message(reply_to=msg)


@app.train(mods=[inject_fault])
def train(msg: Message, context: Context) -> Message:
    """Train the received global model locally and reply with the delta (faults: the mod)."""
    req = TrainRequest.from_message(msg)
    setup = req.setup
    try:
        task = _task(context, req.setup_json, relearn=req.relearn, handler="train")
    except LabSettingRefused as e:
        return _refuse(msg, req, e.silo, LAB_SETTING, str(e), recorded=True)
    silo = int(context.node_config["partition-id"])
    ids = task.sample_ids()
    exclude = sorted(set(req.exclude) & set(ids))
    if len(exclude) == len(ids):
        detail = f"silo {silo} has no training data left (all {len(ids)} samples erased)"
        return _refuse(msg, req, silo, NO_DATA, detail)
    samples = len(ids) - len(exclude)
    if req.relearn:  # a relearning attack in a verification run (benchmark silos only)
        assert isinstance(task, ArrayTask)  # (``_task`` refused it on a node's own data)
        data = concat(select(task.data, exclude), _relearning_data(req.setup_json))
        task, exclude, samples = replace(task, data=data), [], len(data)
    ccfg = setup.client
    torch.set_num_threads(ccfg.num_threads)
    device = pick_device(ccfg.device)
    model = task.network()
    model.load_state_dict(req.params)
    steps = ccfg.local_steps if req.local_steps is None else req.local_steps
    stop = JobStop.from_env(sent_at=msg.metadata.created_at)  # a deployed node's erasure
    job = _Job(silo, task, exclude, samples, steps, device, stop)
    try:
        return _train(msg, context, req, job, model)
    except Preempted as e:
        log.info("silo %d's training job %d: %s", silo, req.job_id, e)
        return Message(Error(code=PREEMPTED_CODE, reason=str(e)), reply_to=msg)


@dataclass(frozen=True)
class _Job:
    """One train message's work: the silo, its task, the samples left out, how many it trains
    on, the local steps, the device and the stop check."""

    silo: int
    task: SiloTask
    exclude: list[str]
    samples: int
    steps: int
    device: torch.device
    stop: JobStop


PREEMPTED_CODE = 4301
"""The error code of a training job stopped for its silo's erasure (``clients.preempt``): the
server cancelled the job and drops whatever answers it."""


def _train(
    msg: Message, context: Context, req: TrainRequest, job: _Job, model: torch.nn.Module
) -> Message:
    """The training of ``train``, stopped by ``job.stop`` between two local steps."""
    silo, base, setup, ccfg = job.silo, req.params, req.setup, req.setup.client
    t_train = time.perf_counter()
    if ccfg.dp.enabled:
        from clients.dp import train_private  # opacus only when DP is on

        if not isinstance(job.task, ArrayTask):
            raise ValueError("client.dp: DP-SGD runs on the built-in benchmarks' silos only")
        common = training_kwargs(
            ccfg, task=job.task.spec.task, steps=job.steps, device=job.device, stop=job.stop.check
        )
        sent = {} if req.privacy_dir is None else {P.PRIVACY_DIR: req.privacy_dir}
        try:
            model, stats = train_private(
                model,
                select(job.task.data, job.exclude),
                ccfg.dp,
                ledger=ledger_path(context.node_config, sent, silo),
                silo=silo,
                job_id=req.job_id,  # (no seed: DP draws from the OS's entropy)
                **common,
            )
        except BudgetExhausted as e:
            return _refuse(msg, req, silo, Refusal.BUDGET_EXHAUSTED, str(e), e)
    else:
        stats = job.task.train(
            model,
            steps=job.steps,
            client=ccfg,
            seed=req.seed,
            exclude=job.exclude,
            device=job.device,
            stop=job.stop.check,
        )
    trained_s = time.perf_counter() - t_train
    stats = {**stats, P.TRAIN_SECONDS: trained_s}
    speeds = setup.emulate_speeds
    if speeds:  # a deployment on one machine made heterogeneous: silo i takes 1/speed as long
        wait = max(0.0, min(trained_s * (1.0 / speeds[silo] - 1.0), 3600.0))
        if job.stop.sleep(wait):
            job.stop.check(job.steps, job.steps)
        stats["train_emulated_wait_s"] = wait  # every silo reports it (FedAvg wants equal keys)
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    reply = TrainReply(silo, req.job_id, req.base_version, job.samples, sub(local, base), stats)
    record(
        "train", version=req.base_version, job=req.job_id, silo=silo, samples=job.samples, **stats
    )
    return reply.to_message(reply_to=msg)


def _refuse(
    msg: Message,
    req: TrainRequest,
    silo: int,
    reason: str,
    detail: str,
    e: BudgetExhausted | None = None,
    *,
    recorded: bool = False,
) -> Message:
    """A typed refusal (no arrays): the silo cannot do the work (its privacy budget, ``e``, does
    not allow it, it has no data left, or it was asked for a benchmark instrument on its own
    data, ``recorded`` already in its node log); the server stops sending it training."""
    log.warning("silo %d refuses training: %s", silo, detail)
    if not recorded:
        record("refuse", version=req.base_version, job=req.job_id, silo=silo, reason=reason)
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
    """Evaluate the received model on this silo's own data: its datalist's ``validation``
    list when it has one, else the data it trains on."""
    req = EvaluateRequest.from_message(msg)
    task = _task(context, req.setup_json, handler="evaluate")
    silo = int(context.node_config["partition-id"])
    ccfg = req.setup.client
    torch.set_num_threads(ccfg.num_threads)
    model = task.network()
    model.load_state_dict(req.params)
    res = task.evaluate(model, device=pick_device(ccfg.device))
    rest = {k: v for k, v in res.items() if k not in ("loss", "score")}
    n = task.evaluated_samples()
    reply = EvaluateReply(silo, n, res["loss"], res["score"], rest)
    record("evaluate", silo=silo, samples=n, loss=res["loss"], score=res["score"])
    return reply.to_message(reply_to=msg)


def _stopping_rule(
    task: SiloTask, silo: int, erase: SiloErasure
) -> tuple[MembershipStop | None, Samples | None]:
    """The membership test and the held-out samples it compares with, for ``stop=membership``
    (``SiloTask.heldout_samples``: in simulation the silo's share of the test set, in
    deployment its datalist's validation list). Without them the erasure takes its fixed
    steps, and says so in the log."""
    if erase.stop != "membership":
        return None, None
    held = task.heldout_samples()
    if held is None:
        log.warning(
            "silo %d: unlearning.stop=membership needs held-out samples (a 'validation' list "
            "in the datalist); erasing with the fixed %d steps instead",
            silo,
            erase.steps,
        )
        return None, None
    return MembershipStop(alpha=erase.stop_alpha), held


@app.train("unlearn")
def unlearn(msg: Message, context: Context) -> Message:
    """Erase the forget set from the received model on this silo; reply with the delta and the
    forget data's gradient signature (an orthonormal basis, never the data)."""
    from clients.unlearn import erase_pga, erase_relabel, forget_signature_with_gradient

    req = UnlearnRequest.from_message(msg)
    erase = req.erasure
    task = _task(context, req.setup_json, handler="unlearn")
    silo = int(context.node_config["partition-id"])
    forget_ids = list(req.forget)
    unknown = sorted(set(forget_ids) - set(task.sample_ids()))
    if unknown:  # checked against the silo's own ids (the coordinator holds digests only)
        raise ValueError(
            f"{len(unknown)} of the {len(forget_ids)} sample ids to erase are not held by "
            f"silo {silo}, e.g. {unknown[0][:80]!r}"
        )
    ccfg = req.setup.client
    torch.set_num_threads(ccfg.num_threads)
    device = pick_device(ccfg.device)
    model = task.network()
    base = req.params
    model.load_state_dict(base)
    reference = base if req.reference is None else req.reference
    seed = req.seed
    spec = task.spec
    if erase.method != "pga" and not isinstance(task, ArrayTask):
        raise ValueError(
            f"unlearning.method={erase.method}: a bundle task erases by projected gradient "
            "ascent (pga) only"
        )
    forget = task.forget_samples(forget_ids)
    stop, heldout = _stopping_rule(task, silo, erase) if erase.method == "pga" else (None, None)
    if len(forget) == 0:
        raise ValueError("none of the sample ids to erase is held by this silo")
    if erase.method == "pga":
        stats = erase_pga(
            model,
            forget,
            reference=reference,
            radius=erase.radius,
            task=spec.task,
            seed=seed,
            device=device,
            steps=erase.steps,
            lr=erase.lr,
            batch_size=ccfg.batch_size,
            stop=stop,
            heldout=heldout,
            check_every=erase.stop_every,
            probe=erase.stop_probe,
        )
    else:
        assert isinstance(task, ArrayTask) and isinstance(forget, ArraySamples)
        retain = select(task.data, forget_ids) if forget_ids else None
        stats = erase_relabel(
            model,
            forget.data,
            retain=retain,
            num_classes=spec.num_classes,
            task=spec.task,
            seed=seed,
            device=device,
            steps=erase.steps,
            lr=erase.lr,
            batch_size=ccfg.batch_size,
        )
    signature, gradient = forget_signature_with_gradient(
        model,
        forget,
        task=spec.task,
        batches=erase.signature_batches,
        batch_size=ccfg.batch_size,
        rank=erase.signature_rank,
        seed=seed,
        device=device,
    )
    steps = int(stats.get("steps", erase.steps))
    compared = int(stats.get("compared", 0))
    stats[WORK_UNITS] = erase.work_units(
        steps, compared, int(stats.get("readings", 0)), ccfg.batch_size
    )
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    record("unlearn", version=req.base_version, job=req.job_id, silo=silo, samples=len(forget))
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
