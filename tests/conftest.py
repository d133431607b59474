import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# One intra-op thread per process (this pytest, its xdist workers and every command a test
# starts, which inherit the variable; set before any test module imports torch). The suite runs
# three workers on two cores, each starting processes of its own: with torch's default of a
# thread per core, OpenMP's spinning threads fought over the cores and the tiny models' steps
# ran many times slower (test_rl_profiles, test_rl_engine and test_pipeline_dist together on
# three workers: 11.3 min with the default, 2.9 min with one thread). The library sets its own
# counts where it means them (client.num_threads, the pipeline's threads, Ray's actors).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def small_cfg(tmp_path):
    """A tiny but real configuration: brain tissue patches, cnn-small, 3 silos."""
    from inprocess import SMALL

    from simulations.config import load_config

    def make(*overrides: str):
        base = [f"run.out_dir={tmp_path}", "run.name=t", *SMALL]
        return load_config(None, base + list(overrides))

    return make


def _parallel(config) -> bool:
    """Whether this run is spread over pytest-xdist workers (asked on the controller or on a
    worker, where xdist sets ``numprocesses`` to None and adds ``workerinput``)."""
    return hasattr(config, "workerinput") or bool(getattr(config.option, "numprocesses", None))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist: the files with ``slow`` tests first, so that the workers start on the
    long ones and the fast files fill the gaps (in file order the longest came last and ran
    alone at the end); and the ``serial`` tests, which cannot run beside others (another
    test's command would sweep their orphaned processes first), skipped, saying how to run
    them (``make test`` runs them alone, before the rest)."""
    if not _parallel(config):
        return
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept
    skip = pytest.mark.skip(reason="serial: run alone, `pytest -m serial` (as make test does)")
    for item in items:
        if item.get_closest_marker("serial") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_orphan_sweep_in_process(monkeypatch):
    """A command called in this process (``simulations.cli.main``) does not stop other runs'
    orphans: what a test prints must not depend on what other tests (other xdist workers)
    left on the machine (a bad-config test saw the sweep's warning line beside its one line).
    Subprocesses still sweep; the sweep itself is tested where it is called directly
    (test_run_ending, test_deploy_processes) and the CLI's call of it in test_user_errors."""
    import simulations.cli

    monkeypatch.setattr(simulations.cli, "sweep_orphans", lambda *a, **k: {})
