"""``flower-supernode`` with its fixed sleeps capped: a launcher, no edit of installed files.

Flower 1.42's SuperNode (``flwr.supernode.start_client_internal``) sleeps a hard-coded 3 s
whenever a pull from the SuperLink finds no message, and that happens right after every
reply (the server sends the silo's next job a few hundred milliseconds later, so the job
waits up to 3 s); it sleeps 0.5 s per check while waiting for the ClientApp's reply and for
an object's content. This launcher replaces that one module's ``time`` with a copy whose
``sleep`` caps the 3 s at ``--idle-s`` (default 0.1) and the 0.5 s at ``--push-s`` (default
0.02), then runs Flower's own ``flower-supernode`` with the remaining arguments.

The price: an idle SuperNode asks the SuperLink for work every ``--idle-s`` instead of every
3 s (one HTTPS request each; ``benchmarks/deployment_overhead.py`` reports the SuperLink's
and the SuperNodes' CPU).

    python -m simulations.supernode [--idle-s 0.1] [--push-s 0.02] <flower-supernode args>

``check_sleeps`` refuses to start when the sleeps are not where flwr 1.42 has them (an
upgrade moved them): silently slow would be worse than a clear error.
"""

from __future__ import annotations

import inspect
import sys
import time
import types
from typing import Any

IDLE_SLEEP_S = 3
"""The SuperNode's sleep after a pull that found no message (flwr 1.42)."""
PUSH_SLEEP_S = 0.5
"""Its sleep per check while waiting for a reply or an object's content (flwr 1.42)."""
MODULE = "flwr.supernode.start_client_internal"


class SleepsMoved(RuntimeError):
    """The SuperNode's sleeps are not where flwr 1.42 has them."""


def check_sleeps(module: types.ModuleType) -> None:
    """SleepsMoved unless ``module`` imports ``time`` and calls ``time.sleep(3)`` and
    ``time.sleep(0.5)`` (what ``cap_sleeps`` caps)."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):  # no source to read (a compiled-only install)
        source = ""
    found = {
        "import time": getattr(module, "time", None) is time,
        f"time.sleep({IDLE_SLEEP_S})": f"time.sleep({IDLE_SLEEP_S})" in source,
        f"time.sleep({PUSH_SLEEP_S})": f"time.sleep({PUSH_SLEEP_S})" in source,
    }
    missing = [k for k, ok in found.items() if not ok]
    if missing:
        from flwr.supercore.version import package_version

        raise SleepsMoved(
            f"{module.__name__} of flwr {package_version} no longer has {', '.join(missing)}: "
            "the SuperNode's sleeps moved; simulations.supernode was written for flwr 1.42"
        )


class CappedTime(types.ModuleType):
    """``time`` with ``sleep`` capped: the SuperNode's idle sleep at ``idle_s``, its shorter
    waits at ``push_s``; every other attribute is ``time``'s own."""

    def __init__(self, idle_s: float, push_s: float):
        super().__init__("time")
        self.idle_s = idle_s
        self.push_s = push_s

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, capped at ``idle_s`` (≥ 1 s asked) or ``push_s`` (less)."""
        time.sleep(min(seconds, self.idle_s if seconds >= 1.0 else self.push_s))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def cap_sleeps(idle_s: float = 0.1, push_s: float = 0.02) -> types.ModuleType:
    """Cap the SuperNode's sleeps in this process (see the module docstring); the module."""
    import importlib

    module = importlib.import_module(MODULE)
    if isinstance(module.time, CappedTime):
        module.time.idle_s, module.time.push_s = idle_s, push_s
        return module
    check_sleeps(module)
    module.time = CappedTime(idle_s, push_s)  # type: ignore[attr-defined]
    return module


def split_args(argv: list[str]) -> tuple[float, float, list[str]]:
    """(idle_s, push_s, the rest for flower-supernode) from ``argv``."""
    idle_s, push_s, rest = 0.1, 0.02, []
    it = iter(argv)
    for arg in it:
        if arg in ("--idle-s", "--push-s"):
            try:
                value = float(next(it))
            except (StopIteration, ValueError):
                raise SystemExit(f"{arg} needs a number of seconds") from None
            if not 0.001 <= value <= 10.0:
                raise SystemExit(f"{arg} must be within [0.001, 10]")
            if arg == "--idle-s":
                idle_s = value
            else:
                push_s = value
        else:
            rest.append(arg)
    return idle_s, push_s, rest


def main(argv: list[str] | None = None) -> int:
    """Cap the sleeps, then run Flower's ``flower-supernode`` with the other arguments."""
    idle_s, push_s, rest = split_args(sys.argv[1:] if argv is None else argv)
    cap_sleeps(idle_s, push_s)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
