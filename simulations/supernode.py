"""``flower-supernode`` with its fixed sleeps capped: a launcher, no edit of installed files.

Flower 1.42's SuperNode (``flwr.supernode.start_client_internal``) sleeps a hard-coded 3 s
whenever a pull from the SuperLink finds no message, and that happens right after every
reply (the server sends the silo's next job a few hundred milliseconds later, so the job
waits up to 3 s); it sleeps 0.5 s per check while waiting for the ClientApp's reply and for
an object's content. This launcher replaces that one module's ``time`` with a copy
(``CappedTime``) whose idle sleep starts at ``--idle-s`` (default 0.05) and doubles while the
SuperNode stays idle, up to ``--idle-max-s`` (default 0.5), and whose 0.5 s waits are capped at
``--push-s`` (default 0.02), then runs Flower's own ``flower-supernode`` with the remaining
arguments, its log lines timestamped (Flower's own console handler, to the millisecond). It also
shortens the backoff of its object pulls (``short_backoff``): a message the SuperLink hands
out before its content has arrived was retried after 1 s. And it makes a message whose run
stopped while its content was being fetched fail like any other fetch (``fail_stopped_runs``):
Flower 1.42 then only logs "Ignoring message", leaving the message's objects registered and
its task claimed, so a warm worker holding the task retried the objects for ~100 s (Flower's
500 tries) before it could take the next run's work; Flower's own failure path deletes both
and finishes the task, and the worker's next try finds the objects gone.

A SuperNode that lost the SuperLink (its link dropped, the coordinator restarted) tries again
at most ``--retry-max-s`` apart (default 2 s; Flower: doubling up to 20 s), so that it is back
within seconds of the link (``cap_retry_delay``): after a 60 s partition hospitals came back
8-26 s after the link did with Flower's 20 s, as the retries had spread out by then.

A SuperNode tells the SuperLink how often it sends heartbeats (``--heartbeat-s``, default
Flower's 30 s; the SuperLink accepts 10-1800): the SuperLink marks a node that stopped sending
them offline after two intervals, and refuses a restarted SuperNode with the same key until
then ("Failed to activate SuperNode"). At 10 s a hospital whose host died is seen offline,
and can come back, after ~20 s instead of ~60 s, at one small request every ~4 s
(``set_heartbeat``).

The price: an idle SuperNode asks the SuperLink for work every ``--idle-max-s`` instead of
every 3 s, and more often right after a message (one HTTPS request each;
``benchmarks/deployment_overhead.py`` reports the SuperLink's and the SuperNodes' CPU); a
disconnected one tries to connect every ``--retry-max-s``.

    python -m simulations.supernode [--idle-s 0.05] [--idle-max-s 0.5] [--push-s 0.02]
        [--retry-max-s 2] [--heartbeat-s 30] <args>

``check_sleeps`` refuses to start when the sleeps are not where flwr 1.42 has them (an
upgrade moved them): silently slow would be worse than a clear error.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
import types
from typing import Any

from protocol.transport import CappedSleep, FlowerInternalsMoved, short_backoff

IDLE_SLEEP_S = 3
"""The SuperNode's sleep after a pull that found no message (flwr 1.42)."""
PUSH_SLEEP_S = 0.5
"""Its sleep per check while waiting for a reply or an object's content (flwr 1.42)."""
MODULE = "flwr.supernode.start_client_internal"


def _source(obj: Any) -> str:
    """``obj``'s source; "" when there is none to read (absent, or a compiled-only install)."""
    try:
        return inspect.getsource(obj) if obj is not None else ""
    except (OSError, TypeError):
        return ""


def check_sleeps(module: types.ModuleType) -> None:
    """FlowerInternalsMoved unless ``module`` imports ``time`` and calls ``time.sleep(3)`` and
    ``time.sleep(0.5)`` (what ``cap_sleeps`` caps)."""
    source = _source(module)
    found = {
        "import time": getattr(module, "time", None) is time,
        f"time.sleep({IDLE_SLEEP_S})": f"time.sleep({IDLE_SLEEP_S})" in source,
        f"time.sleep({PUSH_SLEEP_S})": f"time.sleep({PUSH_SLEEP_S})" in source,
    }
    missing = [k for k, ok in found.items() if not ok]
    if missing:
        from flwr.supercore.version import package_version

        raise FlowerInternalsMoved(
            f"{module.__name__} of flwr {package_version} no longer has {', '.join(missing)}: "
            "the SuperNode's sleeps moved; simulations.supernode was written for flwr 1.42"
        )


class CappedTime(CappedSleep):
    """``time`` with the SuperNode's sleeps shortened; every other attribute is ``time``'s own.

    Its idle sleep (3 s asked) starts at ``idle_s`` and doubles with every idle pull in a row,
    up to ``idle_max_s``: a job that follows a reply within a few hundred milliseconds (the
    asynchronous server's) is found at once, while a SuperNode idle for long (a synchronous
    barrier, a quiet federation) asks the SuperLink only every ``idle_max_s``. Any other wait
    (the 0.5 s ones, while a message is handled) is capped at ``push_s`` and ends the streak,
    as does a gap of more than 0.25 s between two idle sleeps (a message was handled)."""

    def __init__(self, idle_s: float, push_s: float, idle_max_s: float = 1.0):
        super().__init__(push_s)
        self.idle_s, self.push_s, self.idle_max_s = idle_s, push_s, max(idle_s, idle_max_s)
        self.streak = 0
        self.idle_ended = 0.0

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, shortened as the class docstring says."""
        if seconds < 1.0:
            self.streak = 0
            time.sleep(min(seconds, self.push_s))
            return
        if time.monotonic() - self.idle_ended > 0.25:
            self.streak = 0
        wait = min(self.idle_s * 2.0**self.streak, self.idle_max_s, seconds)
        self.streak = min(self.streak + 1, 30)
        time.sleep(wait)
        self.idle_ended = time.monotonic()


class RunStopped(RuntimeError):
    """The run of a message the SuperNode was fetching stopped (Flower's
    ``RunNotRunningException``, a BaseException, raised through as this)."""


def fail_stopped_runs(module: types.ModuleType) -> None:
    """Make ``module.pull_objects`` (the SuperNode's fetch of a message's objects) raise
    :class:`RunStopped` where Flower raises ``RunNotRunningException``, so that
    ``_pull_and_store_message`` takes its ordinary failure path (delete the message and its
    objects, finish the task as failed). Idempotent; FlowerInternalsMoved unless that function
    still has both paths."""
    current = module.pull_objects
    if getattr(current, "fails_stopped_runs", False):
        return
    source = _source(getattr(module, "_pull_and_store_message", None))
    needed = ("pull_objects(", "except Exception", "state.finish_task(", "except RunNotRunning")
    missing = [k for k in needed if k not in source]
    if missing:
        raise FlowerInternalsMoved(
            f"{module.__name__}._pull_and_store_message no longer has {', '.join(missing)}: "
            "simulations.supernode.fail_stopped_runs was written for flwr 1.42"
        )
    from flwr.supercore.run import RunNotRunningException

    @functools.wraps(current)
    def pull_objects(*args: Any, **kwargs: Any) -> Any:
        try:
            return current(*args, **kwargs)
        except RunNotRunningException as e:
            raise RunStopped(
                "the run stopped while this message's content was fetched: the message and "
                "its task are dropped"
            ) from e

    pull_objects.fails_stopped_runs = True  # type: ignore[attr-defined]
    module.pull_objects = pull_objects  # type: ignore[attr-defined]


RETRY_MODULE = "flwr.supercore.retry.http_retry"
"""Where Flower 1.42's HTTP retry reads its longest wait between two tries (20 s)."""


def _set_number(module_name: str, name: str, value: float) -> None:
    """Set Flower's numeric constant ``module_name.name`` in this process;
    FlowerInternalsMoved if it is not where flwr 1.42 has it."""
    import importlib

    module = importlib.import_module(module_name)
    if not isinstance(getattr(module, name, None), (int, float)):
        raise FlowerInternalsMoved(
            f"{module_name} has no {name}: simulations.supernode was written for flwr 1.42"
        )
    setattr(module, name, value)


def cap_retry_delay(max_s: float) -> None:
    """Make the SuperNode's HTTP retries (a lost connection to the SuperLink) wait at most
    ``max_s`` between two tries (Flower: up to 20 s), so that a hospital whose link comes back
    is connected again within about ``max_s`` instead of up to 20 s later. Each try is one
    connect attempt. FlowerInternalsMoved if the constant is not where flwr 1.42 has it."""
    _set_number(RETRY_MODULE, "MAX_RETRY_DELAY", max_s)


HEARTBEAT_MODULES = ("flwr.supercore.heartbeat", "flwr.supernode.fleet_http_connection")
"""Where Flower 1.42 reads the heartbeat interval a SuperNode announces and keeps (30 s)."""


def set_heartbeat(interval_s: float) -> None:
    """Make this process's SuperNode announce and keep a heartbeat every ``interval_s``
    (Flower: 30 s; the SuperLink takes 10-1800). FlowerInternalsMoved if the constant is not
    where flwr 1.42 has it."""
    for name in HEARTBEAT_MODULES:
        _set_number(name, "HEARTBEAT_DEFAULT_INTERVAL", interval_s)


def cap_sleeps(
    idle_s: float = 0.05, push_s: float = 0.02, idle_max_s: float = 0.5
) -> types.ModuleType:
    """Cap the SuperNode's sleeps and its object-pull backoff in this process (see the module
    docstring); the module."""
    import importlib

    module = importlib.import_module(MODULE)
    if not getattr(module.pull_objects, "fails_stopped_runs", False):
        short_backoff(module, "pull_objects")
        fail_stopped_runs(module)
    if isinstance(module.time, CappedTime):
        module.time.idle_s, module.time.push_s = idle_s, push_s
        module.time.idle_max_s = max(idle_s, idle_max_s)
        return module
    check_sleeps(module)
    module.time = CappedTime(idle_s, push_s, idle_max_s)  # type: ignore[attr-defined]
    return module


OPTIONS = {
    "--idle-s": 0.05,
    "--idle-max-s": 0.5,
    "--push-s": 0.02,
    "--retry-max-s": 2.0,
    "--heartbeat-s": 30.0,
}
"""The launcher's own options and their defaults (seconds)."""

RANGES = {"--heartbeat-s": (10.0, 1800.0)}
"""Bounds of an option other than [0.001, 10] (the heartbeat: what the SuperLink accepts)."""


def split_args(argv: list[str]) -> tuple[dict[str, float], list[str]]:
    """(this launcher's options, the rest for flower-supernode) from ``argv``."""
    values, rest = dict(OPTIONS), []
    it = iter(argv)
    for arg in it:
        if arg in OPTIONS:
            try:
                value = float(next(it))
            except (StopIteration, ValueError):
                raise SystemExit(f"{arg} needs a number of seconds") from None
            low, high = RANGES.get(arg, (0.001, 10.0))
            if not low <= value <= high:
                raise SystemExit(f"{arg} must be within [{low:g}, {high:g}]")
            values[arg] = value
        else:
            rest.append(arg)
    return values, rest


def main(argv: list[str] | None = None) -> int:
    """Cap the sleeps, then run Flower's ``flower-supernode`` with the other arguments."""
    opts, rest = split_args(sys.argv[1:] if argv is None else argv)
    cap_sleeps(opts["--idle-s"], opts["--push-s"], opts["--idle-max-s"])
    cap_retry_delay(opts["--retry-max-s"])
    set_heartbeat(opts["--heartbeat-s"])
    from flwr.common.logger import update_console_handler
    from flwr.supernode.cli import flower_supernode

    # a hospital's log says when each message came and went (colours only on a terminal)
    update_console_handler(timestamps=True, colored=sys.stderr.isatty())

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
