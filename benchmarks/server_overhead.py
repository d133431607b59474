"""Server cost of taking one update, across model sizes, and server throughput with 100 silos.

1. For three sizes (cnn-small, 24k parameters, the default network; MONAI DenseNet121, 7.0M;
   a stack of 25 2000x2000 linear layers, 100M), the time the server spends on one reply as a
   multiple of one copy of the model's parameters (``clone()`` of every tensor, the issue's
   baseline; also against ``memcpy``, a copy of one flat buffer into a preallocated one: the
   memory-bandwidth floor). Taking a reply is what the server loop does with it: decode the
   packed arrays, validate (names, shapes, dtypes, staleness, norm, finiteness), correct,
   fold into the global model, check the new model finite. Four settings: plain, with delay
   compensation (DC-ASGD), with error feedback (global top-10%), with both. Each is run on
   the reference path (per-tensor arithmetic on a dict of tensors, the per-tensor top-k
   compressor) and the flat path (fedasync/flat.py: one buffer per dtype, fused and chunked
   passes, zero-copy decoding), side by side. A fifth, ``erasure``: a run that can erase
   (the packaged erasure defaults), whose take also adds the update into the span sketch
   and the fold's contribution into the silo's ledger sum; beside it, what that run keeps
   in memory and in checkpoints, in model copies, and its floor: the same arithmetic as one
   fused pass into preallocated buffers, with nothing else (timed in turns with the take and
   a copy). Medians of repetitions. Goals:
   plain <= 2x a copy, with DC and error feedback <= 6x.
2. Updates per second of the whole server loop (dispatch with encoding, poll, intake, fold,
   version bump) with 100 silos on a small network, the silos answering at once with a
   precomputed delta so that only the server's work is timed.

    .venv/bin/python benchmarks/server_overhead.py [--sizes cnn-small,densenet121,mlp-100m]
Last line: ``server_overhead_x_copy=<float>`` (flat path, plain, cnn-small).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402

from fedasync import NormOutlierDetector, Rejection, StalenessBound  # noqa: E402
from fedasync.corrections import topk  # noqa: E402
from fedasync.flat import flatten  # noqa: E402
from fedasync.tensors import is_finite  # noqa: E402
from medical_data.networks import build_network  # noqa: E402
from protocol import keys as P  # noqa: E402
from protocol import wire  # noqa: E402
from server.corrections import CorrectionPipeline  # noqa: E402
from server.intake import Accepted, Job, take_reply  # noqa: E402
from simulations.config import load_config  # noqa: E402

SIZES = {
    "cnn-small": 200,  # repetitions
    "densenet121": 20,
    "unet3d-small": 20,
    "mlp-100m": 3,
}
SETTINGS = {
    "plain": [],
    "DC": ["lab.corrections.delay_compensation=0.1"],
    "EF": ["lab.corrections.error_feedback_topk=0.1"],
    "DC+EF": [
        "lab.corrections.delay_compensation=0.1",
        "lab.corrections.error_feedback_topk=0.1",
    ],
    # a run that can erase, with the packaged erasure defaults: the fold attributes what it
    # applies to the silo (the ledger), and the update goes into the span sketch
    "erasure": ["erasures=[{silo: 0, at_s: 1.0e9}]"],
}
ERASURE = "erasure"
"""The setting whose take also does what a run that can erase does with each update."""
SILOS = 4
"""Silos of the erasure setting (the sketch's groups; the ledger holds one sum per silo)."""


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


def _model(name: str) -> torch.nn.Module:
    if name == "mlp-100m":
        return torch.nn.Sequential(*[torch.nn.Linear(2000, 2000) for _ in range(25)])
    if name == "unet3d-small":
        return build_network(name, 1, 4, (32, 32, 32))
    shape = (28, 28) if name == "cnn-small" else (64, 64)
    return build_network(name, 1, 3, shape)


def _intake(params, reply: Message, job: Job):
    """Only the intake of one reply (decode, validate, the norm)."""
    norms = NormOutlierDetector()
    for _ in range(5):
        norms.observe(1.0)
    bound = StalenessBound(max_staleness=20)

    def intake() -> Accepted:
        res = take_reply(
            reply, job, version=5, reference=params, roster={0: 1}, bound=bound, norms=norms
        )
        assert isinstance(res, Accepted), res
        return res

    return intake


def _taker(pipe: CorrectionPipeline, params, w_base, reply: Message, job: Job, erasure=None):
    """What the loop does with one reply: intake, corrections and fold, the finiteness check;
    with ``erasure`` (a calibration and a ledger), what a run that can erase adds: the update
    into the span sketch, and the fold's change into the silo's ledger sum (in the fold's own
    pass on the flat path, server/unlearning/sinks.py; after it on the reference path)."""
    from server.unlearning.sinks import UpdateSinks

    intake = _intake(params, reply, job)

    def take() -> None:
        res = intake()
        calibrate, sink = None, None
        if erasure is not None:
            cal = erasure[0]
            sink = UpdateSinks(cal.sketch, erasure[1], job.silo, 5)

            def calibrate(tensors):
                return cal.calibrate(job, tensors, res.norm)[0]

        fold = pipe.fold(
            params,
            res.update,
            staleness=res.staleness,
            factor=1.0,
            norm=res.norm,
            w_base=w_base,
            calibrate=calibrate,
            sink=sink,
        )
        assert not isinstance(fold, Rejection) and fold.params is not None
        assert is_finite(fold.params)
        if erasure is not None:
            assert fold.sunk or fold.contributions, "the fold attributes what it applies"
            for silo, part in fold.contributions.items():
                erasure[1].record(silo, part, 5)

    return take


def _as_folded(params):
    """``params`` as the server's loop holds its model after a fold: a fold of nothing into
    it (`fedasync.flat.axpy_sunk`), so that it knows it is finite and a bound on its
    elements, as every model a fused fold makes does."""
    from fedasync.flat import axpy_sunk, zeros_like

    out = axpy_sunk(0.0, zeros_like(params), params, [], loose_from=params)
    assert out is not None and out.finite and out.bound is not None
    return out


def _erasure(cfg) -> tuple:
    """A run's erasure parts: its calibration (with the span sketch) and its ledger."""
    from fedasync.unlearning import ContributionLedger
    from server.unlearning import Calibration

    return Calibration(cfg.unlearning, lab=cfg.lab.erasure, silos=SILOS), ContributionLedger()


def erasure_memory(parts: tuple, plain: dict[str, torch.Tensor]) -> None:
    """What a run that can erase keeps, in model copies: the span sketch (in memory and in
    every checkpoint: the calibration's state) and the ledger (one sum per silo)."""
    import io

    cal, ledger = parts
    model = sum(v.numel() * v.element_size() for v in plain.values() if v.is_floating_point())
    sketch = cal.sketch.nbytes
    buf = io.BytesIO()
    torch.save(cal.state_dict(), buf)
    ledger_bytes = sum(
        v.numel() * v.element_size()
        for s in ledger.silos()
        for v in (ledger.total(s) or {}).values()
    )
    print(
        f"erasure memory: span sketch {sketch / 1e6:.1f} MB = {sketch / model:.2f} model copies "
        f"(lab.erasure.sketch_rank={cal.sketch.rows}; the goal: at most rank + 2 = "
        f"{cal.sketch.rows + 2}); its checkpoint {buf.tell() / 1e6:.1f} MB = "
        f"{buf.tell() / model:.2f} copies; the ledger {ledger_bytes / model:.2f} copies "
        f"({len(ledger.silos())} silo(s) with contributions: one sum each)"
    )


def erasure_floor(params, update, take, copy, reps: int) -> dict[str, float]:
    """The floor of a take that can erase, and that take, timed in turns with a copy of the
    model (each repetition runs the three, so a noisy machine slows them alike): median
    seconds of each. The floor is the least memory traffic such a take needs, with nothing
    else (no decoding, no validation, no allocation): one chunked pass that reads the update
    and the model, writes the new model, and adds the update into a span-sketch row and the
    applied change (0.5·x) into the silo's ledger sum (both in place). A bound from below."""
    from fedasync.flat import CHUNK

    (x,), (y,) = update.buffers, params.buffers
    out, row, total = torch.empty_like(y), torch.zeros_like(y), torch.zeros_like(y)

    def fused() -> None:
        for i in range(0, y.numel(), CHUNK):
            c = slice(i, min(i + CHUNK, y.numel()))
            torch.add(y[c], x[c], alpha=0.5, out=out[c])
            row[c].add_(x[c], alpha=0.1)
            total[c].add_(x[c], alpha=0.5)

    fns = {"floor": fused, "take": take, "copy": copy}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(3 * reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def take_cost(name: str, reps: int) -> dict[tuple[str, str], float]:
    """Median seconds per reply for every (setting, path); prints a row per setting."""
    torch.manual_seed(0)
    plain = {k: v.detach().clone() for k, v in _model(name).state_dict().items()}
    n = sum(v.numel() for v in plain.values())
    delta = {
        k: torch.randn_like(v) * 1e-3 if v.is_floating_point() else v for k, v in plain.items()
    }
    job = Job("m", 0, 1, 0, 3, 0, 1, 0)
    reply = _reply(delta, job)
    base = {k: v + 0.01 if v.is_floating_point() else v for k, v in plain.items()}

    def clone() -> None:
        {k: v.clone() for k, v in plain.items()}

    copy = _median_time(clone, reps)
    buf = flatten(plain).buffers[0]
    dst = torch.empty_like(buf)
    memcpy = _median_time(lambda: dst.copy_(buf), reps)
    print(
        f"\n{name}: {n / 1e6:.3f} M parameters, {len(plain)} tensors; copy {copy * 1e3:.3f} ms, "
        f"memcpy {memcpy * 1e3:.3f} ms"
    )
    intake = _median_time(_intake(flatten(plain), reply, job), reps)
    print(
        f"intake alone (decode and validate, no arithmetic but the norm): {intake * 1e3:.3f} ms "
        f"({intake / copy:.2f}x copy)"
    )
    print("| setting | reference (ms) | x copy | flat (ms) | x copy | x memcpy | flat speed-up |")
    print("|---|---|---|---|---|---|---|")
    out: dict[tuple[str, str], float] = {}
    for setting, overrides in SETTINGS.items():
        row = {}
        for path in ("reference", "flat"):
            cfg = load_config(None, ["server.alpha=0.6", *overrides])
            pipe = CorrectionPipeline(cfg)
            if path == "reference" and pipe.error_feedback:
                pipe.ef.compress = topk  # the per-tensor compressor (the old default)
            conv = flatten if path == "flat" else (lambda p: {k: v.clone() for k, v in p.items()})
            parts = _erasure(cfg) if setting == ERASURE else None
            model = _as_folded(conv(plain)) if path == "flat" else conv(plain)
            take = _taker(pipe, model, conv(base), reply, job, parts)
            take()  # warm-up (first-touch allocations, the residual's first step)
            row[path] = out[(setting, path)] = _median_time(take, reps)
            if parts is not None and path == "flat":
                erasure_memory(parts, plain)
                t = erasure_floor(flatten(plain), flatten(delta), take, clone, reps)
                c = t["copy"]
                print(
                    f"erasure floor, timed in turns with the take and a copy: the arithmetic "
                    f"alone (one fused pass into preallocated buffers) {t['floor'] / c:.2f}x "
                    f"copy, with the intake {(t['floor'] + intake * c / copy) / c:.2f}x: the "
                    f"least a take that can erase costs (a goal below it is out of reach); the "
                    f"take {t['take'] / c:.2f}x copy, {t['take'] / t['floor']:.2f}x its floor"
                )
        ref, fl = row["reference"], row["flat"]
        print(
            f"| {setting} | {ref * 1e3:.3f} | {ref / copy:.2f} | {fl * 1e3:.3f} | {fl / copy:.2f} "
            f"| {fl / memcpy:.2f} | {ref / fl:.2f}x |"
        )
    out[("copy", "")] = copy
    out[("intake", "")] = intake
    return out


def residual_budget(silos: int = 1000, budget_mb: float = 512.0) -> None:
    """Error feedback for ``silos`` silos of DenseNet121 within ``budget_mb`` of residuals.

    One residual per silo would be ``silos`` models (28 MB each); with the budget the least
    recently used are merged into the shared pool. Each silo sends one update, in turn (the
    worst case for a budget: no silo comes back before every other has sent)."""
    from fedasync.corrections import ErrorFeedback

    torch.manual_seed(0)
    plain = {k: v.detach().clone() for k, v in _model("densenet121").state_dict().items()}
    pool = [
        flatten(
            {
                k: torch.randn_like(v) * 1e-3 if v.is_floating_point() else v
                for k, v in plain.items()
            }
        )
        for _ in range(4)
    ]
    one = pool[0].nbytes / 2**20
    ef = ErrorFeedback(0.1, budget_bytes=int(budget_mb * 2**20))
    peak, times = 0.0, []
    given = torch.zeros(pool[0].layout.numel, dtype=torch.float64)
    sent_total = torch.zeros_like(given)
    for i in range(silos):
        x = pool[i % len(pool)]
        t0 = time.perf_counter()
        sent = ef.apply(str(i), x)
        times.append(time.perf_counter() - t0)
        given += x.buffers[0]
        sent_total += sent.buffers[0]
        peak = max(peak, ef.nbytes() / 2**20)
        if i % 100 == 0:
            print(f"  residual budget: {i}/{silos} silos", file=sys.stderr, flush=True)
    held = torch.zeros_like(given)
    for key in ef.keys():
        r = ef.residual(key)
        assert r is not None
        held += flatten(r).buffers[0]
    pool_state = ef.state_dict()["pool"]
    if pool_state is not None:
        held += flatten(pool_state).buffers[0]
    lost = float((given - sent_total - held).abs().max())
    print(
        f"\nerror feedback, {silos} silos of densenet121 ({one:.1f} MB a residual), budget "
        f"{budget_mb:.0f} MB: residuals held at most {peak:.0f} MB (unbounded: "
        f"{silos * one / 1024:.1f} GB), {ef.merged} merged into the shared residual, "
        f"{len(ef.keys())} kept; apply median {statistics.median(times) * 1e3:.1f} ms; mass not "
        f"accounted for {lost:.1e} (float64 sums of float32 parts)"
    )


def loop_throughput(silos: int = 100, versions: int = 2000) -> float:
    """Updates per wall second of AsyncServer with ``silos`` instantly answering silos."""
    from server_scale import InstantGrid  # (benchmarks/, beside this file)

    from server.loop import AsyncServer
    from simulations.config import load_config

    torch.manual_seed(0)
    params = build_network("cnn-small", 1, 3, (28, 28)).state_dict()
    pool = [{k: torch.randn_like(v) * 1e-3 for k, v in params.items()} for _ in range(8)]

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            [
                f"run.out_dir={tmp}",
                f"silos.count={silos}",
                f"run.max_versions={versions}",
                "run.budget_s=1e9",
                "lab.speed.profile=lognormal",
                "server.eval_every=1000000",
                "server.checkpoint_every=0",
                "server.max_staleness=null",
            ],
        )
        grid = InstantGrid(silos, pool)
        srv = AsyncServer(cfg, grid, Path(tmp), params, evaluate_fn=None)  # type: ignore[arg-type]
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

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help="networks, of " + ", ".join(SIZES))
    ap.add_argument("--no-loop", action="store_true", help="skip the 100-silo loop")
    ap.add_argument(
        "--budget", action="store_true", help="also error feedback for 1,000 DenseNet121 silos"
    )
    args = ap.parse_args()
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = (1, 1, 1)  # as Flower's
    torch.set_num_threads(1)
    ratio = None
    for name in args.sizes.split(","):
        got = take_cost(name, SIZES[name])
        if name == "cnn-small":
            ratio = got[("plain", "flat")] / got[("copy", "")]
    if not args.no_loop:
        loop_throughput()
    if args.budget:
        residual_budget()
    if ratio is not None:
        print(f"server_overhead_x_copy={ratio:.2f}")


if __name__ == "__main__":
    main()
