"""Flower's own synchronous FedAvg strategy driving our ClientApp: the deployment baseline.

FedAvg (McMahan et al. 2017) as Flower 1.42 ships it (``flwr.serverapp.strategy.FedAvg`` and
its ``Strategy.start`` round loop, ``grid.send_and_receive``: every node each round, a barrier;
in deployment Flower polls for the replies every 3 s, capped here at ``server.reply_pull.POLL_INTERVAL_S``
as fedasync's own loop polls). ``benchmarks/deployment_overhead.py`` runs it on the
same local TLS deployment and ClientApp as fedasync's ServerApp. What the subclass changes to
speak our protocol (``protocol/keys.py``):

- ``configure_train``: Flower puts one shared record in every message; ours are
  ``protocol.messages.TrainRequest``s with their own config (setup-json, job-id, base-version
  = the round's model version, a seed per silo and job) and the model packed by
  ``protocol/wire.py`` (encoded once per round);
- ``aggregate_train``: our replies (``TrainReply``; a malformed one is dropped with a warning)
  carry the local *delta*, not the local model, weighted by
  ``num-samples``: ``x <- x + sum_i n_i d_i / sum_i n_i``, which is FedAvg's sample-weighted mean
  of the local models since all started from ``x``;
- the run ends after ``run.max_versions`` rounds or, on the wall clock, at the first round that
  would start ``run.budget_s`` seconds after the first dispatch;
- the global model is evaluated on the held-out test set after every round: the coordinator's
  own (``data.server_test``) in deployment, which reads no silo data; without one the silos
  evaluate the final model on their own data (federated, weighted by sample count);
- the outputs are the ServerApp's usual ones: ``metrics.jsonl`` (events start, eval, update,
  end; ``t`` in wall seconds since the ServerApp started) and ``summary.json`` with each
  train message's dispatch, take and training seconds.

Deployment only: ``fedasync deploy local`` with ``serverapp="server.flower_sync:app"``
(``simulations.deploy.deploy_local``), as the benchmark does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedasync import seeds
from fedasync.aggregators import fedavg
from fedasync.events import EventLog
from fedasync.tensors import add
from fedasync.types import Params, Update
from medical_data.federation import SiloData
from medical_data.registry import get_spec
from medical_data.tasks import evaluate
from protocol import keys as P
from protocol import wire
from protocol.messages import Malformed, TrainReply, TrainRequest
from protocol.transport import cap_sleep, short_backoff
from server.app import _log_to
from server.benchmark import federation, initial_model, server_test_set
from server.clock import client_setup
from server.config import FedAsyncConfig
from server.evaluation import evaluate_on_nodes, weighted_mean
from server.reply_pull import POLL_INTERVAL_S
from server.summary import write_summary

log = logging.getLogger("fedasync.server")


class BudgetSpent(Exception):
    """The wall budget is spent: no further round starts."""


def mean_delta_step(params: Params, deltas: list[tuple[Params, int]]) -> Params:
    """``params + sum_i n_i d_i / sum_i n_i`` for ``deltas`` = [(d_i, n_i)]; integer tensors
    (buffers) stay those of ``params``."""
    step = fedavg([Update(str(i), 0, d, n) for i, (d, n) in enumerate(deltas)])
    return add(params, step)


class ProtocolFedAvg(FedAvg):
    """Flower's FedAvg, sending our train messages and folding our replies' deltas.

    ``params`` is the global model (the ``arrays`` Strategy.start hands around are its wire
    encoding); ``messages`` records every train message: silo, round, dispatched and taken
    (wall seconds since the ServerApp started), the silo's training seconds and when the
    ClientApp created its reply (same axis).
    """

    def __init__(self, cfg: FedAsyncConfig, params: Params, events: EventLog, t0: float):
        """FedAvg over all ``cfg.silos.count`` nodes from ``params``; events to ``events``,
        times relative to ``t0`` (``time.monotonic()`` when the ServerApp started)."""
        n = cfg.silos.count
        super().__init__(
            fraction_evaluate=0.0,
            min_train_nodes=n,
            min_available_nodes=n,
            weighted_by_key=P.NUM_SAMPLES,
            arrayrecord_key=P.ARRAYS,
            configrecord_key=P.CONFIG,
        )
        self.cfg, self.params, self.events, self.t0 = cfg, params, events, t0
        self.unix0 = time.time() - (time.monotonic() - t0)  # t0 on the Unix clock
        self.setup_json = client_setup(cfg).to_json()
        self.version = 0
        self.next_job_id = 0
        self.started_at: float | None = None
        self.inflight: dict[int, dict[str, Any]] = {}  # job id -> message record
        self.messages: list[dict[str, Any]] = []

    def now(self) -> float:
        """Wall seconds since the ServerApp started."""
        return time.monotonic() - self.t0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's node sampling (all nodes), then one message of ours per node."""
        if self.started_at is not None and self.now() - self.started_at >= self.cfg.run.budget_s:
            raise BudgetSpent
        sampled = list(super().configure_train(server_round, arrays, config, grid))
        record = wire.encode(self.params)
        out = []
        for m in sampled:
            job_id = self.next_job_id
            self.next_job_id += 1
            node = int(m.metadata.dst_node_id)
            seed = seeds.int_seed(self.cfg.run.seed, "job.train", node, job_id)
            req = TrainRequest(self.setup_json, job_id, self.version, seed, self.params)
            out.append(req.to_message(node, ttl=self.cfg.server.reply_timeout_s, arrays=record))
            self.inflight[job_id] = {"round": server_round, "node": node, "job": job_id}
        t = self.now()
        if self.started_at is None:
            self.started_at = t
        for rec in self.inflight.values():
            rec.setdefault("dispatched", t)
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The sample-weighted mean of the replies' deltas, added to the global model."""
        taken = self.now()
        valid, _ = self._check_and_log_replies(list(replies), is_train=True)
        deltas: list[tuple[Params, int]] = []
        for reply in valid:
            try:
                got = TrainReply.from_message(reply)
            except Malformed as e:
                log.warning("malformed reply dropped: %s", e)
                continue
            rec = self.inflight.pop(got.job_id, None)
            if rec is None or got.base_version != self.version:
                log.warning("reply to an unknown job or another version: dropped")
                continue
            deltas.append((got.delta, got.num_samples))
            rec.update(
                silo=got.silo,
                taken=taken,
                num_samples=got.num_samples,
                train_seconds=got.metrics.get(P.TRAIN_SECONDS, float("nan")),
                reply_created=reply.metadata.created_at - self.unix0,
            )
            self.messages.append(rec)
            self.events.write(
                "update",
                t=taken,
                version=self.version + 1,
                silo=rec["silo"],
                job=rec["job"],
                staleness=0,
                **{k: v for k, v in got.metrics.items() if k.startswith("train_")},
            )
        self.inflight.clear()  # unanswered messages of this round are abandoned
        if not deltas:
            return None, None
        self.params = mean_delta_step(self.params, deltas)
        self.version += 1
        self.events.write("version", t=self.now(), version=self.version)
        return wire.encode(self.params), MetricRecord({"updates": len(deltas)})


def run_flower_fedavg(
    grid: Grid, cfg: FedAsyncConfig, run_dir: Path, *, data_here: bool = True
) -> dict[str, Any]:
    """Run Flower's FedAvg with our protocol on ``grid``; write metrics.jsonl and summary.json.

    ``data_here`` as for ``server.app.run_server``: False (the deployment ServerApp) reads no
    silo data; the model is then evaluated after every round on ``data.server_test`` or,
    without one, by the silos once at the end (federated, weighted by sample count)."""
    t0 = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    test: SiloData | None
    if data_here:
        fed = federation(cfg)
        spec, test = fed.spec, fed.test
    else:
        spec = get_spec(cfg.data.benchmark)
        test = None if cfg.data.server_test is None else server_test_set(cfg, spec)
    model = initial_model(cfg, spec)
    task = spec.task
    events = EventLog(run_dir / "metrics.jsonl")
    strategy = ProtocolFedAvg(cfg, model.state_dict(), events, t0)
    evals: list[dict[str, float]] = []

    def record(res: dict[str, float]) -> None:
        rec = {"t": strategy.now(), "version": strategy.version, **res}
        evals.append(rec)
        events.write("eval", **rec)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if test is None:
            return None  # (federated: once, at the end)
        model.load_state_dict(strategy.params)
        res = evaluate(model, test, task=task)
        record(res)
        return MetricRecord({k: float(v) for k, v in res.items()})

    events.write("start", t=0.0, version=0, mode="flower-fedavg", clock="wall")
    try:
        strategy.start(
            grid,
            wire.encode(strategy.params),
            num_rounds=cfg.run.max_versions or 1_000_000,
            timeout=cfg.server.reply_timeout_s,
            evaluate_fn=evaluate_fn,
        )
    except BudgetSpent:
        pass
    if test is None:
        nodes = sorted(grid.get_node_ids())
        params = strategy.params
        record(weighted_mean(evaluate_on_nodes(grid, strategy.setup_json, nodes, params)))
    metric = "accuracy" if task == "classification" else "dice"
    final = evals[-1] if evals else {"score": float("nan"), "loss": float("nan")}
    per_silo: dict[str, dict[str, float]] = {}
    for rec in strategy.messages:
        per_silo.setdefault(str(rec["silo"]), {"accepted": 0, "rejected": 0})["accepted"] += 1
    summary = {
        "mode": "flower-fedavg",
        "clock": "wall",
        "metric": metric,
        "versions": strategy.version,
        "wall_time_s": time.monotonic() - t0,
        "training_started_s": strategy.started_at,
        "final_score": final["score"],
        "best_score": max((e["score"] for e in evals), default=float("nan")),
        "evals": evals,
        "per_silo": per_silo,
        "updates_rejected_total": 0,
        "messages": strategy.messages,
    }
    events.write("end", t=strategy.now(), version=strategy.version, final_score=final["score"])
    events.close()
    write_summary(run_dir / "summary.json", summary)
    return summary


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Deployment entry point: the config arrives as the run config's flat keys. The transport
    is tuned as fedasync's ServerApp's is, so that the comparison measures the loops, not
    Flower's sleeps: object pulls retry after 10 ms (``protocol.transport.short_backoff``), and
    ``send_and_receive``'s fixed 3 s wait between polls for the round's replies is capped at
    ``server.reply_pull.POLL_INTERVAL_S``, the poll of fedasync's loop (``protocol.transport.cap_sleep``)."""
    from flwr.superlink.grid import http_grid

    from server.run_config import config_from_run_config

    cfg = config_from_run_config(context.run_config)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    _log_to(run_dir / "run.log")
    short_backoff(http_grid, "pull_objects")
    cap_sleep(http_grid, POLL_INTERVAL_S)
    run_flower_fedavg(grid, cfg, run_dir, data_here=False)
