"""A warm ClientApp worker: one long-lived process per SuperNode that runs its messages.

Flower 1.42 starts a fresh ``flwr-clientapp`` process for every message (the SuperNode's
SuperExec launches one per task): it imports flwr, torch and MONAI, unzips and re-hashes the
FAB and rebuilds the ClientApp, seconds per message, and the app's caches (the silo's data,
the network) never outlive it. This worker takes the SuperExec's place (the SuperNode runs
with ``--isolation process``) and runs every task of its SuperNode itself:

    AcquireTask -> pull the task's input (message, context, run, FAB) -> run the ClientApp
    -> push the reply and the task's output (status and context) -> AcquireTask ...

It talks only to its SuperNode's local runtime API (HTTP on 127.0.0.1); TLS to the
SuperLink and node authentication stay with the SuperNode. Each step uses Flower's own
functions (``flwr.supernode.runtime.run_clientapp``: ``pull_task_input``, ``push_message``,
``push_task_output``), the same ones ``flwr-clientapp`` runs once per process.

What persists between messages, and the guards:

- the modules (torch, MONAI, the app) and the app's caches: that is the point;
- one FAB: the first task's FAB is installed and its ClientApp loaded. A task of another FAB
  (a new version of the app) is handed to Flower's own ``flwr-clientapp`` (a cold process,
  exactly Flower's path), and then the worker exits with ``EXIT_NEW_FAB``: Python cannot
  unload the old app's modules, so its supervisor starts a fresh worker, which loads the new
  FAB on its first task;
- random state: before every task torch's default generator is reset to the seed a fresh
  process starts with, and Python's and numpy's global generators are reseeded from the OS,
  as in a fresh process; so a message's result never depends on the messages before it
  (the app seeds its own training from the message in any case);
- memory: what a task made is dropped when it ends (Python's own collector, no forced full
  collection: one took 0.5-1.2 s per task with torch and MONAI loaded); each task's line in
  the log gives the RSS (``benchmarks/deployment_overhead.py`` reads it over 500 messages).

A ClientApp that raises becomes an error reply (Flower's ``CLIENT_APP_RAISED_EXCEPTION``),
as in ``flwr-clientapp``, and the worker goes on. A worker that dies while holding a task
(killed, out of memory) stops its task's heartbeats: the SuperNode then answers the task
with Flower's ``CLIENT_APP_CRASHED`` error reply, which the server treats like any failed
job; the supervisor (``simulations.deploy``) starts a new worker.

    python -m simulations.worker --runtime-api 127.0.0.1:9094 [--root-certificates CA]

It relies on Flower internals (the runtime API's request types and the functions named
above): ``flwr`` is pinned to the tested minor version, and ``check_flower_internals``
fails loudly, at start, when they moved.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedasync.interrupt import set_handlers
from fedasync.processes import FLOWER_ENV
from protocol.transport import FlowerInternalsMoved, short_backoff

log = logging.getLogger("fedasync.worker")

EXIT_NEW_FAB = 75
"""Exit status of a worker that handed a task of a new FAB to Flower and wants a restart."""

CLIENT_APP_TASK = "flwr-clientapp"
"""Flower's task type of a ClientApp task (``flwr.supercore.constant.TaskType.CLIENT_APP``)."""


class TaskGone(BaseException):
    """The task's run was stopped at the SuperLink (``flwr stop``) while the worker held it:
    Flower's HTTP client, refused with 401 on the task's token, sends its own process SIGINT
    (it expects a one-task ``flwr-clientapp``, which then exits). The worker takes that SIGINT
    as "drop the task in hand" and goes on to the next one instead of dying and being
    restarted (a fresh worker needs seconds to import torch and MONAI). A BaseException, so
    that no retry loop of Flower's takes it for a failed attempt."""


def check_flower_internals() -> dict[str, Any]:
    """Import everything the worker uses from Flower; FlowerInternalsMoved (naming what is
    missing and the installed flwr version) when any of it moved, so that an upgrade fails
    at start instead of serving nothing."""
    import importlib

    wanted = {
        "flwr.supernode.runtime.run_clientapp": (
            "pull_task_input",
            "push_message",
            "push_task_output",
        ),
        "flwr.proto.runtime_pb2": ("AcquireTaskRequest",),
        "flwr.supercore.runtime": ("RuntimeHttpClient",),
        "flwr.supercore.interceptors": (
            "RuntimeTokenHttpInterceptor",
            "RuntimeVersionHttpInterceptor",
        ),
        "flwr.supercore.retry": ("make_simple_http_retry_invoker",),
        "flwr.supercore.heartbeat": ("HeartbeatSender", "make_task_heartbeat_fn_http"),
        "flwr.cli.install": ("install_from_fab",),
        "flwr.clientapp.utils": ("get_load_client_app_fn",),
        "flwr.common.config": ("get_project_dir",),
        "flwr.common.constant": ("ErrorCode", "SubStatus"),
        "flwr.supercore.constant": ("TaskType",),
        "flwr.app.error": ("Error",),
    }
    found: dict[str, Any] = {}
    missing: list[str] = []
    for module, names in wanted.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        for name in names:
            if hasattr(mod, name):
                found[name] = getattr(mod, name)
            else:
                missing.append(f"{module}.{name}")
    if not missing and str(found["TaskType"].CLIENT_APP) != CLIENT_APP_TASK:
        missing.append(f"TaskType.CLIENT_APP == {CLIENT_APP_TASK!r}")
    if missing:
        from flwr.supercore.version import package_version

        raise FlowerInternalsMoved(
            f"flwr {package_version} lacks what the warm worker uses: {', '.join(missing)}; "
            "it was written for flwr 1.42 (run with workers=flower meanwhile)"
        )
    return found


def rss_mb() -> float:
    """This process's resident memory now, MiB (from /proc; the peak where /proc is absent)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Worker:
    """Serve one SuperNode's ClientApp tasks in this process (see the module docstring)."""

    def __init__(
        self,
        runtime_api: str,
        *,
        root_certificates: Path | None = None,
        poll_s: float = 0.01,
        poll_max_s: float = 0.1,
        max_tasks: int | None = None,
    ):
        self.f = check_flower_internals()
        from flwr.supernode.runtime import run_clientapp

        # the task can be acquired while the SuperNode still pulls the message's content:
        # retry after 10 ms, not 1 s
        short_backoff(run_clientapp, "pull_and_inflate_object_from_tree")
        self.runtime_api = runtime_api
        self.ca_path = root_certificates
        self.root_certificates = (
            None if root_certificates is None else root_certificates.read_bytes()
        )
        self.insecure = root_certificates is None
        self.poll_s, self.poll_max_s = poll_s, max(poll_s, poll_max_s)
        self.max_tasks = max_tasks
        self.fab_hash: str | None = None
        self.app: Any = None
        self.tasks = 0
        self.stopping = False
        self.in_task = False
        """Inside ``run_task`` (a SIGINT then drops the task: `TaskGone`)."""
        import torch

        self.torch_seed = torch.initial_seed()  # what a fresh process's generator starts at

    def drop_task(self, signum: int, frame: Any) -> None:
        """SIGINT's handler: `TaskGone` inside a task; between tasks it is Ctrl-C, as Python's
        own handler has it (KeyboardInterrupt)."""
        if self.in_task and not self.stopping:
            raise TaskGone
        signal.default_int_handler(signum, frame)

    def _client(self, component: str, token: str | None = None) -> Any:
        f = self.f
        interceptors = [f["RuntimeVersionHttpInterceptor"](component_name=component)]
        if token is not None:
            interceptors.append(f["RuntimeTokenHttpInterceptor"](token))
        return f["RuntimeHttpClient"].from_server_address(
            server_address=self.runtime_api,
            insecure=self.insecure,
            root_certificates=self.root_certificates,
            interceptors=interceptors,
            retry_invoker=self.f["make_simple_http_retry_invoker"](),
        )

    def serve(self) -> int:
        """Acquire and run tasks until stopped (SIGTERM/SIGINT), ``max_tasks`` ran, or a task
        of a new FAB came (``EXIT_NEW_FAB``); the exit status."""
        superexec = self._client("SuperExec")
        request = self.f["AcquireTaskRequest"](supported_task_types=[CLIENT_APP_TASK])
        log.info(
            "warm worker %d serving %s (rss %.0f MiB)", os.getpid(), self.runtime_api, rss_mb()
        )
        wait = self.poll_s
        try:
            while not self.stopping:
                res = superexec.AcquireTask(request)
                if not (res.HasField("task") and res.token):
                    time.sleep(wait)  # soon after a task the next is near: poll fast, then less
                    wait = min(wait * 2.0, self.poll_max_s)
                    continue
                wait = self.poll_s
                fab = res.task.fab_hash if res.task.HasField("fab_hash") else ""
                if self.fab_hash is not None and fab and fab != self.fab_hash:
                    log.info("task %d has a new FAB %s: Flower runs it", res.task.task_id, fab[:12])
                    self._cold(res.token)
                    return EXIT_NEW_FAB
                self.run_task(res.token, res.task.task_id)
                if self.max_tasks is not None and self.tasks >= self.max_tasks:
                    return 0
            return 0
        finally:
            superexec.close()

    def _cold(self, token: str) -> None:
        """Flower's own cold path for one task: ``flwr-clientapp`` with the token."""
        exe = Path(sys.executable).parent / "flwr-clientapp"
        cmd = [str(exe), "--runtime-api-address", self.runtime_api, "--token", token]
        cmd += (
            ["--insecure"] if self.ca_path is None else ["--root-certificates", str(self.ca_path)]
        )
        subprocess.run(cmd, check=False, timeout=24 * 3600)

    def _fresh_state(self) -> None:
        """Random state as a fresh process has it (see the module docstring)."""
        import numpy as np
        import torch

        torch.manual_seed(self.torch_seed)
        random.seed()
        np.random.seed(None)

    def _load(self, fab: Any, run: Any) -> Any:
        """The ClientApp of ``fab`` (installed and loaded on the first task only)."""
        if self.app is not None and fab.hash_str == self.fab_hash:
            return self.app
        if self.app is not None:  # serve() checks the hash first; a run's FAB cannot change
            raise RuntimeError("a task of another FAB reached a warm worker")
        t = time.perf_counter()
        self.f["install_from_fab"](fab.content, skip_prompt=True)
        app_dir = Path(self.f["get_project_dir"](run.fab_id, run.fab_version, fab.hash_str))
        dropped = forget_packages(app_dir)
        load = self.f["get_load_client_app_fn"](default_app_ref="", app_path=None, multi_app=True)
        self.app = load(run.fab_id, run.fab_version, fab.hash_str)
        self.fab_hash = fab.hash_str
        from_fab = sorted(n for n, m in list(sys.modules.items()) if _under(m, app_dir))
        log.info(
            "loaded FAB %s in %.2f s: %d modules from %s (%s); dropped first, as loaded from "
            "elsewhere: %s",
            fab.hash_str[:12],
            time.perf_counter() - t,
            len(from_fab),
            app_dir,
            ", ".join(from_fab),
            ", ".join(sorted(dropped)) or "none",
        )
        return self.app

    def run_task(self, token: str, task_id: int) -> None:
        """One task, start to end, as ``flwr-clientapp`` runs it (without exiting)."""
        f = self.f
        from flwr.app import Message

        t0 = time.perf_counter()
        client = self._client("flwr-clientapp", token)
        heartbeat = f["HeartbeatSender"](f["make_task_heartbeat_fn_http"](client))
        message = reply = context = None
        marks = {"start": t0}
        status, details = f["SubStatus"].FAILED, "ClientApp task failed due to unknown reason"
        self.in_task = True
        try:
            heartbeat.start()
            message, context, run, fab = f["pull_task_input"](client)
            marks["pulled"] = time.perf_counter()
            app = self._load(fab, run)
            self._fresh_state()
            reply = app(message=message, context=context)
            marks["ran"] = time.perf_counter()
            status, details = f["SubStatus"].COMPLETED, ""
        except TaskGone:
            log.info("task %d: its run was stopped at the SuperLink: dropped", task_id)
            reply = None  # nothing to reply to: the SuperLink refuses the task's calls
        except Exception as e:  # noqa: BLE001 - as flwr-clientapp: an error reply, not a crash
            log.exception("task %d: the ClientApp raised", task_id)
            details = f"{type(e)}:<'{str(e)[:500]}'>"
            if message is not None:
                error = f["Error"](code=f["ErrorCode"].CLIENT_APP_RAISED_EXCEPTION, reason=details)
                reply = Message(error, reply_to=message)
        finally:
            self.in_task = False
            try:
                if reply is not None and context is not None:
                    f["push_message"](client, reply, context)
                f["push_task_output"](client, context, status, details)
                marks["pushed"] = time.perf_counter()
            except Exception as e:  # noqa: BLE001 - the task is over either way
                # (a task the SuperNode already ended: its run stopped mid-fetch); the worker
                # goes on, and a SuperNode that is gone ends it at its next AcquireTask
                log.warning("task %d: its end could not be reported: %s", task_id, str(e)[:300])
                status = f["SubStatus"].FAILED
            finally:
                if heartbeat.is_running:
                    heartbeat.stop()
                client.close()
                marks["closed"] = time.perf_counter()
        self.tasks += 1
        del message, reply, context  # (no gc.collect(): a full one took 0.5-1.2 s here)
        steps = list(marks.items())
        took = ", ".join(f"{b[0]} {b[1] - a[1]:.3f}" for a, b in zip(steps, steps[1:]))
        log.info(
            "task %d (%d in this worker): %s in %.3f s (%s s), rss %.0f MiB",
            task_id,
            self.tasks,
            status,
            time.perf_counter() - t0,
            took,
            rss_mb(),
        )


def forget_packages(app_dir: Path) -> list[str]:
    """Drop from ``sys.modules`` every module of a package the FAB in ``app_dir`` ships that
    was loaded from elsewhere (this worker uses ``protocol.transport`` from the installed
    project before any FAB arrives): the app then imports all of its packages from the FAB,
    as a fresh ``flwr-clientapp`` would. The names dropped."""
    ours = {d.name for d in app_dir.iterdir() if (d / "__init__.py").is_file()}
    dropped = [
        name
        for name, module in list(sys.modules.items())
        if name.split(".")[0] in ours and not _under(module, app_dir)
    ]
    for name in dropped:
        del sys.modules[name]
    return dropped


def _under(module: Any, folder: Path) -> bool:
    """Whether ``module`` was loaded from a file under ``folder``."""
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and Path(path).resolve().is_relative_to(folder.resolve())


def preload(modules: list[str]) -> float:
    """Import ``modules`` now (what every task would otherwise import); seconds taken."""
    import importlib

    t = time.perf_counter()
    for name in modules:
        importlib.import_module(name)
    return time.perf_counter() - t


STOP_GRACE_S = 2.0
"""After SIGTERM, how long a task in hand may take to report its end before the worker exits."""

PRELOAD = ["torch", "numpy", "monai.networks.nets", "flwr.clientapp", "flwr.app"]
"""Third-party modules imported before the first task (never the app's own packages: those
come from the FAB)."""


def main(argv: list[str] | None = None) -> int:
    """``python -m simulations.worker``: serve until SIGTERM; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m simulations.worker", description=__doc__)
    parser.add_argument("--runtime-api", required=True, help="the SuperNode's runtime API")
    parser.add_argument("--root-certificates", type=Path, help="CA of a TLS runtime API")
    parser.add_argument(
        "--poll-s", type=float, default=0.01, help="first AcquireTask poll interval after a task"
    )
    parser.add_argument(
        "--poll-max-s", type=float, default=0.1, help="the interval it doubles up to while idle"
    )
    parser.add_argument("--max-tasks", type=int, help="exit after this many tasks")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    for name in ("poll_s", "poll_max_s"):
        if not 0.001 <= getattr(args, name) <= 10.0:
            parser.error(f"--{name.replace('_', '-')} must be within [0.001, 10]")
    for name, value in FLOWER_ENV.items():
        os.environ.setdefault(name, value)
    took = preload(PRELOAD)
    log.info("imported %s in %.1f s", ", ".join(PRELOAD), took)
    worker = Worker(
        args.runtime_api,
        root_certificates=args.root_certificates,
        poll_s=args.poll_s,
        poll_max_s=args.poll_max_s,
        max_tasks=args.max_tasks,
    )

    def stop(signum: int, frame: Any) -> None:
        # as flwr-clientapp does: stop now; a task in hand ends with its status pushed
        # (run_task's finally), and the server takes the unanswered job as failed. That push
        # retries while the SuperNode stops too: it gets STOP_GRACE_S, then the process exits
        # (a stopped deployment otherwise waited out its SIGKILL grace for a busy worker)
        if not worker.stopping:
            timer = threading.Timer(STOP_GRACE_S, os._exit, args=(128 + signum,))
            timer.daemon = True
            timer.start()
        worker.stopping = True
        if sys.is_finalizing():  # already exiting: raising now only prints a traceback
            return
        raise SystemExit(128 + signum)

    set_handlers(stop, (signal.SIGTERM,))
    set_handlers(worker.drop_task, (signal.SIGINT,))
    return worker.serve()


if __name__ == "__main__":
    sys.exit(main())
