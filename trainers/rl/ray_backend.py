"""Rollout workers as Ray actors: the engine's ``Backend`` with ``kind = "ray"``.

Paper: none (the engine's papers apply). One actor per worker index generates the groups the
engine gives that worker, with the same :func:`trainers.rl.rollout.generate_group` call as the
one-process ``LocalBackend``, so a virtual-clock run gives the same groups on either backend
(tokens and rewards equal; behaviour log-probs equal to rounding: an actor runs torch on one
thread). Weights go out by version through the object store: ``publish`` puts each version
once; a job carries the reference of its version (wrapped in a list, so Ray does not fetch it
for every call) and an actor fetches and loads it only when its loaded version differs.

Faults: ``die`` makes the actor generate the group and then exit its process before returning
it (the time is spent, the tokens are lost); the engine sees ``job.error`` and the backend
starts a fresh actor for that index. Any failure of an actor or of its call becomes
``job.error`` (one bounded line), never an exception out of ``collect``.

Ray's processes: when Ray is not running, the backend starts a private one as the simulation
launcher does (temp folder ``fa-ray-*`` with the owner file that
``fedasync.processes.sweep_orphans`` uses after a killed driver, every Ray process marked
with ``FEDASYNC_RAY_SESSION``) and ``close()`` stops it and waits, by pid, until none of its
processes is left. When Ray already runs, ``close()`` kills only this backend's actors.
``ray.init`` replaces SIGTERM's handler with its own: the command's handlers of SIGINT,
SIGTERM and SIGHUP are put back after it (:func:`fedasync.interrupt.handlers_kept`), so a
signal stops the run in the engine's own way (``trainers.rl.engine.RLRun.step_loop``), which
then closes the backend. A Ctrl-C to the
whole process group leaves Ray's processes running (its workers block SIGINT): the stop is
the run's, and ``close()`` ends them.

The teacher actors of on-policy distillation run on the Ray this backend starts:
:mod:`trainers.rl.ray_teacher`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedasync.interrupt import handlers_kept
from trainers.rl.config import RLConfig
from trainers.rl.tasks import Task

log = logging.getLogger("fedasync.rl")

ACTOR_START_S = 180.0
"""How long the first actors may take to start (import torch, build the policy)."""


def kill_actors(actors: list[Any]) -> None:
    """``ray.kill`` each of ``actors`` (no restart); one already gone is skipped."""
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone
            pass


def ray_available() -> str | None:
    """None when Ray can be used here, else a one-line reason."""
    try:
        import ray  # noqa: F401
        import ray.exceptions  # noqa: F401
    except Exception as e:  # ImportError, or a broken install failing on import
        first = str(e).strip().splitlines()[0][:150] if str(e).strip() else ""
        return f"cannot import ray: {type(e).__name__}: {first}"
    return None


class _RolloutWorker:
    """The body of one rollout actor (decorated with ``ray.remote`` by the backend)."""

    def __init__(self, cfg: RLConfig, index: int, device_type: str):
        torch.set_num_threads(1)
        from trainers.rl.backend import build_policy, build_task

        self.cfg, self.index = cfg, index
        if device_type == "cuda" and not torch.cuda.is_available():
            device_type = "cpu"
        self.device = torch.device(device_type)
        self.model = build_policy(cfg).to(self.device)
        self.model.eval()
        self.task = build_task(cfg)
        self.loaded: str | None = None  # the object id of the weights loaded

    def pid(self) -> int:
        return os.getpid()

    def generate(
        self, group_id: int, version: int, weights: list[Any], key: str, die: bool, nan: bool
    ) -> tuple[Any, int]:
        """Group ``group_id`` under ``version`` (weights ``weights[0]``, object id ``key``);
        returns it with this process's pid. ``die``: exit before returning it."""
        import ray

        from trainers.rl.rollout import generate_group

        if self.loaded != key:
            self.model.load_state_dict(ray.get(weights[0]))
            self.loaded = key
        group = generate_group(
            self.model,
            self.task,
            seed=self.cfg.run.seed,
            group_id=group_id,
            version=version,
            group_size=self.cfg.rollout.group_size,
            temperature=self.cfg.rollout.temperature,
            device=self.device,
            nan_first=nan,
            mc_samples=self.cfg.distill.mc_samples,
        )
        group.worker = self.index
        if die:  # the process is lost with the group's tokens
            os._exit(1)
        return group, os.getpid()


class RayBackend:
    """``cfg.rollout.workers`` rollout actors; weights by version through the object store."""

    kind = "ray"

    def __init__(self, cfg: RLConfig, task: Task, device: torch.device):
        import ray

        from fedasync.processes import RAY_SESSION_ENV, RAY_TMP_PREFIX, write_owner

        self.cfg, self.task, self.device = cfg, task, device
        self.workers = cfg.rollout.workers
        self.refs: dict[int, Any] = {}  # version -> ObjectRef of its weights
        self.pending: dict[int, tuple[Any, Any, int]] = {}  # job id -> (job, ref, generation)
        self.actors: list[Any] = []
        self.generation = [0] * self.workers  # bumped at each restart of a worker's actor
        self.restarts = [0] * self.workers
        self.pids_seen: list[set[int]] = [set() for _ in range(self.workers)]
        self.session: str | None = None  # the private Ray's temp folder, when we started it
        self.started_ray = False
        self._closed = False
        for name, value in (
            ("RAY_USAGE_STATS_ENABLED", "0"),
            ("RAY_DEDUP_LOGS", "0"),
            ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0"),
        ):
            os.environ.setdefault(name, value)
        logging.getLogger("ray").setLevel(logging.WARNING)
        if not ray.is_initialized():
            from fedasync.processes import sweep_orphans

            sweep_orphans()
            self.session = tempfile.mkdtemp(prefix=RAY_TMP_PREFIX)
            write_owner(Path(self.session))
            previous = os.environ.get(RAY_SESSION_ENV)
            os.environ[RAY_SESSION_ENV] = self.session  # inherited by every Ray process
            pythonpath = os.pathsep.join(p for p in sys.path if p)
            if os.environ.get("PYTHONPATH"):
                pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
            try:
                with handlers_kept():  # ray.init replaces SIGTERM's: the command's go back
                    ray.init(
                        address="local",
                        num_cpus=os.cpu_count() or 1,
                        include_dashboard=False,
                        log_to_driver=False,
                        logging_level="ERROR",  # type: ignore[arg-type]  # Ray hands it to logging, which takes names
                        _temp_dir=self.session,
                        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                    )
                self.started_ray = True
            except BaseException:
                self._stop_ray()
                raise
            finally:
                if previous is None:
                    os.environ.pop(RAY_SESSION_ENV, None)
                else:
                    os.environ[RAY_SESSION_ENV] = previous
        try:
            self._remote = ray.remote(_RolloutWorker)
            self.actors = [self._new_actor(w) for w in range(self.workers)]
            pids = ray.get([a.pid.remote() for a in self.actors], timeout=ACTOR_START_S)
        except BaseException:
            self.close()
            raise
        for w, pid in enumerate(pids):
            self.pids_seen[w].add(pid)
        log.info(
            "ray: %d rollout actors (pids %s)%s",
            self.workers,
            pids,
            f", private Ray in {self.session}" if self.session else ", on the running Ray",
        )

    def _new_actor(self, w: int) -> Any:
        # num_cpus=0: every worker gets its actor, however many cores the node has
        return self._remote.options(num_cpus=0, max_restarts=0).remote(
            self.cfg, w, self.device.type
        )

    def _restart(self, w: int) -> None:
        import ray

        try:
            ray.kill(self.actors[w], no_restart=True)
        except Exception:  # already gone
            pass
        self.actors[w] = self._new_actor(w)
        self.generation[w] += 1
        self.restarts[w] += 1
        log.info("ray: restarted the actor of worker %d", w)

    # ----------------------------------------------------------------- the Backend protocol
    def publish(self, version: int, params: dict[str, torch.Tensor]) -> None:
        """Put ``version``'s weights in the object store, once."""
        import ray

        self.refs[version] = ray.put(params)

    def retire(self, below: int) -> None:
        """Drop the references of versions below ``below`` (the object store frees them)."""
        for v in [v for v in self.refs if v < below]:
            del self.refs[v]

    def submit(self, job: Any, die: bool, nan: bool) -> None:
        """Send the group to its worker's actor, with the reference of its version's weights."""
        w = job.worker
        ref = self.refs[job.version]
        result = self.actors[w].generate.remote(
            job.group_id, job.version, [ref], ref.hex(), die, nan
        )
        self.pending[job.job_id] = (job, result, self.generation[w])

    def collect(self, jobs: list[Any], wait_all: bool, timeout: float) -> list[Any]:
        """The jobs whose group or error has arrived; a worker's earlier job that nobody asks
        for any more was abandoned and is forgotten. Never raises: a failure is ``job.error``."""
        import ray

        waiting = [self.pending[j.job_id][1] for j in jobs if self._unsettled(j)]
        if waiting:
            ready, _ = ray.wait(
                waiting,
                num_returns=len(waiting),
                timeout=None if wait_all or timeout == float("inf") else timeout,
            )
            done = {r.hex() for r in ready}
            asked = {j.job_id for j in jobs}
            for j in jobs:
                if self._unsettled(j) and self.pending[j.job_id][1].hex() in done:
                    self._settle(j)
                    # an actor runs its calls in order: an earlier call of this worker that
                    # nobody asks for was abandoned (streaming aborts stale groups in flight)
                    for i in [
                        i
                        for i, (o, _, _) in self.pending.items()
                        if o.worker == j.worker and i < j.job_id and i not in asked
                    ]:
                        del self.pending[i]
        elif (
            not wait_all
            and timeout != float("inf")
            and not any(j.group is not None or j.error is not None for j in jobs)
        ):
            time.sleep(timeout)  # nothing to wait for: do not spin the caller's loop
        for j in jobs:  # a job never submitted here (it cannot happen; say so if it does)
            if j.group is None and j.error is None and j.job_id not in self.pending:
                j.error = f"worker {j.worker}: group {j.group_id} was not submitted to Ray"
        return [j for j in jobs if j.group is not None or j.error is not None]

    def _unsettled(self, job: Any) -> bool:
        return job.group is None and job.error is None and job.job_id in self.pending

    def _settle(self, job: Any) -> None:
        """Fetch a ready job's result into ``job.group`` or ``job.error``."""
        import ray
        from ray.exceptions import RayActorError

        _, ref, generation = self.pending.pop(job.job_id)
        w = job.worker
        try:
            group, pid = ray.get(ref)
        except RayActorError as e:
            job.error = f"worker {w} died generating group {job.group_id} ({type(e).__name__})"
            if generation == self.generation[w]:
                self._restart(w)
            return
        except Exception as e:  # the call failed in a live actor, or Ray lost the result
            first = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            job.error = (f"worker {w} failed on group {job.group_id}: {type(e).__name__}: {first}")[
                :300
            ]
            return
        self.pids_seen[w].add(pid)
        group.worker = w
        job.group = group

    def worker_pids(self) -> list[int]:
        """The pid of each worker's current actor (asks them)."""
        import ray

        return list(ray.get([a.pid.remote() for a in self.actors], timeout=ACTOR_START_S))

    def session_pids(self) -> list[int]:
        """Live processes of the private Ray this backend started (none when it did not)."""
        from fedasync.processes import RAY_SESSION_ENV, alive, pids_with_env

        if self.session is None:
            return []
        return [p for p in pids_with_env(RAY_SESSION_ENV, self.session) if alive(p)]

    def close(self) -> None:
        """Kill this backend's actors and, when it started Ray, stop Ray and wait until none of its
        processes is left; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        import ray

        self.pending.clear()
        self.refs.clear()
        if ray.is_initialized():
            kill_actors(self.actors)
        self.actors = []
        if self.started_ray:
            self._stop_ray()

    def _stop_ray(self, grace_s: float = 10.0) -> None:
        """ray.shutdown, then wait for every process of the private Ray by pid (SIGTERM,
        then SIGKILL, what outlives ``grace_s``) and remove its temp folder."""
        import ray

        from fedasync.processes import stop_session_processes

        if ray.is_initialized():
            ray.shutdown()
        if self.session is None:
            return
        stop_session_processes(self.session, grace_s)
        shutil.rmtree(self.session, ignore_errors=True)
