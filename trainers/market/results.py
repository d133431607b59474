"""A finished seed's ``result.json``: written atomically with its config, and loaded back by
``run.resume`` only for a config that gives the same result for that seed."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from runkit.keys import SINK_KEYS
from trainers.market.config import MarketConfig, to_container

RESULT = "result.json"
"""A finished seed's result, in its folder (what ``run.resume`` loads)."""
MAY_DIFFER_ON_RESUME = frozenset(
    {
        "seed",
        "seeds",
        "name",
        "out_dir",
        "workers",
        "progress",
        "plots",
        "resume",
        "device",
        *SINK_KEYS,
    }
)
"""``run.*`` keys a loaded seed's config may differ in (none changes one seed's result)."""


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two configs (``to_container``) give the same result for one seed."""

    def key(c: dict[str, Any]) -> dict[str, Any]:
        run = {k: v for k, v in c.get("run", {}).items() if k not in MAY_DIFFER_ON_RESUME}
        return {"market": c.get("market"), "agent": c.get("agent"), "run": run}

    return key(a) == key(b)


def save_result(run_dir: Path, cfg: MarketConfig, result: dict[str, Any]) -> None:
    """Write a finished seed's ``result.json`` (with its config) atomically."""
    text = json.dumps({"config": to_container(cfg), "result": result})  # NaN kept as NaN
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, run_dir / RESULT)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_result(run_dir: Path, cfg: MarketConfig, seed: int) -> dict[str, Any] | None:
    """The seed's result saved in ``run_dir``, if it is there, whole and of ``cfg``; else None."""
    try:
        saved = json.loads((run_dir / RESULT).read_text())
        result = saved["result"]
        if result["seed"] == seed and _same_run(saved["config"], to_container(cfg)):
            return dict(result)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None
