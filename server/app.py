"""The fedasync ServerApp: builds the global model and runs the asynchronous loop.

``make_server_app(cfg, run_dir)`` is what the simulation launcher hands to Flower's simulation
engine. The module-level ``app`` is the same ServerApp for Flower's deployment engine
(``flwr run``), which reads the whole config as JSON from the run config key ``config-json``
and runs on the wall clock.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from clients import protocol as P
from clients import wire
from clients.config import build_silos
from clients.local import evaluate
from medical_data.federation import Federation
from medical_data.networks import build_network
from server.config import FedAsyncConfig, from_container
from server.loop import AsyncServer
from server.roster import exchange
from server.summary import build_summary, write_summary

log = logging.getLogger("fedasync.server")


def _federation(cfg: FedAsyncConfig) -> Federation:
    return build_silos(cfg.data, cfg.silos.count, cfg.run.seed)


def initial_model(cfg: FedAsyncConfig) -> torch.nn.Module:
    """The benchmark's network, initialised from ``run.seed``."""
    spec = _federation(cfg).spec
    torch.manual_seed(cfg.run.seed)
    return build_network(
        cfg.data.network or spec.network, spec.in_channels, spec.num_classes, spec.image_size
    )


def evaluate_silos(srv: AsyncServer, timeout_s: float = 300.0) -> dict[int, dict[str, float]]:
    """Ask every silo to evaluate the current global model on its own data."""
    cfg_rec = ConfigRecord({P.SETUP: srv.setup_json})
    silos = sorted(srv.roster)
    msgs = [
        Message(
            RecordDict({P.ARRAYS: wire.encode(srv.params), P.CONFIG: cfg_rec}),
            dst_node_id=srv.roster[s],
            message_type=P.EVALUATE,
        )
        for s in silos
    ]
    out: dict[int, dict[str, float]] = {}
    for silo, reply in zip(silos, exchange(srv.grid, msgs, timeout_s)):
        if reply is None or reply.has_error():
            log.warning("silo %d did not evaluate the final model", silo)
            continue
        m = reply.content[P.METRICS]
        out[silo] = {"loss": float(m["loss"]), "score": float(m["score"])}  # type: ignore[arg-type]
        srv.events.write("silo_eval", t=srv.clock.now, version=srv.version, silo=silo, **out[silo])
    return out


def run_server(
    grid: Grid, cfg: FedAsyncConfig, run_dir: Path, *, wall_clock: bool = False
) -> dict[str, Any]:
    """Run one federated job on ``grid``; write metrics.jsonl, checkpoints and summary.json."""
    t0 = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    fed = _federation(cfg)
    model = initial_model(cfg)
    task = fed.spec.task

    def evaluate_fn(params: dict[str, torch.Tensor]) -> dict[str, float]:
        model.load_state_dict(params)
        return evaluate(model, fed.test, task=task)

    srv = AsyncServer(cfg, grid, run_dir, model.state_dict(), evaluate_fn, wall_clock=wall_clock)
    try:
        srv.events.write(
            "start",
            t=0.0,
            version=0,
            mode=cfg.server.mode,
            clock=srv.clock.kind,
            benchmark=cfg.data.benchmark,
            silos=cfg.silos.count,
        )
        srv.connect()
        resumed = cfg.run.resume and srv.resume()
        if cfg.run.resume and not resumed:
            log.warning("run.resume=true but %s has no checkpoint: starting afresh", run_dir)
        if not resumed:
            srv.evaluate()
        progress = None
        if cfg.run.progress:
            from tqdm import tqdm

            progress = tqdm(
                total=cfg.run.budget_s,
                desc=f"{cfg.server.mode:8s}",
                unit="s",
                initial=srv.clock.now,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]",
            )
            srv.progress = progress
        srv.run()
        if not srv.evals or srv.evals[-1]["version"] != srv.version:
            srv.evaluate()
        if progress is not None:
            progress.close()
        srv.checkpoint()
        silo_evals = evaluate_silos(srv) if cfg.server.evaluate_silos else {}
        metric = "accuracy" if task == "classification" else "dice"
        summary = build_summary(
            srv, metric=metric, wall_time_s=time.monotonic() - t0, silo_evals=silo_evals
        )
        srv.events.write(
            "end", t=srv.clock.now, version=srv.version, final_score=summary["final_accuracy"]
        )
        write_summary(run_dir / "summary.json", summary)
        return summary
    finally:
        srv.events.close()


def make_server_app(
    cfg: FedAsyncConfig, run_dir: Path, result: dict[str, Any] | None = None
) -> ServerApp:
    """A ServerApp bound to ``cfg`` for the simulation engine; its summary lands in ``result``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        summary = run_server(grid, cfg, run_dir)
        if result is not None:
            result.update(summary)

    return app


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Deployment entry point: the config arrives as JSON in run config ``config-json``."""
    raw = context.run_config.get("config-json", "{}")
    cfg = from_container(P.loads(str(raw)))
    run_server(grid, cfg, Path(cfg.run.out_dir) / cfg.run.name, wall_clock=True)
