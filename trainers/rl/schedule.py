"""The RL schedule: which group starts when and on which worker, under which version, and
which batch the learner takes next; the groups' state between those decisions (in flight,
to generate again, ready to learn) and its checkpoint.

Papers: AReaL (Fu et al. 2025) admission rule for bounded staleness; one-step-off (Noukhovitch
et al. 2024, asynchronous RLHF); multi-version streaming rollout after DORA (arXiv 2604.26256).

Groups are numbered 0, 1, 2, ...; group g is prompt ``task.sample(g, seed)``, its samples
drawn from a generator seeded by (seed, g), under the newest policy version a worker has when
it starts (the group is generated from start to end by that version). Batch k is groups
[kB, (k+1)B). The learner at version v makes version v+1 from one batch of B groups. Modes:

- ``sync``: batch v is generated under version v; the learner waits for all of it, workers
  wait for the learner.
- ``one_step_off``: batch k+1 is generated under version k while the learner trains on batch
  k (it starts when batch k is all generated); staleness 1.
- ``async``: group g of batch k may start once the learner's version is >= k − S; the learner
  takes batches in order, each once all of it has arrived. Staleness <= S by construction.
- ``streaming``: a group may start while fewer than (v + S + 1)·B groups have been admitted
  (dropped ones not counted); the learner takes the first B groups to finish, whatever their
  batch, so it never waits for a long tail. A group whose staleness would exceed S is dropped
  (aborted in flight at the version that makes it hopeless, freeing its worker).

With S = 0 the three rules admit the same groups under the same versions and the learner takes
the same batches, so ``async`` and ``streaming`` give the weights of ``sync`` bit for bit.

The schedule decides and keeps count; the engine (:mod:`trainers.rl.engine`) sends the jobs,
writes the events and keeps the statistics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from fedasync.staleness import StalenessBound
from fedasync.versions import staleness
from trainers.rl.backend import Job
from trainers.rl.config import RLConfig
from trainers.rl.rollout import Group


class Schedule:
    """The groups of one run between admission and the learner (``rollout.*`` sets the mode,
    S = ``max_staleness``, B = ``batch_groups`` and the workers)."""

    def __init__(self, cfg: RLConfig):
        r = cfg.rollout
        self.mode, self.S, self.B, self.workers = r.mode, r.max_staleness, r.batch_groups, r.workers
        self.bound = StalenessBound(max_staleness=self.S)
        self.next_group = 0
        self.next_job = 0
        self.admitted_dropped = 0  # dropped groups (streaming's admission does not count them)
        self.inflight: dict[int, Job] = {}  # by worker
        self.redo: list[tuple[int, int]] = []  # (group id, attempt) to generate again
        self.ready: list[tuple[float, Group]] = []  # (finish time, group) not yet learnt
        self.finished_per_batch: Counter[int] = Counter()

    def batch(self, g: int) -> int:
        """The batch of group ``g``."""
        return g // self.B

    def may_start(self, g: int, version: int) -> bool:
        """Whether group ``g`` may start now that the learner is at ``version`` (the mode's
        admission rule)."""
        k = self.batch(g)
        if self.mode == "sync":
            return k <= version
        if self.mode == "one_step_off":
            return k == 0 or (self.finished_per_batch[k - 1] >= self.B and version >= k - 1)
        if self.mode == "async":
            return k <= version + self.S
        return g - self.admitted_dropped < (version + self.S + 1) * self.B  # streaming

    def dispatch(self, version: int, now: float) -> Iterator[Job]:
        """The jobs to start now, one per free worker in worker order, each in flight once
        yielded (groups to redo first, in order; none past the first that may not start)."""
        for w in range(self.workers):
            if w in self.inflight:
                continue
            if self.redo and self.may_start(self.redo[0][0], version):
                g, attempt = self.redo.pop(0)
            elif not self.redo and self.may_start(self.next_group, version):
                g, attempt = self.next_group, 0
                self.next_group += 1
            else:
                return
            job = Job(self.next_job, g, w, version, attempt, now)
            self.next_job += 1
            self.inflight[w] = job
            yield job

    def done(self, job: Job) -> None:
        """``job``'s worker is free (its result taken, or the job aborted)."""
        del self.inflight[job.worker]

    def make_ready(self, now: float, group: Group) -> None:
        """``group`` may be learnt (since ``now``)."""
        self.ready.append((now, group))
        self.finished_per_batch[self.batch(group.group_id)] += 1

    def drop(self, group_id: int) -> None:
        """Count a dropped group: settled, its batch goes on without it."""
        self.admitted_dropped += 1
        self.finished_per_batch[self.batch(group_id)] += 1

    def take_batch(self, version: int) -> tuple[list[Group] | None, list[tuple[int, str]]]:
        """The batch the learner at ``version`` takes now (None: not yet), by group id, and
        the groups dropped on the way as (group id, reason): streaming takes the first B to
        finish and drops those staler than S; the other modes take batch ``version`` once all
        of it has arrived or been dropped."""
        dropped: list[tuple[int, str]] = []
        if self.mode == "streaming":
            self.ready.sort(key=lambda x: (x[0], x[1].group_id))
            kept: list[tuple[float, Group]] = []
            for item in self.ready:
                d = self.bound.check(staleness(version, item[1].version))
                if d.action == "reject":
                    self.drop(item[1].group_id)
                    dropped.append((item[1].group_id, f"stale: {d.reason}"))
                else:
                    kept.append(item)
            self.ready = kept
            if len(kept) < self.B:
                return None, dropped
            batch, self.ready = kept[: self.B], kept[self.B :]
        else:  # batches in order: batch v, once all of it has arrived
            mine = [x for x in self.ready if self.batch(x[1].group_id) == version]
            if self.finished_per_batch[version] < self.B:  # arrived or dropped
                return None, dropped
            batch = mine
            self.ready = [x for x in self.ready if self.batch(x[1].group_id) != version]
        return sorted((g for _, g in batch), key=lambda g: g.group_id), dropped

    def stale_in_flight(self, version: int) -> list[Job]:
        """Streaming: the jobs in flight that can no longer be learnt from at ``version``
        (to abort); none in the other modes."""
        if self.mode != "streaming":
            return []
        return [j for j in self.inflight.values() if version - j.version > self.S]

    def state_dict(self) -> dict[str, Any]:
        """The counters, the jobs in flight (without their results: they are sent again), the
        groups to redo and the ready groups."""
        return {
            "next_group": self.next_group,
            "next_job": self.next_job,
            "admitted_dropped": self.admitted_dropped,
            "inflight": [
                {k: v for k, v in asdict(j).items() if k not in ("group", "error", "finishes_at")}
                for j in self.inflight.values()
            ],
            "redo": [list(x) for x in self.redo],
            "ready": [[t, g.to_dict()] for t, g in self.ready],
            "finished_per_batch": {str(k): v for k, v in self.finished_per_batch.items()},
        }

    def load_state_dict(self, d: dict[str, Any]) -> list[Job]:
        """Restore ``state_dict``'s state; the jobs that were in flight, in flight again (the
        caller sends them again)."""
        self.next_group, self.next_job = int(d["next_group"]), int(d["next_job"])
        self.admitted_dropped = int(d["admitted_dropped"])
        self.redo = [(int(a), int(b)) for a, b in d["redo"]]
        self.ready = [(float(t), Group.from_dict(g)) for t, g in d["ready"]]
        self.finished_per_batch = Counter(
            {int(k): int(v) for k, v in d["finished_per_batch"].items()}
        )
        jobs = [Job(**j) for j in d["inflight"]]
        for job in jobs:
            self.inflight[job.worker] = job
        return jobs
