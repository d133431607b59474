"""Server cost of taking one update, and server throughput with 100 silos.

1. For the default network, the time the server spends on one reply (decode the packed arrays,
   validate names/shapes/finiteness/staleness/norm, correct, fold into the global model) as a
   multiple of one copy of the model's parameters (``clone()`` of every tensor), medians of
   many repetitions. Goal <= 3x. Also with delay compensation and error feedback switched on.
2. Updates per second of the whole server loop (dispatch with encoding, poll, intake, fold,
   version bump) with 100 silos on a small network, the silos answering at once with a
   precomputed delta so that only the server's work is timed.

    .venv/bin/python benchmarks/server_overhead.py
Last line: ``server_overhead_x_copy=<float>``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402

from fedasync import (  # noqa: E402
    ErrorFeedback,
    FedAsyncAggregator,
    NormOutlierDetector,
    StalenessBound,
    delay_compensate_delta,
    make_weight_fn,
)
from medical_data.networks import build_network  # noqa: E402
from protocol import keys as P  # noqa: E402
from protocol import wire  # noqa: E402
from server.intake import Accepted, Job, take_reply  # noqa: E402


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reply(delta: dict[str, torch.Tensor], job: Job) -> Message:
    ins = Message(
        RecordDict({P.CONFIG: ConfigRecord({})}), dst_node_id=job.node_id, message_type=P.TRAIN
    )
    ins.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    metrics = MetricRecord(
        {
            P.SILO: job.silo,
            P.JOB_ID: job.job_id,
            P.BASE_VERSION: job.base_version,
            P.NUM_SAMPLES: 100,
            "train_loss": 0.5,
        }
    )
    return Message(
        RecordDict({P.ARRAYS: wire.encode(delta), P.METRICS: metrics}),
        reply_to=ins,
    )


def take_cost(name: str, shape: tuple[int, int], reps: int = 200) -> float:
    torch.manual_seed(0)
    model = build_network(name, 1, 3, shape)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = sum(v.numel() for v in params.values())
    delta = {
        k: torch.randn_like(v) * 1e-3 if v.is_floating_point() else v for k, v in params.items()
    }
    job = Job(
        "m",
        silo=0,
        node_id=1,
        job_id=0,
        base_version=3,
        dispatched_at=0,
        finishes_at=1,
        wall_sent=0,
    )
    reply = _reply(delta, job)
    norms = NormOutlierDetector()
    for _ in range(5):
        norms.observe(1.0)
    bound = StalenessBound(max_staleness=20)
    agg = FedAsyncAggregator(0.6, make_weight_fn("polynomial", 0.5))
    ef = ErrorFeedback(0.1)
    w_base = {k: v + 0.01 if v.is_floating_point() else v for k, v in params.items()}

    def take(correct: bool) -> None:
        res = take_reply(
            reply, job, version=5, reference=params, roster={0: 1}, bound=bound, norms=norms
        )
        assert isinstance(res, Accepted), res
        t = res.update.tensors
        if correct:
            res.update.tensors = ef.apply("0", delay_compensate_delta(t, params, w_base, 0.1, 0.05))
        agg.fold(params, res.update, res.staleness)

    copy = _median_time(lambda: {k: v.clone() for k, v in params.items()}, reps)
    plain = _median_time(lambda: take(False), reps)
    corrected = _median_time(lambda: take(True), max(20, reps // 5))
    print(
        f"{name}: {n / 1e6:.3f} M parameters, copy {copy * 1e3:.3f} ms, take {plain * 1e3:.3f} ms "
        f"({plain / copy:.2f}x), with DC + error feedback {corrected * 1e3:.3f} ms ({corrected / copy:.2f}x)"
    )
    return plain / copy


def loop_throughput(silos: int = 100, versions: int = 2000) -> float:
    """Updates per wall second of AsyncServer with ``silos`` instantly answering silos."""
    from server.loop import AsyncServer
    from simulations.config import load_config

    torch.manual_seed(0)
    params = build_network("cnn-small", 1, 3, (28, 28)).state_dict()
    pool = [{k: torch.randn_like(v) * 1e-3 for k, v in params.items()} for _ in range(8)]

    class InstantGrid:
        def __init__(self) -> None:
            self.nodes = list(range(1, silos + 1))
            self.replies: dict[str, Message] = {}

        def get_node_ids(self):
            return self.nodes

        def push_messages(self, msgs):
            ids = []
            for m in msgs:
                mid = str(uuid.uuid4())
                m.metadata.__dict__["_message_id"] = mid
                silo = m.metadata.dst_node_id - 1
                if m.metadata.message_type == P.QUERY:
                    rec = RecordDict({P.METRICS: MetricRecord({P.SILO: silo, P.NUM_SAMPLES: 100})})
                else:
                    c = m.content[P.CONFIG]
                    metrics = MetricRecord(
                        {
                            P.SILO: silo,
                            P.JOB_ID: int(c[P.JOB_ID]),
                            P.BASE_VERSION: int(c[P.BASE_VERSION]),
                            P.NUM_SAMPLES: 100,
                        }
                    )
                    rec = RecordDict(
                        {
                            P.ARRAYS: wire.encode(pool[silo % len(pool)]),
                            P.METRICS: metrics,
                        }
                    )
                self.replies[mid] = Message(rec, reply_to=m)
                ids.append(mid)
            return ids

        def pull_messages(self, ids):
            return [self.replies.pop(i) for i in list(ids) if i in self.replies]

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            [
                f"run.out_dir={tmp}",
                f"silos.count={silos}",
                f"run.max_versions={versions}",
                "run.budget_s=1e9",
                "silos.speed_profile=lognormal",
                "server.eval_every=1000000",
                "server.checkpoint_every=0",
                "server.max_staleness=null",
            ],
        )
        srv = AsyncServer(cfg, InstantGrid(), Path(tmp), params, evaluate_fn=None)  # type: ignore[arg-type]
        srv.connect()
        t0 = time.perf_counter()
        srv.run()
        dt = time.perf_counter() - t0
        srv.events.close()
    rate = srv.stats.updates_applied / dt
    print(
        f"server loop, {silos} silos, cnn-small: {srv.stats.updates_applied} updates in {dt:.2f}s wall = {rate:.0f} updates/s "
        f"(staleness mean {statistics.mean(srv.stats.staleness_seen):.1f})"
    )
    return rate


def main() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = (
        1,
        1,
        1,
    )  # as Flower's runtimes do
    torch.set_num_threads(1)
    ratio = take_cost("cnn-small", (28, 28))
    take_cost("densenet121", (64, 64), reps=30)
    loop_throughput()
    print(f"server_overhead_x_copy={ratio:.2f}")


if __name__ == "__main__":
    main()
