"""``fedasync deploy local``: Flower's deployment engine on this machine, over TLS, with
SuperNode authentication. It is the demo and the integration test of deployment.

    fedasync deploy local --silos N [--config FILE] [--certs DIR] [key=value ...]

1. certificates: ``--certs DIR`` (made by ``fedasync certs``) or made in the run folder;
2. a SuperLink on 127.0.0.1 with TLS and ``--enable-supernode-auth`` (Flower 1.42 serves its
   Fleet, Control and Runtime APIs on one HTTPS port);
3. each silo's public key registered through the Control API (``flwr supernode register``);
4. one SuperNode per silo with its own port and node config ``partition-id=<silo>
   num-partitions=<N> privacy-db="<ledger>"``: ``partition-id`` is how the ClientApp learns
   its silo (as in simulation), ``privacy-db`` the silo's DP privacy ledger, one SQLite file
   per silo, ``<run folder>/privacy/silo-<i>.sqlite`` or ``--privacy-dir DIR/silo-<i>.sqlite``
   (a folder made 0700); the files are kept, so a silo's epsilon adds up across runs;
5. ``flwr run`` of this project's app (a copy of what the apps import, in the run folder)
   against that SuperLink, with the whole config in the run config's flat keys
   (``server.run_config``; ``server.app:app``: wall clock, replies taken as they arrive);
6. progress (from the run's metrics.jsonl) and the ServerApp's log stream on the console;
7. every process it started is stopped, by process group and pid, when the run ends, on a
   failure and on Ctrl-C / SIGTERM, and the stop is verified: each process carries a marker in
   its environment, which also finds those Flower detaches into sessions of their own.

The SuperLink keeps its state in ``deploy/superlink/state.db``: with ``coordinator_restarts``
a lost coordinator is brought back from it and the run resumed from its checkpoint
(``simulations.coordinator``, which also submits the run). A run stopped with ``flwr stop``
ends with its checkpoint and a summary (``stopped``), as a finished one does.

``lab.compare_sync`` (the sync FedAvg baseline after the run) is simulation-only: a deployment
says so on the console and in ``deploy.json`` (``compare_sync``) instead of running it;
``benchmarks/deployment_overhead.py`` runs Flower's FedAvg on the same deployment.

With the erasure service on (``unlearning.address``) the erasure service serves TLS with the SuperLink's
certificate, and per-silo tokens are made once in ``deploy/erasure/`` (``prepare_erasure``).

Everything lands in the run folder ``<run.out_dir>/<run.name>/``: the ServerApp's outputs
(summary.json, metrics.jsonl, run.log, checkpoint.pt), ``config.yaml``, ``deploy.json`` (what
was measured) and ``deploy/`` (certificates and each process's FLWR_HOME, temp folder and log).

This module is the one path from a config to a running local deployment (the run folder,
the SuperLink, the SuperNodes, the run, the teardown), read top to bottom. The Flower
processes' command lines and start-up are ``simulations.flower_commands``, the app bundle
``flwr run`` ships is ``simulations.app_bundle``, and the process handling is
fedasync/processes.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedasync.events import json_safe, read_events
from fedasync.interrupt import (
    raise_interrupted,
    restore,
    set_handlers,
    shielded,
)
from fedasync.processes import Processes, owner_token, sweep_orphans
from server.config import FedAsyncConfig
from server.erasure.auth import generate_credentials
from simulations.certs import CertPaths, names_hosts, private_dir, write_certs, write_file
from simulations.config import to_yaml
from simulations.coordinator import (
    coordinator_lost,
    fresh_database,
    restart_coordinator,
    serverapp_gone,
    stop_watches,
    submit_run,
    write_run_config,
)
from simulations.deploy_progress import EventTail, measurements, show
from simulations.erasure_watch import ErasureWatcher, start_watches
from simulations.flower_commands import (
    DeployError,
    register_nodes,
    start_superlink,
    supernode_command,
    write_cli_config,
)
from simulations.node import (
    SUPEREXEC_ENV,
    NodeError,
    WorkerSupervisor,
    check_workers,
    stop_file_env,
)
from simulations.placement import Local, Placement


def privacy_ledgers(folder: Path, num_silos: int) -> dict[int, Path]:
    """Each silo's privacy ledger file, ``<folder>/silo-<i>.sqlite`` (absolute: the ClientApp
    runs elsewhere). ``folder`` is made 0700 if missing (an existing one is left as it is);
    the files are made by the silos on their first DP message and kept across runs, so that
    a silo's epsilon accumulates over every run that used its data."""
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        private_dir(folder)
    return {s: folder / f"silo-{s}.sqlite" for s in range(num_silos)}


SYNC_NOT_RUN = "not run in deployment"
"""``deploy.json["compare_sync"]`` when ``lab.compare_sync`` asked for the baseline."""


def sync_comparison_warning(cfg: FedAsyncConfig) -> str | None:
    """The line to show when the config asks for the sync baseline, which only the simulation
    launcher runs (None: nothing asked, or the run is sync itself, as in simulation)."""
    if not cfg.lab.compare_sync or cfg.server.mode == "sync":
        return None
    return (
        "warning: lab.compare_sync=true is simulation-only; no sync baseline is run in "
        "deployment (benchmarks/deployment_overhead.py runs Flower's FedAvg on the same "
        "deployment; set lab.compare_sync=false to silence this)"
    )


def prepare_erasure(cfg: FedAsyncConfig, folder: Path, paths: CertPaths) -> FedAsyncConfig:
    """The erasure service of a deployment: TLS with the SuperLink's certificate (unless the
    config names one), and per-silo credentials made once in ``folder`` and kept for a resumed
    run: ``credentials.json`` (the hashes the service checks) and one token file each,
    ``silo-<i>.token`` and ``admin.token`` (0600), to hand to their holders. Returns the config
    that names them (``cfg`` itself is left as it was)."""
    u = cfg.unlearning
    if u.tls_certfile is None:
        u = replace(u, tls_certfile=str(paths.server_cert), tls_keyfile=str(paths.server_key))
    if u.credentials is not None:
        return replace(cfg, unlearning=u)
    hashes = folder / "credentials.json"
    if not hashes.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        tokens = generate_credentials(cfg.silos.count, folder / ".credentials.json")
        for name, token in tokens.items():
            write_file(folder / f"{name}.token", token.encode() + b"\n", 0o600)
        os.replace(folder / ".credentials.json", hashes)  # tokens first: all or none
    return replace(cfg, unlearning=replace(u, credentials=str(hashes)))


def prepare(
    cfg: FedAsyncConfig,
    certs: Path | None,
    privacy_dir: Path | None = None,
    datalists: dict[int, Path] | None = None,
    cert_hosts: list[str] | None = None,
) -> tuple[FedAsyncConfig, Path, CertPaths, dict[int, Path]]:
    """The run folder, its deploy/ folder, config.yaml, run-config.toml, certificates and the
    silos' privacy ledgers (in ``privacy_dir``, default ``<run folder>/privacy``).

    Returns the config the deployment runs (``run.out_dir`` made absolute, and with the
    erasure service on, its TLS files and credentials; ``cfg`` itself is left as it was), the
    run folder, the certificates' paths and the ledgers by silo. Silos without ``datalists``
    split the benchmark, as in simulation; the coordinator then owns the benchmark's pooled
    test split, written here to ``deploy/server-test/`` as ``data.server_test`` (unless the
    config names one): the ServerApp reads no silo data."""
    n = cfg.silos.count
    out_dir = str(Path(cfg.run.out_dir).resolve())  # the ServerApp runs elsewhere
    cfg = replace(cfg, run=replace(cfg.run, out_dir=out_dir))
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    work = run_dir / "deploy"
    work.mkdir(parents=True, exist_ok=True)
    paths = CertPaths(Path(certs).resolve() if certs else work / "certs", n)
    if not paths.complete():
        if certs is not None:
            raise DeployError(f"{certs} lacks files for {n} silos (make them: fedasync certs)")
        paths = write_certs(paths.root, n, cert_hosts, force=True)
    elif certs is None and not names_hosts(paths.server_cert, cert_hosts or []):
        # a resumed run on other addresses (another host federation): certificates for them
        paths = write_certs(paths.root, n, cert_hosts, force=True)
    if cfg.unlearning.service:
        cfg = prepare_erasure(cfg, work / "erasure", paths)
    if cfg.data.server_test is None and not datalists:
        from medical_data.registry import get_spec
        from server.benchmark import write_server_test

        if get_spec(cfg.data.benchmark).patch is not None:
            raise DeployError(
                f"data.benchmark={cfg.data.benchmark}: its volumes are not deployed as "
                "datalists yet; deploy them as a bundle task (python -m medical_data.volumes "
                "DIR, then fedasync deploy local --bundle DIR/bundle)"
            )

        test = write_server_test(cfg, work / "server-test")
        cfg = replace(cfg, data=replace(cfg.data, server_test=str(test)))
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    write_run_config(cfg, work / "run-config.toml")
    if not cfg.run.resume:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # progress reads only this run's
    ledgers = privacy_ledgers(run_dir / "privacy" if privacy_dir is None else privacy_dir, n)
    return cfg, run_dir, paths, ledgers


def bundle_datalists(cfg: FedAsyncConfig, folder: Path) -> dict[int, Path]:
    """Each silo's share of the bundle task's datalist (``data.partition``, as in
    simulation) written to ``folder`` as its own Decathlon datalist, ``silo-<i>.json``
    (absolute paths; the held-out list split alike when it has one per silo): a one-machine
    deployment's stand-in for the hospitals' own data."""
    from clients.task import split_items
    from medical_data.monai_bundle import read_bundle

    bundle = read_bundle(str(cfg.task.bundle))
    n, part, seed = cfg.silos.count, cfg.data.partition, cfg.run.seed
    try:
        train = split_items(bundle.items("train"), n, part, seed)
        val = bundle.items("validate") if bundle.has("validate#dataset#data") else []
        held = split_items(val, n, part, seed) if len(val) >= n else [[] for _ in range(n)]
    except ValueError as e:
        raise DeployError(f"task.bundle: {e}") from e
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for s in range(n):
        lists: dict[str, Any] = {"training": train[s]}
        if held[s]:
            lists["validation"] = held[s]
        out[s] = folder / f"silo-{s}.json"
        out[s].write_text(json.dumps(lists, indent=1))
    return out


def deploy_local(
    cfg: FedAsyncConfig,
    *,
    certs: Path | None = None,
    privacy_dir: Path | None = None,
    echo: Callable[[str], None] = print,
    grace_s: float = 10.0,
    serverapp: str | None = None,
    workers: str = "warm",
    datalists: dict[int, Path] | None = None,
    where: Placement | None = None,
    coordinator_restarts: int = 0,
) -> dict[str, Any]:
    """Run ``cfg`` on a local SuperLink and ``silos.count`` SuperNodes over TLS; return the
    run's summary with ``deployment`` added (measurements, node ids, every pid seen).
    ``serverapp`` (``module:attribute``) runs another ServerApp than ``server.app:app``; it must
    write the run folder's summary.json too. ``privacy_dir`` holds the silos' privacy ledgers
    (default ``<run folder>/privacy``; see ``privacy_ledgers``). ``workers``: ``warm`` (one
    long-lived ClientApp worker per SuperNode, restarted when it exits) or ``flower``
    (Flower's process per message); see ``WORKERS``. ``datalists``: each silo's own data, a
    Decathlon datalist (its SuperNode's ``datalist`` node config); without, the silos split the
    benchmark and the coordinator owns its test split (``prepare``). ``where``: each role's
    host (simulations.placement; default all on this host's loopback). ``coordinator_restarts``:
    how many times a lost coordinator (its SuperLink gone: the host crashed, the process was
    killed) is brought back, as a service manager would (`restart_coordinator`); 0: the run
    fails with the SuperLink's exit.

    Raises DeployError when something did not start or the run did not finish, Interrupted on
    SIGTERM/SIGHUP and KeyboardInterrupt on Ctrl-C; in every case the processes it started
    are stopped first.
    """
    try:
        check_workers(workers)
    except NodeError as e:
        raise DeployError(str(e)) from e
    sweep_orphans()  # what earlier deployments (or simulations) whose driver was killed left
    where = where or Local()
    bundle = None if cfg.task.bundle is None else Path(cfg.task.bundle).resolve()
    if bundle is not None and datalists is None:  # each silo's own share, as a hospital's
        datalists = bundle_datalists(cfg, Path(cfg.run.out_dir) / cfg.run.name / "hospitals")
    cfg, run_dir, paths, ledgers = prepare(cfg, certs, privacy_dir, datalists, where.cert_hosts)
    work = run_dir / "deploy"
    procs = Processes(marker=f"{work}:{owner_token()}")  # whose: see processes.find_orphans
    events = EventTail(run_dir / "metrics.jsonl")
    nodes: dict[int, int] = {}
    summary_path = run_dir / "summary.json"
    started_at, t0 = time.time(), time.monotonic()
    link_port = 0
    supervisor: WorkerSupervisor | None = None
    cpu: dict[str, float] = {}
    cpu_wall = 0.0
    watches: list[ErasureWatcher] | None = None
    restarts: list[dict[str, Any]] = []
    sync_warning = sync_comparison_warning(cfg)
    if sync_warning is not None:
        echo(sync_warning)
    previous = set_handlers(raise_interrupted)  # Ctrl-C, SIGTERM, SIGHUP: Interrupted
    try:
        link, link_port = start_superlink(procs, work, paths, where, database=fresh_database(work))
        echo(
            f"SuperLink on {where.link_host}:{link_port} (TLS, SuperNode authentication); "
            f"logs in {work}/"
        )
        cli_home = work / "flwr-home"
        write_cli_config(cli_home, link_port, paths.ca_cert, where.link_host)
        keys = {f"silo-{s}": paths.node_public_key(s) for s in range(cfg.silos.count)}
        ids = register_nodes(procs, cli_home, keys, lambda a: where.argv("coordinator", a))
        nodes.update({s: ids[f"silo-{s}"] for s in range(cfg.silos.count)})
        echo("registered: " + ", ".join(f"silo {s} = node {v}" for s, v in nodes.items()))
        ports = dict(enumerate(where.node_ports(cfg.silos.count)))
        supernodes = [
            procs.start(
                f"silo-{s}",
                where.argv(
                    f"silo-{s}",
                    supernode_command(
                        link_port,
                        port,
                        paths,
                        s,
                        cfg.silos.count,
                        ledgers[s],
                        workers=workers,
                        datalist=None if datalists is None else datalists[s],
                        bundle=bundle,
                        link_host=where.link_host,
                    ),
                ),
                work / f"silo-{s}",
                env={**SUPEREXEC_ENV, **stop_file_env(work / f"silo-{s}")},
            )
            for s, port in ports.items()
        ]
        supervisor = None
        if workers == "warm":
            homes = {s: work / f"silo-{s}" for s in ports}
            stops = {s: stop_file_env(home) for s, home in homes.items()}
            supervisor = WorkerSupervisor(
                procs, homes, ports, echo, env=stops, wrap=lambda s, a: where.argv(f"silo-{s}", a)
            )
            supervisor.start()
        flwr_run, pump = submit_run(procs, where, work, cli_home, serverapp, echo)
        last_scan = 0.0
        while True:
            while flwr_run.popen.poll() is None and link.popen.poll() is None:
                if watches is None:
                    watches = (
                        start_watches(cfg, run_dir, paths, started_at)
                        if where.erasure_watches
                        else []
                    )
                show(events.poll(), echo, cfg.run.progress)
                for p in supernodes:
                    if p.popen.poll() is not None:
                        raise DeployError(
                            f"{p.name} exited with code {p.popen.returncode}:\n{p.tail()}"
                        )
                if supervisor is not None:
                    supervisor.check()
                if time.monotonic() - last_scan > 2.0:
                    procs.scan()  # remember the ServerApp's and ClientApps' pids
                    last_scan = time.monotonic()
                time.sleep(0.3)
            if not coordinator_lost(flwr_run.popen, link.popen):
                break  # the run ended (flwr run exited): judged below
            if len(restarts) >= coordinator_restarts:
                if link.popen.poll() is None:
                    break  # flwr run killed, the SuperLink up: judged below
                raise DeployError(
                    f"{link.name} exited with code {link.popen.returncode}:\n{link.tail()}"
                )
            link, flwr_run, pump = restart_coordinator(
                cfg, procs, where, paths, run_dir, link_port, serverapp, echo, restarts
            )
            stop_watches(watches)
            watches = None  # started again against the restarted service
        serverapp_gone(procs, timeout_s=60.0)  # a stopped run's may still write its summary
        cpu = procs.cpu_seconds()  # before the stop: what each process used over the run
        cpu_wall = time.monotonic() - t0
        pump.join(timeout=5.0)
        show(events.poll(), echo, cfg.run.progress)
        fresh = summary_path.exists() and summary_path.stat().st_mtime >= started_at
        if flwr_run.popen.returncode != 0 or not fresh:
            raise DeployError(
                f"the run did not finish (flwr run exited with {flwr_run.popen.returncode}); "
                f"see {flwr_run.log} and {run_dir / 'run.log'}"
            )
    finally:
        t_stop = time.monotonic()
        for watch in watches or []:
            watch.stop(timeout=2.0)
        try:
            with shielded():  # a second Ctrl-C must not leave processes behind
                left = procs.stop(grace_s)
            stop_s = time.monotonic() - t_stop
        finally:
            restore(previous)
        if left:
            echo(f"fedasync deploy: processes {left} are still running")
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    deployment = {
        "superlink": f"{where.link_host}:{link_port}",
        "nodes": {str(s): v for s, v in nodes.items()},
        "privacy_db": {str(s): str(p) for s, p in ledgers.items()},
        "compare_sync": SYNC_NOT_RUN if sync_warning is not None else False,
        "wall_s": time.monotonic() - t0,
        **measurements(_events(run_dir / "metrics.jsonl")),  # (the file: a resume cut it)
        "stop_s": stop_s,
        "workers": workers,
        "worker_restarts": 0 if supervisor is None else supervisor.restarts,
        "coordinator_restarts": restarts,
        "cpu_s": cpu_by_role(cpu),
        "cpu_wall_s": cpu_wall,
        "pids": sorted(procs.seen),
        "left_running": left,
    }
    (run_dir / "deploy.json").write_text(json.dumps(json_safe(deployment), indent=2) + "\n")
    summary["deployment"] = deployment
    return summary


def _events(path: Path) -> list[dict[str, Any]]:
    """The run's events, as the run left them (none when it wrote none)."""
    return read_events(path) if path.exists() else []


def cpu_by_role(cpu: dict[str, float]) -> dict[str, float]:
    """Processes' CPU seconds (``Processes.cpu_seconds``) summed by role: ``superlink``,
    ``supernodes`` (``silo-<i>``) and ``workers`` (``worker-<i>``, the warm ClientApp
    workers; Flower's per-message ClientApp processes are not counted)."""
    roles = {"superlink": 0.0, "supernodes": 0.0, "workers": 0.0}
    for name, seconds in cpu.items():
        if name == "superlink":
            roles["superlink"] += seconds
        elif name.startswith("silo-"):
            roles["supernodes"] += seconds
        elif name.startswith("worker-"):
            roles["workers"] += seconds
    return roles
