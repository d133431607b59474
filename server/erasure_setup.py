"""The erasure part of a run: its coordinator, verifier, service and summary.

What ``run_server`` attaches when a run may erase (``erasures`` or the erasure service, ``unlearning.address``): the
coordinator (server/unlearning/) with its store in the run folder, made for the server by
``coordinator_for``; the verification of a model on a silo's samples (``verifier``); the
erasure gRPC service (``start_service``, with what it may ask the server: ``LiveCatalog``,
``known_ids``; TLS from ``service_tls``); the samples a backdoor watch follows
(``watched_ids``); and the summary's ``erasures`` section (``erasure_summary``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medical_data.federation import SiloData
from medical_data.registry import BenchmarkSpec
from protocol import ids as digests
from protocol.config import to_dict
from protocol.ids import fraction_ids
from server.benchmark import initial_model
from server.config import FedAsyncConfig
from server.unlearning import (
    ErasureCoordinator,
    ErasureFactory,
    ErasureRun,
    ServedModel,
    SiloJobs,
)

log = logging.getLogger("fedasync.server")


def verifier(
    cfg: FedAsyncConfig,
    fed: Any,
    *,
    spec: BenchmarkSpec | None = None,
    test: SiloData | None = None,
) -> Any:
    """``verify(params, silo, ids)``: the verification metrics of a model on silo ``silo``'s
    training data (only ``ids`` when given; the backdoor applied in verification runs), the
    test set, and in verification runs the triggered test set; with the sample counts behind
    them (``sample_counts``: the certificate's tolerances follow their noise).

    Without ``fed`` (a coordinator that holds no silo data) only what ``test``, its own
    held-out set, shows: ``test_accuracy`` and, in verification runs, the attack success
    rates; nothing without a test set either."""
    from medical_data.backdoor import triggered_set
    from medical_data.tasks import select, training_data
    from medical_data.verification import (
        accuracy,
        attack_success_rate,
        sample_counts,
        verification_report,
    )

    spec = fed.spec if spec is None else spec
    test = fed.test if test is None and fed is not None else test
    task = spec.task
    vmodel = initial_model(cfg, spec)
    bd = to_dict(cfg.lab.backdoor)
    b = cfg.lab.backdoor
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
    target = cfg.lab.backdoor.target_label if triggered is not None else None

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
        report = verification_report(
            vmodel,
            forget=forget,
            test=test,
            triggered=triggered,
            untriggered=untriggered,
            target_label=target,
            task=task,
        )
        return {**report, **sample_counts(forget, test)}  # the counts: each figure's noise

    return verify


def coordinator_for(
    cfg: FedAsyncConfig,
    fed: Any,
    run_dir: Path,
    *,
    spec: BenchmarkSpec | None = None,
    test: SiloData | None = None,
) -> ErasureFactory:
    """What makes a server's erasure coordinator (its store in the run folder; verifications by
    ``verifier``): the server calls it with what the coordinator sees of it."""
    verify_fn = verifier(cfg, fed, spec=spec, test=test)

    def make(model: ServedModel, silos: SiloJobs, run: ErasureRun) -> ErasureCoordinator:
        from server.erasure.store import ErasureStore

        store = ErasureStore(run_dir / "erasures.sqlite")
        return ErasureCoordinator(model, silos, run, store, verify_fn)

    return make


def start_service(cfg: FedAsyncConfig, run_dir: Path, erasure: Any, catalog: LiveCatalog) -> Any:
    """Start the erasure gRPC service on the run's ``erasure`` coordinator's store, when
    configured (``unlearning.address``), answering from ``catalog``; the gRPC server to stop,
    or None."""
    if not cfg.unlearning.service:
        return None
    assert isinstance(erasure, ErasureCoordinator)
    from server.erasure.auth import Authorizer, generate_credentials, write_private
    from server.erasure.limits import Limits
    from server.erasure.service import ErasureService, serve

    store = erasure.store
    cred = Path(cfg.unlearning.credentials) if cfg.unlearning.credentials else None
    if cred is None:
        cred = run_dir / "credentials.json"
        if not cred.exists():
            write_private(run_dir / "tokens.json", generate_credentials(cfg.silos.count, cred))
    # every node may hold one Watch stream open (fedasync node --erasure-service), on top of
    # what the default leaves for silos' and the admin's own streams
    limits = Limits(streams_total=Limits().streams_total + cfg.silos.count)
    service = ErasureService(
        store,
        Authorizer.from_file(cred),
        catalog,
        limits=limits,
        events=run_dir / "metrics.jsonl",  # certificates read it beside the store
    )
    address = cfg.unlearning.address
    assert address is not None  # (the service is on)
    server, port = serve(service, address, server_credentials=service_tls(cfg))
    host = address.rsplit(":", 1)[0]
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


def service_tls(cfg: FedAsyncConfig) -> Any:
    """The erasure service's TLS credentials (certificate and key), or None: insecure."""
    u = cfg.unlearning
    if u.tls_certfile is None or u.tls_keyfile is None:
        return None
    import grpc

    pair = (Path(u.tls_keyfile).read_bytes(), Path(u.tls_certfile).read_bytes())
    return grpc.ssl_server_credentials([pair])


def watched_ids(cfg: FedAsyncConfig, fed: Any) -> list[str]:
    """The backdoored silo's samples ``lab.backdoor.watch`` follows: the seeded share a
    sample-level erasure of it erases, or its retraining never trains on
    (``lab.exclude_samples``), so that both runs are watched on the same samples; none
    (the whole silo) otherwise."""
    silo = cfg.lab.backdoor.silo
    shares = [e.fraction for e in cfg.erasures if e.silo == silo and e.fraction < 1.0]
    never = cfg.lab.excluded_share(silo)
    shares += [] if never is None else [never]
    if not shares or fed is None:
        return []
    ids = [str(x) for x in fed.silos[silo].sample_ids]
    return fraction_ids(ids, cfg.run.seed, silo, shares[0])


def known_ids(fed: Any, reports: Mapping[int, Any], salt: str) -> Callable[[int], AbstractSet[str]]:
    """A silo's sample ids as the erasure service checks them: in the clear from the
    federation ``fed`` (simulation), else as the salted digests each silo reported in its
    roster reply (``reports``, salted with ``salt``: ``protocol.ids``; each silo's set built
    once, on first use)."""
    if fed is not None:
        return lambda silo: {str(x) for x in fed.silos[silo].sample_ids}
    known: dict[int, digests.DigestSet] = {}
    lock = threading.Lock()  # (the service asks from its gRPC worker threads)

    def of(silo: int) -> AbstractSet[str]:
        with lock:
            if silo not in known:
                report = reports.get(silo)
                blob = b"" if report is None else report.id_digests
                known[silo] = digests.DigestSet(salt, digests.split(blob))
            return known[silo]

    return of


@dataclass
class LiveCatalog:
    """What the erasure service may ask the training server (``server.erasure.catalog``'s
    Protocol), read from the running loop: ``silos`` of them, each one's ``ids`` (or their
    digests), the model's ``version`` now and whether a silo is ``online``."""

    silos: int
    ids: Callable[[int], AbstractSet[str]]
    version: Callable[[], int]
    online: Callable[[int], bool]

    def silo_ids(self) -> set[int]:
        """Every silo of the run."""
        return set(range(self.silos))

    def sample_ids(self, silo: int) -> AbstractSet[str]:
        """``silo``'s sample ids (or their digests)."""
        return self.ids(silo)

    def model_version(self) -> int:
        """The global model's version now."""
        return self.version()

    def is_online(self, silo: int) -> bool:
        """Whether ``silo`` is in the roster and not waiting out a failure."""
        return self.online(silo)


def erasure_summary(co: ErasureCoordinator, params: Any) -> dict[str, Any]:
    """Every request's final state, the report of each one checked after its relearning
    window (``verified``: every check within; ``unverified``: one not, its ``reading`` says
    which; a row's ``verified_version`` is the version at which it was checked, either way),
    and the same metrics on the final model ``params`` for every applied erasure
    (``at_end``)."""
    requests = co.store.list()
    ids_of = {r.id: list(r.sample_ids) for r in requests}
    calibrating = [  # (a note changes no request's state: the list above stands)
        {**co.row(e), "after_relearn": None, "reading": co.unchecked_at_end(e)}
        for e in co.active.values()
        if e.boundary is not None
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
        "verified": [x for x in co.report if x.get("state", "verified") == "verified"],
        "unverified": [x for x in co.report if x.get("state") == "unverified"],
    }
