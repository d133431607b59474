"""Teacher scorers as Ray actors: the engine's ``TeacherBackend`` with ``kind = "ray"``, on the
Ray that :class:`trainers.rl.ray_backend.RayBackend` started.

Paper: none (the engine's papers apply). The pool never starts or stops Ray; ``close()``
kills only its own actors. ``distill.teachers`` actors each build the teacher and load its weights, put once in
the object store; a group goes to the actor with the fewest pending requests and comes back
with its caches filled by :func:`trainers.rl.distill.score_group`, as the one-process
``LocalTeacher`` fills them (equal to rounding: an actor runs torch on one thread). A teacher
that dies (``die`` exits its process after scoring, before returning) is restarted once, and
every request that was pending on it is sent again (``restarts``, ``resent``, the job's
``attempts``); a request that fails in a live actor is sent once more. ``die`` goes only with a
request's first sending. A request that still fails after ``TEACHER_MAX_SENDS`` sendings
comes back unscored (its samples are then rejected by the engine and the group dropped), so
``collect`` never raises and never waits forever.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainers.rl.config import RLConfig
from trainers.rl.ray_backend import ACTOR_START_S, kill_actors
from trainers.rl.rollout import Group

if TYPE_CHECKING:
    from trainers.rl.backend import ScoreJob

log = logging.getLogger("fedasync.rl")

TEACHER_MAX_SENDS = 4
"""A teacher request sent this many times that fails again comes back unscored."""


class _Teacher:
    """The body of one teacher actor (decorated with ``ray.remote`` by the pool)."""

    def __init__(self, cfg: RLConfig, weights: list[Any], device_type: str):
        torch.set_num_threads(1)
        import ray

        from trainers.rl.teacher import build_teacher

        if device_type == "cuda" and not torch.cuda.is_available():
            device_type = "cpu"
        self.device = torch.device(device_type)
        self.teacher = build_teacher(cfg)
        self.teacher.load_state_dict(ray.get(weights[0]))
        self.teacher.to(self.device).eval()

    def pid(self) -> int:
        return os.getpid()

    def score(self, group: Group, top_k: int, die: bool) -> Group:
        """``group`` with its teacher caches filled. ``die``: exit before returning it."""
        from trainers.rl.distill import score_group

        score_group(self.teacher, group, top_k, self.device)
        if die:  # the teacher is lost holding the request
            os._exit(1)
        return group


@dataclass
class _Request:
    """A scoring request in flight on one teacher actor."""

    job: ScoreJob
    ref: Any
    actor: int
    generation: int
    """The actor's generation when the request was sent (bumped at each restart)."""
    sends: int
    """Times this pool has sent the job."""
    errors: int
    """Times it failed in a live actor."""


class RayTeacherPool:
    """``cfg.distill.teachers`` teacher actors on the running Ray: the engine's
    ``TeacherBackend`` with ``kind = "ray"``."""

    kind = "ray"

    def __init__(self, cfg: RLConfig, state: dict[str, torch.Tensor], device: torch.device):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayTeacherPool runs on a started Ray (the RayBackend's)")
        self.cfg, self.device = cfg, device
        self.top_k = cfg.distill.top_k
        self.teachers = cfg.distill.teachers
        self.restarts = 0
        self.resent = 0
        self.pending: dict[int, _Request] = {}  # by score job id
        self.actors: list[Any] = []
        self.generation = [0] * self.teachers
        self.pids_seen: set[int] = set()
        self._pid_refs: list[Any] = []  # pid calls of started actors, not yet fetched
        self._closed = False
        self.weights: Any = ray.put(state)  # once; every actor (and restart) fetches it
        try:
            self._remote = ray.remote(_Teacher)
            self.actors = [self._new_actor() for _ in range(self.teachers)]
            pids = ray.get(self._pid_refs, timeout=ACTOR_START_S)
        except BaseException:
            self.close()
            raise
        self._pid_refs = []
        self.pids_seen.update(pids)
        log.info("ray: %d teacher actors (pids %s)", self.teachers, pids)

    def _new_actor(self) -> Any:
        actor = self._remote.options(num_cpus=0, max_restarts=0).remote(
            self.cfg, [self.weights], self.device.type
        )
        self._pid_refs.append(actor.pid.remote())  # type: ignore[attr-defined]  # a Ray actor method  # its first call: answered once it is up
        return actor

    def _restart(self, i: int) -> None:
        import ray

        try:
            ray.kill(self.actors[i], no_restart=True)
        except Exception:  # already gone
            pass
        self.actors[i] = self._new_actor()
        self.generation[i] += 1
        self.restarts += 1

    def _least_loaded(self) -> int:
        load = [0] * self.teachers
        for r in self.pending.values():
            load[r.actor] += 1
        return min(range(self.teachers), key=lambda i: (load[i], i))

    def _send(self, job: ScoreJob, die: bool, sends: int, errors: int) -> None:
        i = self._least_loaded()
        ref = self.actors[i].score.remote(job.group, self.top_k, die)
        self.pending[job.job_id] = _Request(job, ref, i, self.generation[i], sends, errors)

    # ----------------------------------------------------------------- the TeacherBackend
    def submit(self, job: ScoreJob, die: bool) -> None:
        """Send ``job`` to the teacher with the fewest pending requests (``die`` with it)."""
        self._send(job, die, sends=1, errors=0)

    def collect(self, jobs: list[ScoreJob], wait_all: bool, timeout: float) -> list[ScoreJob]:
        """The jobs now ``done``: scored, or given up and unscored. Never raises."""
        import ray

        wait = None if wait_all or timeout == float("inf") else timeout
        for j in jobs:  # never sent here (it cannot happen; say so, do not wait for it)
            if not j.done and j.job_id not in self.pending:
                self._give_up(j, "it was not sent to the teachers")
        while True:
            requests = [self.pending[j.job_id] for j in jobs if not j.done]
            if not requests:
                break
            try:
                ready, _ = ray.wait(
                    [r.ref for r in requests], num_returns=len(requests), timeout=wait
                )
            except Exception as e:  # Ray itself failed: nothing more can arrive
                for r in requests:
                    self.pending.pop(r.job.job_id, None)
                    self._give_up(r.job, f"ray.wait failed: {type(e).__name__}")
                break
            arrived = {r.hex() for r in ready}
            for r in sorted(requests, key=lambda r: r.job.job_id):
                # a request re-sent while settling an earlier one is no longer this ref
                if r.ref.hex() in arrived and self.pending.get(r.job.job_id) is r:
                    self._settle(r)
            if not wait_all:
                break
        return [j for j in jobs if j.done]

    def _settle(self, r: _Request) -> None:
        """Fetch an arrived request: its scored group, or restart and re-send."""
        import ray
        from ray.exceptions import RayActorError

        try:
            group = ray.get(r.ref)
        except RayActorError:
            self._died(r)
        except Exception as e:  # the call failed in a live actor, or Ray lost its result
            r.errors += 1
            if r.errors >= 2:
                del self.pending[r.job.job_id]
                self._give_up(r.job, f"it failed twice ({type(e).__name__})")
            else:
                self._resend(r)
        else:
            del self.pending[r.job.job_id]
            r.job.group, r.job.done, r.job.scorer = group, True, r.actor

    def _died(self, r: _Request) -> None:
        """``r``'s actor died: restart it (once per generation) and re-send what it held."""
        import ray

        i = r.actor
        if r.generation != self.generation[i]:  # restarted already; its requests re-sent
            self._resend(r)
            return
        self._restart(i)
        held = sorted(
            (x for x in self.pending.values() if x.actor == i and x.generation == r.generation),
            key=lambda x: x.job.job_id,
        )
        others = [x for x in held if x is not r]
        ready: set[str] = set()
        if others:  # scored before it died: their results are kept
            try:
                done, _ = ray.wait([x.ref for x in others], num_returns=len(others), timeout=0)
                ready = {d.hex() for d in done}
            except Exception:
                pass
        resent = 0
        for x in held:
            if x is not r and x.ref.hex() in ready:
                try:
                    group = ray.get(x.ref, timeout=0)
                except Exception:
                    pass
                else:
                    del self.pending[x.job.job_id]
                    x.job.group, x.job.done, x.job.scorer = group, True, x.actor
                    continue
            self._resend(x)
            resent += 1
        log.warning(
            "teacher %d died scoring group %d: restarted, %d request(s) re-sent",
            i,
            r.job.group.group_id,
            resent,
        )

    def _resend(self, r: _Request) -> None:
        """Send ``r``'s job again (never with ``die``), or give it up after too many."""
        del self.pending[r.job.job_id]
        if r.sends >= TEACHER_MAX_SENDS:
            self._give_up(r.job, f"it was sent {r.sends} times")
            return
        try:
            self._send(r.job, die=False, sends=r.sends + 1, errors=r.errors)
        except Exception as e:
            self._give_up(r.job, f"sending it again failed ({type(e).__name__})")
            return
        self.resent += 1
        r.job.attempts += 1

    def _give_up(self, job: ScoreJob, why: str) -> None:
        """``job`` comes back unscored (the engine rejects its samples, drops the group)."""
        log.warning("teacher: group %d comes back unscored: %s", job.group.group_id, why[:200])
        job.done = True

    def close(self) -> None:
        """Kill this pool's actors (Ray itself keeps running); later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        import ray

        if ray.is_initialized():
            try:  # the pids of restarted actors that are up (for checks that none is left)
                if self._pid_refs:
                    n = len(self._pid_refs)
                    done, _ = ray.wait(self._pid_refs, num_returns=n, timeout=0)
                    self.pids_seen.update(ray.get(done, timeout=0))
            except Exception:
                pass
            kill_actors(self.actors)
        self.actors = []
        self.pending.clear()
        self._pid_refs = []
        self.weights = None
