"""The virtual-clock server loop with 100, 1,000 and 10,000 instantly answering silos.

For each silo count, the whole server loop (dispatch with encoding, poll, intake, corrections,
fold, version bump) runs on the virtual clock against a fake Grid whose silos answer every
train message at once with a precomputed delta (cnn-small), so only the server's work is
timed. Twice per count: plain FedAsync, and with delay compensation and error feedback on
(``lab.corrections.delay_compensation=0.1``, ``lab.corrections.error_feedback_topk=0.1``).
Each run is its own process, so that its RSS is its own.

Reported per run: updates per wall second (over the whole run, whose first ``silos``
dispatches are part of it, and from the first update on), wall milliseconds per update, and
the server's memory at the end of the run, split into

- ``ef``: the error-feedback residuals (bytes of the tensors ``srv.pipeline.ef`` keeps);
- ``snapshots``: the weights kept for delay compensation and re-sending (unique tensor
  storages in the dispatcher's ``sent``), and how many versions they are;
- ``replies``: the replies pulled but not yet taken (on the virtual clock a reply waits
  until its finish time; instant silos all answer at once, so nearly every silo's is there);
- ``ledger``: the jobs in flight and the dispatcher's indexes of them, the retries, the
  roster, and the run statistics (per-silo table, staleness and accept-time lists, which grow
  with the updates, not the silos), as a deep ``sys.getsizeof`` walk (``gc.get_referents``,
  tensors by storage bytes, each object once): an estimate, not tracemalloc;
- ``rss``: the process's resident set growth from before the server was built.

Bytes per silo are each part over the silo count. Last line:
``server_scale_updates_per_s_<largest count>=<float>`` (fedasync with corrections).

    .venv/bin/python benchmarks/server_scale.py --silos 100,1000,10000
    .venv/bin/python benchmarks/server_scale.py --silos 1000 --versions 3000
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr.app import Message, MetricRecord, RecordDict  # noqa: E402

from medical_data.networks import build_network  # noqa: E402
from protocol import keys as P  # noqa: E402
from protocol import wire  # noqa: E402

CORRECTIONS = [
    "lab.corrections.delay_compensation=0.1",
    "lab.corrections.error_feedback_topk=0.1",
]


class InstantGrid:
    """A fake Flower Grid: ``silos`` nodes (node id = silo + 1) that answer every message at
    once, a train message with ``pool[silo % len(pool)]`` as their delta (also used by
    benchmarks/server_overhead.py)."""

    def __init__(self, silos: int, pool: list[dict[str, torch.Tensor]]) -> None:
        self.nodes = list(range(1, silos + 1))
        self.pool = pool
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return self.nodes

    def push_messages(self, msgs: Any) -> list[str]:
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
                    {P.ARRAYS: wire.encode(self.pool[silo % len(self.pool)]), P.METRICS: metrics}
                )
            self.replies[mid] = Message(rec, reply_to=m)
            ids.append(mid)
        return ids

    def pull_messages(self, ids: Any) -> list[Message]:
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def deep_size(root: Any) -> int:
    """Bytes reachable from ``root``: ``sys.getsizeof`` of every object once, tensors by their
    storage's bytes (each storage once); modules, classes and functions are not followed."""
    seen: set[int] = set()
    storages: set[int] = set()
    total = 0
    stack = [root]
    skip = (type, type(sys), type(deep_size), type(len))
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.data_ptr() not in storages:
                storages.add(s.data_ptr())
                total += s.nbytes()
            total += sys.getsizeof(obj)
            continue
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def tensor_bytes(groups: Any) -> tuple[int, int]:
    """(bytes, how many groups) of the unique tensor storages in a dict of tensor dicts."""
    seen: set[int] = set()
    total = 0
    for params in groups.values():
        for v in params.values():
            s = v.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total, len(groups)


def rss_bytes() -> int:
    """The process's resident set now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def make_server(silos: int, versions: int, run_dir: Path, overrides: list[str]) -> Any:
    """An ``AsyncServer`` on the virtual clock with ``silos`` instant silos (cnn-small,
    lognormal speeds, no evaluation, no checkpoints, no staleness bound), connected."""
    from flwr.supercore.task_identity import TaskIdentity

    from server.loop import AsyncServer
    from simulations.config import load_config

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # as Flower's
    torch.manual_seed(0)
    params = build_network("cnn-small", 1, 3, (28, 28)).state_dict()
    pool = [{k: torch.randn_like(v) * 1e-3 for k, v in params.items()} for _ in range(8)]
    cfg = load_config(
        None,
        [
            f"run.out_dir={run_dir}",
            "silos.count=3",  # (preflight builds this federation: the loop never reads it)
            "data.max_samples=600",
            f"run.max_versions={versions}",
            "run.budget_s=1e12",
            "lab.speed.profile=lognormal",
            "server.eval_every=100000000",
            "server.checkpoint_every=0",
            "server.max_staleness=null",
            *overrides,
        ],
    )
    cfg.silos.count = silos  # after preflight: the data has too few samples for 10,000
    srv = AsyncServer(cfg, InstantGrid(silos, pool), run_dir, params, evaluate_fn=None)
    srv.connect()
    return srv


def run_one(silos: int, versions: int, corrections: bool) -> dict[str, Any]:
    """One run of the loop; its rates and memory split (see the module docstring)."""
    torch.set_num_threads(1)
    rss0 = rss_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        srv = make_server(silos, versions, Path(tmp), CORRECTIONS if corrections else [])
        first: list[float] = []
        accept = srv.stats.accept

        def timed_accept(*a: Any, **k: Any) -> None:
            if not first:
                first.append(time.perf_counter())
            accept(*a, **k)

        srv.stats.accept = timed_accept
        t0 = time.perf_counter()
        srv.run()
        t1 = time.perf_counter()
        srv.events.close()
        n = srv.stats.updates_applied
        ef = srv.pipeline.ef
        ef_bytes = ef.nbytes()  # the residuals and the shared pool (residual_budget_mb)
        snap_bytes, snap_versions = tensor_bytes(srv.jobs.sent)
        jobs = srv.jobs
        indexes = [getattr(jobs, k, None) for k in ("unanswered", "_by_silo", "_down", "_refs")]
        ledger = deep_size(
            [jobs.inflight, jobs.retries, *indexes, srv.stats, srv.roster, srv.num_samples]
        )
        replies = deep_size(srv.arrived)
        out = {
            "silos": silos,
            "corrections": corrections,
            "updates": n,
            "wall_s": t1 - t0,
            "updates_per_s": n / (t1 - t0),
            "steady_updates_per_s": (n - 1) / (t1 - first[0]) if first and n > 1 else 0.0,
            "ms_per_update": 1e3 * (t1 - t0) / max(n, 1),
            "first_update_s": (first[0] - t0) if first else 0.0,
            "ef_bytes": ef_bytes,
            "snapshot_bytes": snap_bytes,
            "snapshot_versions": snap_versions,
            "dc_skipped": int(getattr(srv.stats, "dc_skipped", 0)),
            "replies_bytes": replies,
            "ledger_bytes": ledger,
            "rss_bytes": rss_bytes() - rss0,
        }
    return out


def _mb(b: float) -> str:
    return f"{b / 2**20:.1f}"


def _kb(b: float) -> str:
    return f"{b / 2**10:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of ``rows`` (MB in total, KB per silo)."""
    head = (
        "| silos | corrections | updates | updates/s | from 1st update/s | ms/update | "
        "EF residuals MB (KB/silo) | DC snapshots MB (versions) | replies held MB (KB/silo) | "
        "jobs+ledger MB (KB/silo) | RSS growth MB (KB/silo) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s = r["silos"]
        lines.append(
            f"| {s} | {'DC+EF' if r['corrections'] else 'none'} | {r['updates']} | "
            f"{r['updates_per_s']:.0f} | {r['steady_updates_per_s']:.0f} | "
            f"{r['ms_per_update']:.2f} | "
            f"{_mb(r['ef_bytes'])} ({_kb(r['ef_bytes'] / s)}) | "
            f"{_mb(r['snapshot_bytes'])} ({r['snapshot_versions']}) | "
            f"{_mb(r['replies_bytes'])} ({_kb(r['replies_bytes'] / s)}) | "
            f"{_mb(r['ledger_bytes'])} ({_kb(r['ledger_bytes'] / s)}) | "
            f"{_mb(r['rss_bytes'])} ({_kb(r['rss_bytes'] / s)}) |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--silos", default="100,1000,10000", help="comma-separated silo counts")
    ap.add_argument(
        "--versions",
        type=int,
        default=None,
        help="versions per run (default: 2 x silos, at least 2000)",
    )
    ap.add_argument(
        "--plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run without corrections",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:  # one run, in its own process
        silos, versions, corr = (int(x) for x in args.child.split(","))
        print(json.dumps(run_one(silos, versions, bool(corr))), flush=True)
        return
    rows = []
    counts = [int(s) for s in args.silos.split(",")]
    for silos in counts:
        versions = args.versions if args.versions is not None else max(2000, 2 * silos)
        for corr in [False, True] if args.plain else [True]:
            print(
                f"{silos} silos, {versions} versions, "
                f"{'delay compensation + error feedback' if corr else 'plain'} ...",
                flush=True,
            )
            out = subprocess.run(
                [sys.executable, __file__, "--child", f"{silos},{versions},{int(corr)}"],
                check=True,
                capture_output=True,
                text=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"  {row['updates']} updates in {row['wall_s']:.1f}s = "
                f"{row['updates_per_s']:.0f} updates/s "
                f"({row['steady_updates_per_s']:.0f}/s from the first update, "
                f"{row['first_update_s']:.1f}s to it), RSS +{_mb(row['rss_bytes'])} MB",
                flush=True,
            )
    print()
    print(table(rows))
    last = [r for r in rows if r["silos"] == counts[-1]][-1]
    print(f"server_scale_updates_per_s_{counts[-1]}={last['updates_per_s']:.1f}")


if __name__ == "__main__":
    main()
