"""The fedasync ServerApp: builds the global model and runs the asynchronous loop.

``make_server_app(cfg, run_dir)`` is what the simulation launcher hands to Flower's simulation
engine: everything runs on one machine, so the server builds the benchmark's federation too
(its pooled test set to evaluate on, the silos' sample ids to check erasures against). The
module-level ``app`` is the ServerApp for Flower's deployment engine (``flwr run``): it reads
the whole config as JSON from the run config key ``config-json``, runs on the wall clock and
holds no silo's data (``run_server(..., data_here=False)``):

- the network comes from the benchmark's spec in the registry (no data is read);
- what it knows of the silos' data is what they report at the roster query: sample and class
  counts, and the salted digests of their sample ids (``protocol.ids``), against which the
  erasure service checks requests (each silo checks them again against its own ids);
- the global model is evaluated on the coordinator's own held-out set (``data.server_test``, a
  Decathlon datalist) during the run, or, without one, by the silos on their own data at the
  end (federated: their mean weighted by sample count; ``FederatedEvaluation``).

A little over 500 lines because it also holds what a run does around the loop: the
erasure coordinator's and the service's set-up, evaluation (central or federated), and the
run's end (summary, checkpoint, stop on a signal).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedasync.errors import ConfigError, DataError
from medical_data.federation import Federation, SiloData
from medical_data.networks import build_network
from medical_data.registry import BenchmarkSpec, get_spec
from medical_data.tasks import evaluate
from protocol import ids as digests
from protocol import wire
from protocol.config import build_silos, to_dict
from protocol.ids import fraction_ids
from protocol.messages import EvaluateReply, EvaluateRequest
from protocol.reading import ErrorReply, Malformed
from protocol.transport import short_backoff
from server.checkpoint import resume
from server.config import FedAsyncConfig
from server.loop import AsyncServer
from server.roster import exchange
from server.summary import build_summary, write_summary
from server.unlearning import ErasureCoordinator

log = logging.getLogger("fedasync.server")

NOT_MEASURED = {"loss": math.nan, "score": math.nan}
"""What a federated evaluation gives while silos hold jobs: not measured (never delays them)."""


def _federation(cfg: FedAsyncConfig) -> Federation:
    return build_silos(cfg.data, cfg.silos.count, cfg.run.seed)


def initial_model(cfg: FedAsyncConfig, spec: BenchmarkSpec | None = None) -> torch.nn.Module:
    """The benchmark's network, initialised from ``run.seed``; sized by ``spec`` (default: the
    federation's, which reads the data: simulation only)."""
    spec = _federation(cfg).spec if spec is None else spec
    torch.manual_seed(cfg.run.seed)
    return build_network(
        cfg.data.network or spec.network, spec.in_channels, spec.num_classes, spec.image_size
    )


def server_test_set(cfg: FedAsyncConfig, spec: BenchmarkSpec) -> SiloData:
    """The coordinator's own held-out set, ``data.server_test``: the ``test`` list of that
    Decathlon datalist, else its ``validation``, else its ``training`` list (each entry with
    its label). DataError naming the key when the file is missing or holds none."""
    from medical_data.datalist import has_list, load_datalist

    path = Path(str(cfg.data.server_test)).expanduser()
    if not path.is_file():
        raise DataError(f"data.server_test={path}: no such file (the coordinator's test set)")
    for key in ("test", "validation", "training"):
        if has_list(path, key):
            return load_datalist(path, spec, key, silo=-1)
    raise DataError(f"data.server_test={path}: no test, validation or training list")


def write_server_test(cfg: FedAsyncConfig, folder: Path) -> Path:
    """Write the benchmark's pooled held-out test set (what a simulation evaluates on) to
    ``folder`` as a Decathlon datalist, for a coordinator to own as ``data.server_test``:
    ``fedasync deploy local`` does, for its silos that split the benchmark. Reads the data:
    run where the benchmark is (the demo's one machine), never in the deployment ServerApp."""
    from medical_data.datalist import write_datalist

    fed = _federation(cfg)
    return write_datalist(folder, {"test": fed.test}, fed.spec.task)


def evaluate_on_nodes(
    grid: Grid,
    setup_json: str,
    nodes: list[int],
    params: dict[str, torch.Tensor],
    timeout_s: float = 300.0,
) -> dict[int, dict[str, float]]:
    """Ask each of ``nodes`` to evaluate ``params`` on its silo's own data; each answer's
    ``loss``, ``score`` and ``num_samples`` by the silo it names (a node that did not answer is
    left out, with a warning)."""
    arrays = wire.encode(params)  # one encoding for every silo's message
    request = EvaluateRequest(setup_json, params)
    msgs = [request.to_message(n, arrays=arrays) for n in nodes]
    out: dict[int, dict[str, float]] = {}
    for node, reply in zip(nodes, exchange(grid, msgs, timeout_s)):
        try:
            if reply is None:
                raise Malformed("no reply")
            got = EvaluateReply.from_message(reply)
        except (ErrorReply, Malformed) as e:
            log.warning("node %d did not evaluate the model: %s", node, e)
            continue
        out[got.silo] = {"loss": got.loss, "score": got.score, "num_samples": got.num_samples}
    return out


def evaluate_silos(
    srv: AsyncServer, timeout_s: float = 300.0, params: dict[str, torch.Tensor] | None = None
) -> dict[int, dict[str, float]]:
    """Every silo's evaluation of ``params`` (default: the current global model) on its own
    data (``evaluate_on_nodes``), each written as a ``silo_eval`` event."""
    params = srv.params if params is None else params
    nodes = [srv.roster[s] for s in sorted(srv.roster)]
    out = evaluate_on_nodes(srv.grid, srv.setup_json, nodes, params, timeout_s)
    for silo, res in sorted(out.items()):
        srv.events.write("silo_eval", t=srv.clock.now, version=srv.version, silo=silo, **res)
    return out


def weighted_mean(per_silo: dict[int, dict[str, float]]) -> dict[str, float]:
    """The silos' loss and score averaged with their evaluated sample counts as weights, and
    how many silos and samples that is (``eval_silos``, ``eval_samples``); NOT_MEASURED when
    no silo evaluated anything."""
    n = sum(r["num_samples"] for r in per_silo.values())
    if n <= 0:
        return dict(NOT_MEASURED)
    return {
        "loss": sum(r["loss"] * r["num_samples"] for r in per_silo.values()) / n,
        "score": sum(r["score"] * r["num_samples"] for r in per_silo.values()) / n,
        "eval_silos": len(per_silo),
        "eval_samples": n,
    }


class FederatedEvaluation:
    """``evaluate_fn`` of a coordinator without a test set: every silo evaluates the model on
    its own data (``evaluate_silos``) and the result is their mean weighted by sample count.

    It asks the silos only when none holds a job (after a sync round) or once the run is over
    (``final``): a message to a silo that is training would wait for it, and the loop with it.
    Otherwise (an erasure boundary mid-run) it answers NOT_MEASURED. ``srv`` is set once the
    server exists; ``per_silo`` keeps the last answers (the summary's per-silo evaluations)."""

    def __init__(self) -> None:
        self.srv: AsyncServer | None = None
        self.final = False
        self.per_silo: dict[int, dict[str, float]] = {}

    def __call__(self, params: dict[str, torch.Tensor]) -> dict[str, float]:
        """The federated evaluation of ``params`` (see the class)."""
        srv = self.srv
        if srv is None or (not self.final and len(srv.inflight)):
            return dict(NOT_MEASURED)
        self.per_silo = evaluate_silos(srv, params=params)
        return weighted_mean(self.per_silo)


def run_server(
    grid: Grid,
    cfg: FedAsyncConfig,
    run_dir: Path,
    *,
    wall_clock: bool = False,
    data_here: bool = True,
) -> dict[str, Any]:
    """Run one federated job on ``grid``; write metrics.jsonl, checkpoints and summary.json.

    ``data_here``: the benchmark's federation may be built in this process (simulation, and the
    tests that play a deployment in-process); False for the deployment ServerApp, which holds
    no silo's data (module docstring)."""
    t0 = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    fed: Federation | None = _federation(cfg) if data_here else None
    test: SiloData | None
    if fed is not None:
        spec, test, on = fed.spec, fed.test, "benchmark test set"
    else:
        spec = get_spec(cfg.data.benchmark)
        _check_deployable(cfg)
        test = None if cfg.data.server_test is None else server_test_set(cfg, spec)
        on = "silos (federated)" if test is None else "coordinator test set (data.server_test)"
    model = initial_model(cfg, spec)
    task = spec.task
    federated = FederatedEvaluation() if test is None else None
    run_cfg = cfg
    if federated is not None:
        log.info(
            "no coordinator test set (data.server_test): the silos evaluate the model on their "
            "own data at the end%s (federated, weighted by sample count)",
            " and after every round" if cfg.server.mode == "sync" else "",
        )
        run_cfg = replace(cfg, server=replace(cfg.server, eval_every=2**62))  # never mid-run

    watch = (
        _verifier(cfg, fed, spec=spec, test=test)
        if cfg.backdoor.enabled and cfg.backdoor.watch
        else None
    )
    watched = _watched_ids(cfg, fed) if watch is not None else []

    def evaluate_fn(params: dict[str, torch.Tensor]) -> dict[str, float]:
        if federated is not None:
            return federated(params)
        assert test is not None
        model.load_state_dict(params)
        res = evaluate(model, test, task=task)
        if watch is not None:  # the backdoor over time (backdoor.watch)
            report = watch(params, cfg.backdoor.silo, watched)
            res.update({f"bd_{k}": v for k, v in report.items() if k != "test_accuracy"})
        return res

    if not cfg.run.resume:
        _start_afresh(run_dir)
    srv = AsyncServer(
        run_cfg,
        grid,
        run_dir,
        model.state_dict(),
        evaluate_fn,
        wall_clock=wall_clock,
        sample_ids_fn=None if fed is None else (lambda silo: fed.silos[silo].sample_ids),
    )
    if federated is not None:
        federated.srv = srv
    if fed is None:
        srv.id_salt = digests.new_salt()  # the silos report their ids' digests under it
    service = None
    try:
        srv.events.write(
            "start",
            t=0.0,
            version=0,
            mode=cfg.server.mode,
            clock=srv.clock.kind,
            benchmark=cfg.data.benchmark,
            silos=cfg.silos.count,
            evaluation=on,
        )
        srv.connect()
        _check_reports(srv, spec)
        if cfg.erasures or cfg.unlearning.service:
            service = _attach_erasure(srv, cfg, fed, run_dir, spec=spec, test=test)
        resumed = cfg.run.resume and resume(srv)
        if cfg.run.resume and not resumed:
            log.warning("run.resume=true but %s has no checkpoint: starting afresh", run_dir)
        if not resumed and federated is None:
            srv.evaluate()
        progress = None
        if cfg.run.progress:
            from tqdm import tqdm

            from fedasync.progress import progress as make_progress

            progress = make_progress(
                cfg.run.budget_s,
                f"{cfg.server.mode:8s}",
                tty_bar=tqdm,
                unit="s",
                initial=srv.clock.now,
                mininterval=0.5,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]",
            )
            srv.progress = progress
        srv.run()
        if federated is not None:
            federated.final = True  # the run is over: the silos' jobs may be waited for
        evals = srv.stats.evals
        if not evals or evals[-1]["version"] != srv.version:
            srv.evaluate()
        if progress is not None:
            progress.close()
        srv.checkpoint()
        if federated is not None:
            silo_evals = federated.per_silo
        else:
            silo_evals = evaluate_silos(srv) if cfg.server.evaluate_silos else {}
        metric = "accuracy" if task == "classification" else "dice"
        summary = build_summary(
            srv, metric=metric, wall_time_s=time.monotonic() - t0, silo_evals=silo_evals
        )
        summary["evaluation"] = {"on": on, "samples": None if test is None else len(test)}
        summary["silo_data"] = {
            str(s): {"num_samples": r.num_samples, "class_counts": list(r.class_counts)}
            for s, r in sorted(srv.silo_reports.items())
        }
        srv.events.write(
            "end", t=srv.clock.now, version=srv.version, final_score=summary["final_accuracy"]
        )
        if isinstance(srv.erasure, ErasureCoordinator):
            summary["erasures"] = erasure_summary(srv.erasure, srv.params)
        if srv.privacy.ledger is not None:
            summary["central_dp"] = central_dp_summary(srv)
        write_summary(run_dir / "summary.json", summary)
        return summary
    except RunStopped:
        if srv.started_at is not None:
            srv.checkpoint()  # a resume goes on from where it stopped
        raise
    finally:
        if service is not None:
            service.stop(grace=1.0).wait(5.0)
        srv.events.close()
        srv.privacy.close()


def _check_deployable(cfg: FedAsyncConfig) -> None:
    """What a coordinator without the silos' data cannot do, said before anything starts."""
    for i, e in enumerate(cfg.erasures):
        if e.fraction < 1.0:
            raise ConfigError(
                f"erasures[{i}].fraction={e.fraction}: picking a share of a silo's samples "
                "needs its ids, which the coordinator does not hold in deployment; submit the "
                "ids through the erasure service (fedasync erase submit --samples ...)"
            )
    if cfg.backdoor.enabled and cfg.backdoor.relearn_silo is not None:
        raise ConfigError(
            "backdoor.relearn_silo: a relearning attack trains on another silo's data, which "
            "only a simulation has"
        )


def _check_reports(srv: AsyncServer, spec: BenchmarkSpec) -> None:
    """Every silo's class counts fit the benchmark (one per class): a silo that reads its
    data for another task or class count is a configuration error, said at the start."""
    for s, r in sorted(srv.silo_reports.items()):
        if r.class_counts and len(r.class_counts) != spec.num_classes:
            raise ConfigError(
                f"silo {s} reports {len(r.class_counts)} classes, {spec.name} has "
                f"{spec.num_classes}: its data or its version of the app differs"
            )


def central_dp_summary(srv: AsyncServer) -> dict[str, Any]:
    """Central DP's settings and every silo's epsilon (all runs of its ledger), also logged."""
    dp = srv.cfg.server.dp
    ledger = srv.privacy.ledger
    assert ledger is not None
    eps = {str(s): ledger.epsilon(s) for s in sorted(srv.roster)}
    releases = {str(s): ledger.releases(s) for s in sorted(srv.roster)}
    log.info(
        "central DP (noise %.3g x clip %.3g, delta %g): epsilon per silo %s",
        dp.noise_multiplier,
        srv.cfg.server.clip_norm,
        dp.delta,
        ", ".join(f"{s}: {e:.3g} ({releases[s]} releases)" for s, e in eps.items()),
    )
    return {
        "noise_multiplier": dp.noise_multiplier,
        "clip_norm": srv.cfg.server.clip_norm,
        "delta": dp.delta,
        "epsilon_budget": dp.epsilon_budget,
        "ledger": str(ledger.path),
        "epsilon": eps,
        "releases": releases,
    }


def _start_afresh(run_dir: Path) -> None:
    """A run that does not resume starts a new event log; an old erasure store (an audit
    log) is kept aside, never deleted."""
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    store = run_dir / "erasures.sqlite"
    if store.exists():
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for suffix in ("", "-wal", "-shm"):
            old = store.with_name(store.name + suffix)
            if old.exists():
                old.rename(store.with_name(f"erasures.{stamp}.sqlite{suffix}"))


def _verifier(
    cfg: FedAsyncConfig,
    fed: Any,
    *,
    spec: BenchmarkSpec | None = None,
    test: SiloData | None = None,
) -> Any:
    """``verify(params, silo, ids)``: the verification metrics of a model on silo ``silo``'s
    training data (only ``ids`` when given; the backdoor applied in verification runs), the
    test set, and in verification runs the triggered test set.

    Without ``fed`` (a coordinator that holds no silo data) only what ``test``, its own
    held-out set, shows: ``test_accuracy`` and, in verification runs, the attack success
    rates; nothing without a test set either."""
    from medical_data.backdoor import triggered_set
    from medical_data.tasks import select, training_data
    from medical_data.verification import accuracy, attack_success_rate, verification_report

    spec = fed.spec if spec is None else spec
    test = fed.test if test is None and fed is not None else test
    task = spec.task
    vmodel = initial_model(cfg, spec)
    bd = to_dict(cfg.backdoor)
    b = cfg.backdoor
    triggered = (
        triggered_set(test, b.target_label, b.trigger_size, pattern=b.trigger_pattern)
        if b.enabled and test is not None
        else None
    )
    untriggered = (
        triggered_set(test, b.target_label, b.trigger_size, trigger=False)
        if b.enabled and test is not None
        else None
    )
    target = cfg.backdoor.target_label if triggered is not None else None

    def verify(params: dict[str, torch.Tensor], silo: int, ids: list[str]) -> dict[str, float]:
        if test is None:
            return {}
        vmodel.load_state_dict(params)
        if fed is None:
            report = {"test_accuracy": accuracy(vmodel, test, task)}
            if triggered is not None and untriggered is not None and target is not None:
                report["asr"] = attack_success_rate(vmodel, triggered, target, task=task)
                report["asr_without_trigger"] = attack_success_rate(
                    vmodel, untriggered, target, task=task
                )
            return report
        forget = select(training_data(fed, silo, bd, cfg.run.seed), ids, keep=True)
        return verification_report(
            vmodel,
            forget=forget,
            test=test,
            triggered=triggered,
            untriggered=untriggered,
            target_label=target,
            task=task,
        )

    return verify


def _attach_erasure(
    srv: AsyncServer,
    cfg: FedAsyncConfig,
    fed: Any,
    run_dir: Path,
    *,
    spec: BenchmarkSpec | None = None,
    test: SiloData | None = None,
) -> Any:
    """Give ``srv`` an erasure coordinator (store in the run folder) and, when configured, start
    the erasure gRPC service. Returns the gRPC server to stop, or None. Without ``fed`` (no
    silo data here) requests are checked against the ids' digests the silos reported."""
    from server.erasure.store import ErasureStore

    verify_fn = _verifier(cfg, fed, spec=spec, test=test)
    store = ErasureStore(run_dir / "erasures.sqlite")
    srv.erasure = ErasureCoordinator(
        srv,
        store,
        verify_fn,
        # what it needs of the server's parts: the norm bound an erasure delta gets like any
        # update, and the calibration of what the pipeline carries past a boundary
        norm_threshold=lambda: srv.intake.norms.threshold(),
        at_boundary=srv.pipeline.at_boundary,
    )
    if not cfg.unlearning.service:
        return None
    from server.erasure.auth import Authorizer, generate_credentials, write_private
    from server.erasure.limits import Limits
    from server.erasure.service import ErasureService, serve

    cred = Path(cfg.unlearning.credentials) if cfg.unlearning.credentials else None
    if cred is None:
        cred = run_dir / "credentials.json"
        if not cred.exists():
            write_private(run_dir / "tokens.json", generate_credentials(cfg.silos.count, cred))
    # every node may hold one Watch stream open (fedasync node --erasure-service), on top of
    # what the default leaves for silos' and the admin's own streams
    limits = Limits(streams_total=Limits().streams_total + cfg.silos.count)
    catalog = _Catalog(srv, _known_ids(srv, fed))
    service = ErasureService(store, Authorizer.from_file(cred), catalog, limits=limits)
    server, port = serve(service, cfg.unlearning.address, server_credentials=_tls(cfg))
    host = cfg.unlearning.address.rsplit(":", 1)[0]
    tmp = run_dir / "erasure_address.tmp"
    tmp.write_text(f"{host}:{port}\n")
    os.replace(tmp, run_dir / "erasure_address")  # whole or absent for a reader
    log.info(
        "erasure service listening on %s:%d (%s)",
        host,
        port,
        "TLS" if cfg.unlearning.tls_certfile else "insecure",
    )
    return server


def _tls(cfg: FedAsyncConfig) -> Any:
    """The erasure service's TLS credentials (certificate and key), or None: insecure."""
    u = cfg.unlearning
    if u.tls_certfile is None or u.tls_keyfile is None:
        return None
    import grpc

    pair = (Path(u.tls_keyfile).read_bytes(), Path(u.tls_certfile).read_bytes())
    return grpc.ssl_server_credentials([pair])


def _watched_ids(cfg: FedAsyncConfig, fed: Any) -> list[str]:
    """The backdoored silo's samples ``backdoor.watch`` follows: the seeded share a
    sample-level erasure of it erases, or its retraining never trains on
    (``silos.exclude_samples``), so that both runs are watched on the same samples; none
    (the whole silo) otherwise."""
    silo = cfg.backdoor.silo
    shares = [e.fraction for e in cfg.erasures if e.silo == silo and e.fraction < 1.0]
    never = cfg.silos.excluded_share(silo)
    shares += [] if never is None else [never]
    if not shares or fed is None:
        return []
    ids = [str(x) for x in fed.silos[silo].sample_ids]
    return fraction_ids(ids, cfg.run.seed, silo, shares[0])


def _known_ids(srv: AsyncServer, fed: Any) -> Callable[[int], AbstractSet[str]]:
    """A silo's sample ids as the erasure service checks them: in the clear from the
    federation (simulation), else as the salted digests the silo reported (``protocol.ids``;
    each silo's set built once, on first use)."""
    if fed is not None:
        return lambda silo: {str(x) for x in fed.silos[silo].sample_ids}
    known: dict[int, digests.DigestSet] = {}
    lock = threading.Lock()  # (the service asks from its gRPC worker threads)

    def of(silo: int) -> AbstractSet[str]:
        with lock:
            if silo not in known:
                report = srv.silo_reports.get(silo)
                blob = b"" if report is None else report.id_digests
                known[silo] = digests.DigestSet(srv.id_salt, digests.split(blob))
            return known[silo]

    return of


class _Catalog:
    """What the erasure service may ask the training server."""

    def __init__(self, srv: AsyncServer, sample_ids: Callable[[int], AbstractSet[str]]):
        self.srv, self._sample_ids = srv, sample_ids

    def silo_ids(self) -> set[int]:
        return set(range(self.srv.cfg.silos.count))

    def sample_ids(self, silo: int) -> AbstractSet[str]:
        return self._sample_ids(silo)

    def model_version(self) -> int:
        return self.srv.version

    def is_online(self, silo: int) -> bool:
        return silo in self.srv.roster and not self.srv.is_down(silo)


def erasure_summary(co: ErasureCoordinator, params: Any) -> dict[str, Any]:
    """Every request's final state, the verification report of each verified one, and the
    same metrics on the final model ``params`` for every applied erasure (``at_end``)."""
    requests = co.store.list()
    ids_of = {r.id: list(r.sample_ids) for r in requests}
    calibrating = [
        {**co.row(e), "after_relearn": None} for e in co.active.values() if e.boundary is not None
    ]
    for row in [*co.report, *calibrating]:
        row["at_end"] = co.verify_fn(params, row["silo"], ids_of.get(row["request"], []))
    return {
        "applied": [*co.report, *calibrating],
        "requests": [
            {
                "id": r.id,
                "silo": r.silo,
                "state": r.state.value,
                "requester": r.requester,
                "samples": len(r.sample_ids),
                "failure_reason": r.failure_reason,
            }
            for r in requests
        ],
        "verified": co.report,
    }


class RunStopped(BaseException):
    """The launcher stopped the run (Ctrl-C, SIGTERM): raised in the ServerApp's thread at its
    next poll of the grid. A BaseException, so that no ``except Exception`` takes it for a
    silo's failure."""


class StoppableGrid:
    """``grid`` whose reading calls (``pull_messages``, ``get_node_ids``) raise RunStopped once
    ``stop`` is set; everything else is passed through. Pushing never raises, so the loop is
    stopped between two steps, never inside one."""

    def __init__(self, grid: Grid, stop: threading.Event):
        self._grid, self._stop = grid, stop

    def pull_messages(self, *args: Any, **kwargs: Any) -> Any:
        """The grid's, unless the run was stopped (then ``RunStopped``)."""
        if self._stop.is_set():
            raise RunStopped
        return self._grid.pull_messages(*args, **kwargs)

    def get_node_ids(self, *args: Any, **kwargs: Any) -> Any:
        """The grid's, unless the run was stopped (then ``RunStopped``)."""
        if self._stop.is_set():
            raise RunStopped
        return self._grid.get_node_ids(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class StopHandle:
    """How the simulation launcher stops a running ServerApp and waits for its thread, which
    Flower does not make a daemon: a process cannot exit while it runs."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.started = False
        self.done = threading.Event()

    def stop(self, timeout_s: float) -> bool:
        """Ask the run to stop; whether its ServerApp ended (or never started) in ``timeout_s``."""
        self.requested.set()
        return not self.started or self.done.wait(timeout_s)


def make_server_app(
    cfg: FedAsyncConfig,
    run_dir: Path,
    result: dict[str, Any] | None = None,
    handle: StopHandle | None = None,
) -> ServerApp:
    """A ServerApp bound to ``cfg`` for the simulation engine; its summary lands in ``result``.

    With ``handle``: once it is asked to stop, the run stops at its next poll (checkpoint
    written, erasure service stopped, event log closed) and the ServerApp returns without a
    summary.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        if handle is None:
            summary = run_server(grid, cfg, run_dir)
        else:
            handle.started = True
            try:
                summary = run_server(StoppableGrid(grid, handle.requested), cfg, run_dir)  # type: ignore[arg-type]
            except RunStopped:
                log.info("the run was stopped")
                return
            finally:
                handle.done.set()
        if result is not None:
            result.update(summary)

    return app


app = ServerApp()


def simulated(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation runtime's (``flwr run`` against a local
    simulation SuperLink: the nodes are Ray actors on this machine), not a deployment's."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run``'s entry point: the config arrives as the run config's flat keys
    (``server.run_config``). On Flower's deployment engine the loop runs on the wall clock
    (replies taken in arrival order) and the coordinator reads no silo data; on Flower's
    simulation runtime (a ``:local:`` SuperLink) on the virtual clock, with the benchmark
    built here, as ``fedasync simulate`` runs it."""
    from server.run_config import config_from_run_config

    cfg = config_from_run_config(context.run_config)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    _log_to(run_dir / "run.log")
    if cfg.run.compare_sync and cfg.server.mode != "sync":
        log.warning(
            "run.compare_sync=true is run by `fedasync simulate` only, not under `flwr run` "
            "(benchmarks/deployment_overhead.py compares with Flower's FedAvg in deployment)"
        )
    in_simulation = simulated(grid)
    if not in_simulation:  # replies whose content is still arriving: retry in 10 ms, not 1 s
        from flwr.superlink.grid import http_grid

        short_backoff(http_grid, "pull_objects")
    run_server(grid, cfg, run_dir, wall_clock=not in_simulation, data_here=in_simulation)


def _log_to(path: Path) -> None:
    """The ``fedasync`` loggers' INFO and above to ``path`` (run.log, as in simulation);
    warnings still reach stderr, which Flower streams to ``flwr run``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("fedasync")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
