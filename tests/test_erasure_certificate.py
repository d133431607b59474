"""The erasure certificate (server/erasure/certificate*.py): built from a real erasure's store and
event log, its JSON, its HTML (escaped, bounded, fetching nothing), its regeneration, the
Certificate RPC's access control and bound, ``fedasync erase certificate`` online and offline,
and the page as headless Chromium renders it."""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import time
from dataclasses import asdict
from html.parser import HTMLParser
from pathlib import Path

import grpc
import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from protocol.ids import digest
from server.app import run_server
from server.erasure.auth import Authorizer, Principal
from server.erasure.catalog import StaticCatalog
from server.erasure.certificate import build, sample_digest, to_json
from server.erasure.certificate_html import CSP, render
from server.erasure.gen import erasure_pb2 as pb
from server.erasure.gen import erasure_pb2_grpc
from server.erasure.limits import Limits
from server.erasure.readings import (
    READINGS,
    TOLERANCES,
    score_band,
    verdict,
)
from server.erasure.records import RequestNotFound
from server.erasure.service import ErasureService, serve
from server.erasure.states import REMOVAL_NOTE, State, can_transition, is_terminal
from server.erasure.store import ErasureStore
from server.unlearning.attest import model_sha256
from server.unlearning.lifecycle import _checked
from server.unlearning.requests import Erasure
from simulations.config import load_config
from simulations.erase_cli import main as erase

TOKENS = {"admin": "tok-admin", **{f"silo-{i}": f"tok-silo-{i}" for i in range(3)}}
C = grpc.StatusCode
HOSTILE = '<script>alert("x")</script><img src="http://evil.example/a.png"> & "quotes"'


@pytest.fixture(scope="module")
def erased(tmp_path_factory):
    """One real run (3 silos, the real ClientApp in process): 30% of silo 2's samples erased
    at t=10 s with a backdoor on silo 2, checked every version after the boundary, calibrated
    in the signature subspace (so updates carry their overlap), checked 4 versions later (its
    forget set holds the backdoor's samples, whose membership AUC against clean test data is
    far below 0.5: it ends ``unverified``, the check naming that figure)."""
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(
        None,
        [
            f"run.out_dir={out}",
            "run.name=t",
            "lab.compare_sync=false",
            "run.progress=false",
            "run.budget_s=1000",
            "run.max_versions=30",
            "silos.count=3",
            "lab.speed.profile=uniform",
            "client.local_steps=2",
            "client.batch_size=16",
            "data.max_samples=600",
            "server.eval_every=5",
            "server.checkpoint_every=0",
            "server.evaluate_silos=false",
            "erasures=[{silo: 2, at_s: 10, fraction: 0.3}]",
            "lab.erasure.relearn_versions=4",
            "lab.erasure.watch_every=1",
            "lab.erasure.protect=subspace",
            "lab.backdoor.enabled=true",
            "lab.backdoor.silo=2",
            "lab.backdoor.target_label=0",
        ],
    )
    run_dir = out / "t"
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in ("verified", "unverified")
    store = ErasureStore(run_dir / "erasures.sqlite", readonly=True)
    try:
        yield run_dir, store, store.get(req["id"])
    finally:
        store.close()


def _cert(erased, **kw):
    run_dir, store, r = erased
    return build(store, r.id, events=run_dir / "metrics.jsonl", **kw)


def _copy_run(run_dir: Path, to: Path) -> None:
    """The run's store (a consistent copy, its WAL included: SQLite's backup) and event log."""
    with (
        sqlite3.connect(run_dir / "erasures.sqlite") as src,
        sqlite3.connect(to / "erasures.sqlite") as dst,
    ):
        src.backup(dst)
    shutil.copy(run_dir / "metrics.jsonl", to / "metrics.jsonl")


def _check(cert, cid):
    return next(c for c in cert["checks"] if c["id"] == cid)


# -- the JSON -------------------------------------------------------------------------------


def test_the_certificate_of_a_real_erasure(erased):
    run_dir, store, r = erased
    cert = _cert(erased)
    # who asked, when, which silo and which samples: digests, never the ids
    req = cert["request"]
    assert (req["id"], req["silo"], req["scope"]) == (r.id, 2, "samples")
    assert req["state"] == r.state.value in ("verified", "unverified")
    assert req["requester"] == "schedule" and req["submitted_at_ms"] == r.created_at_ms
    assert req["samples"]["count"] == len(r.sample_ids) > 0
    assert req["samples"]["digests"] == sorted(sample_digest(r.id, s) for s in r.sample_ids)
    text = to_json(cert) + render(cert)
    assert not [s for s in r.sample_ids if f'"{s}"' in text or f">{s}<" in text]
    # the timeline, in order, from the store's rows and the run's clock
    steps = cert["timeline"]
    assert [s["step"] for s in steps] == [
        "requested",
        "silo_started",
        "in_global_model",
        "calibration",
        "checked",
    ]
    assert all(s["reached"] for s in steps)
    assert [s["time_ms"] for s in steps] == sorted(s["time_ms"] for s in steps)
    events = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"event": "erasure"' in line
    ]
    clock = {e["state"]: e["t"] for e in events}
    end = clock[r.state.value]
    assert steps[1]["clock_t"] == clock["erasing"] and steps[4]["clock_t"] == end
    assert clock["calibrating"] <= steps[3]["clock_t"] <= end
    # the model's version and SHA-256 before, at the boundary and when verified
    model = cert["model"]
    assert model["after"]["version"] == r.boundary_version == steps[2]["model_version"]
    assert model["before"]["version"] == r.boundary_version - 1
    assert model["checked"]["version"] == steps[4]["model_version"] > r.boundary_version
    shas = [model[k]["sha256"] for k in ("before", "after", "checked")]
    assert all(re.fullmatch("[0-9a-f]{64}", s) for s in shas)
    assert model["changed"] == (shas[0] != shas[1])
    assert shas[2] != shas[1], "four versions of training after the boundary moved the model"


def test_each_figure_has_its_reference(erased):
    cert = _cert(erased)
    _, store, r = erased
    boundary = [a for a in store.audit(r.id) if a.to_state is State.CALIBRATING][-1]
    at = {f["name"]: f for f in _check(cert, "at_boundary")["figures"]}
    assert (
        at["mia_auc"]["value"] == boundary.metrics["mia_auc"] and at["mia_auc"]["reference"] == 0.5
    )
    assert at["forget_accuracy"]["reference"] == boundary.metrics["test_accuracy"]
    assert at["asr"]["reference"] == boundary.metrics["asr_without_trigger"]
    # the verification reports its sample counts; the server's AUC (non-members from the
    # global test set) is shown, not judged: the silo's own test judges membership
    n, k = boundary.metrics["mia_members"], boundary.metrics["mia_nonmembers"]
    assert n == k == min(boundary.metrics["forget_samples"], boundary.metrics["test_samples"])
    assert at["mia_auc"]["verdict"] == "informational" and "silo's own" in at["mia_auc"]["rule"]
    silo = {f["name"]: f for f in _check(cert, "silo_membership")["figures"]}
    assert silo["silo_auc"]["band"] == boundary.metrics["silo_auc_band"]
    auc, band = silo["silo_auc"]["value"], boundary.metrics["silo_auc_band"]
    assert silo["silo_auc"]["verdict"] == ("within" if abs(auc - 0.5) <= band else "not within")
    assert silo["silo_auc"]["tolerance"] == band
    cal = _check(cert, "calibration")
    assert cal["ran"] and cal["settings"]["calibration_protect"] == "subspace"
    mean = next(f for f in cal["figures"] if f["name"] == "overlap_mean")
    assert mean["count"] >= 1 and 0.0 <= mean["value"] <= 1.0
    res = _check(cert, "resurfacing")
    assert [p["since_boundary"] for p in res["points"]] == [1, 2, 3]
    assert {f["name"] for f in res["figures"]} >= {"forget_accuracy", "mia_auc", "asr"}
    work = {f["name"]: f["value"] for f in _check(cert, "silo_work")["figures"]}
    assert work["refused_erased"] == 0 and work["jobs_cancelled"] >= 0


def test_what_was_not_verified_is_said_plainly(erased):
    cert = _cert(erased)
    missing = {x["check"]: x["why"] for x in cert["not_verified"]}
    assert "--reference" in missing["distance to retraining"]
    assert "deletion of the records at the silo" in missing
    assert not _check(cert, "retraining")["ran"]
    page = render(cert)
    section = page[page.index("What was NOT verified") :]
    for check in missing:
        assert html.escape(check) in section
    # a request not yet carried out: nothing of it is claimed
    store = ErasureStore(":memory:")
    q, _ = store.submit(1, ["a"], "silo-1", 3)
    early = build(store, q.id)
    assert {"the erasure itself", "the relearning check"} <= {
        x["check"] for x in early["not_verified"]
    }
    assert not any(c["ran"] for c in early["checks"]) and not early["outcome"]["verified"]
    assert [s["reached"] for s in early["timeline"]] == [True, False, False, False, False]


def test_every_figure_of_a_real_certificate_has_a_reading(erased):
    _, store, r = erased
    cert = _cert(erased)
    figures = [(c["id"], f) for c in cert["checks"] for f in c["figures"]]
    assert len(figures) > 15
    for cid, f in figures:
        assert f["verdict"] in READINGS and f["rule"], (cid, f["name"])
        if f["verdict"] != "informational":
            assert isinstance(f["tolerance"], float), (cid, f["name"])
    # the top verdict is read from them, and the lifecycle read the same figures alike
    v = cert["verdict"]
    failing = [(c, f["name"]) for c, f in figures if f["verdict"] == "not within"]
    assert v["reading"] == ("not verified" if failing else "verified") == cert["outcome"]["reading"]
    assert [(x["check"], n) for x in v["not_within"] for n in x["figures"]] == failing
    assert r.state.value == ("unverified" if failing else "verified")
    detail = [a for a in store.audit(r.id) if a.to_state is r.state][-1].detail
    for x in v["not_within"]:
        assert f"{x['check']} ({', '.join(x['figures'])})" in detail
    assert v["tolerances"] == asdict(TOLERANCES)


def _applied(metrics, after=None, to=State.VERIFIED):
    """A store with one request of silo 1 applied with the boundary ``metrics``, then moved to
    ``to`` with ``after`` (None: left calibrating)."""
    store = ErasureStore(":memory:")
    r, _ = store.submit(1, ["a", "b"], "silo-1", 3)
    store.transition(r.id, State.ERASING, actor="server", model_version=3)
    store.transition(
        r.id, State.CALIBRATING, actor="server", model_version=4, boundary_version=4,
        metrics=metrics,
    )  # fmt: skip
    if after is not None:
        store.transition(r.id, to, actor="server", model_version=9, metrics=after)
    return store, r.id


GOOD = {
    "forget_accuracy": 0.70, "test_accuracy": 0.70, "mia_auc": 0.52, "asr": 0.10,
    "asr_without_trigger": 0.09, "score_before": 0.71, "score_after": 0.70,
    "boundary_dip": 0.01, "silo_auc": 0.55, "silo_auc_band": 0.08, "delta_norm": 0.4,
    "delta_bound": 0.6,
}  # fmt: skip
AFTER = {
    "forget_accuracy": 0.72, "test_accuracy": 0.72, "mia_auc": 0.51, "reversion_ratio": 0.1,
    "score": 0.70,
}  # fmt: skip


def test_a_figure_out_of_tolerance_is_never_called_verified():
    # all within: verified
    store, rid = _applied(GOOD, AFTER)
    cert = build(store, rid)
    assert cert["verdict"]["reading"] == "verified" and cert["verdict"]["not_within"] == []
    assert cert["outcome"]["verified"] and "is verified" in cert["outcome"]["statement"]
    # the forget set scored 0.2 above unseen data (tolerance 0.05), in a store whose request
    # was moved to verified (as an older server did): the certificate still says not verified
    bad = {**GOOD, "forget_accuracy": GOOD["test_accuracy"] + 0.2}
    for to in (State.VERIFIED, State.UNVERIFIED):
        store, rid = _applied(bad, AFTER, to)
        cert = build(store, rid)
        v = cert["verdict"]
        assert v["reading"] == "not verified" and not cert["outcome"]["verified"]
        assert v["not_within"] == [
            {"check": "at_boundary", "title": _check(cert, "at_boundary")["title"],
             "figures": ["forget_accuracy"]}
        ]  # fmt: skip
        (f,) = [f for f in _check(cert, "at_boundary")["figures"] if f["verdict"] == "not within"]
        assert (f["name"], f["side"], f["tolerance"]) == ("forget_accuracy", "above", 0.05)
        assert "NOT verified" in cert["outcome"]["statement"]
        assert "at_boundary (forget_accuracy)" in cert["outcome"]["statement"]
        page = render(cert)
        top = page[: page.index('id="request"')]
        assert "not verified" in top and "Forgetting at the erasure boundary" in top
    # a request in progress reads as such, a failed one as failed
    store, rid = _applied(bad)
    assert build(store, rid)["verdict"]["reading"] == "calibrating"
    store.transition(rid, State.FAILED, actor="server", model_version=5, detail="x")
    assert build(store, rid)["verdict"]["reading"] == "failed"


@pytest.mark.parametrize(
    ("change", "check", "name"),
    [
        ({"forget_accuracy": 0.95}, "at_boundary", "forget_accuracy"),  # still recognised
        ({"asr": 0.30}, "at_boundary", "asr"),
        # the global score has not come back by verification (0.70 against 0.95 before)
        ({"score_before": 0.95}, "resurfacing", "score_recovered"),
        ({"silo_auc": 0.7}, "silo_membership", "silo_auc"),
        # above its bound, yet not clipped (no clip_factor): the delta applied is over it
        ({"delta_norm": 6.0}, "bound", "delta_applied"),
    ],
)
def test_the_lifecycle_reads_the_certificate_s_verdict(change, check, name):
    e = Erasure("r1", 1, ["a", "b"], 0.0)
    e.metrics_at_boundary = dict(GOOD)
    assert _checked(e, dict(AFTER)) == (State.VERIFIED, "all 7 judged figures within")
    e.metrics_at_boundary = {**GOOD, **change}
    state, why = _checked(e, dict(AFTER))
    assert state is State.UNVERIFIED and f"{check} (" in why and name in why
    store, rid = _applied(e.metrics_at_boundary, AFTER, state)
    assert why in build(store, rid)["verdict"]["summary"]  # one verdict, the same words
    assert can_transition(State.CALIBRATING, State.UNVERIFIED) and is_terminal(State.UNVERIFIED)


def test_a_clipped_delta_is_within_its_bound_and_says_how_much_was_applied():
    # the silo sent a delta of norm 6 against a bound of 0.6: clipped, a tenth applied
    e = Erasure("r1", 1, ["a", "b"], 0.0)
    e.metrics_at_boundary = {**GOOD, "delta_norm": 6.0, "clip_factor": 0.1}
    assert _checked(e, dict(AFTER)) == (State.VERIFIED, "all 7 judged figures within")
    store, rid = _applied(e.metrics_at_boundary, AFTER)
    bound = _check(build(store, rid), "bound")
    figs = {f["name"]: f for f in bound["figures"]}
    assert figs["delta_applied"]["value"] == pytest.approx(0.6)
    assert (
        figs["delta_applied"]["reference"] == 0.6 and figs["delta_applied"]["verdict"] == "within"
    )
    assert (figs["delta_norm"]["value"], figs["delta_norm"]["verdict"]) == (6.0, "informational")
    assert (figs["clip_factor"]["value"], figs["clip_factor"]["verdict"]) == (0.1, "informational")
    assert any("10.0% of it was applied" in n for n in bound["notes"])


def test_the_forgetting_tolerances_follow_the_noise_at_the_sample_counts():
    # forget 0.75 over 12 samples against test 0.55 over 120: 1.96 pooled standard errors
    tol, source, _ = score_band({"forget_samples": 12, "test_samples": 120}, 0.75, 0.55)
    p = (0.75 * 12 + 0.55 * 120) / 132
    assert source == "noise" and tol == pytest.approx(
        1.96 * (p * (1 - p) * (1 / 12 + 1 / 120)) ** 0.5, rel=1e-3
    )
    assert score_band({"forget_samples": 5000, "test_samples": 5000}, 0.7, 0.7)[:2] == (
        0.05,
        "floor",
    )
    assert score_band({}, 0.7, 0.7)[:2] == (0.05, "fixed")

    # in a certificate: a forget score 0.2 above the test score over 12 samples is within,
    # over 1000 it is not
    small = {"mia_members": 8, "mia_nonmembers": 8, "forget_samples": 12, "test_samples": 120}
    large = {
        "mia_members": 120,
        "mia_nonmembers": 120,
        "forget_samples": 1000,
        "test_samples": 1000,
    }
    moved = {"mia_auc": 0.375, "forget_accuracy": 0.9}
    for counts, ok, source in ((small, True, "noise"), (large, False, "floor")):
        e = Erasure("r1", 1, ["a", "b"], 0.0)
        e.metrics_at_boundary = {**GOOD, **moved, **counts}
        state, why = _checked(e, dict(AFTER))
        assert state is (State.VERIFIED if ok else State.UNVERIFIED), why
        store, rid = _applied(e.metrics_at_boundary, AFTER, state)
        figs = {f["name"]: f for f in _check(build(store, rid), "at_boundary")["figures"]}
        assert figs["forget_accuracy"]["verdict"] == ("within" if ok else "not within")
        assert figs["forget_accuracy"]["tolerance_from"] == source
        assert "samples" in figs["forget_accuracy"]["rule"]
    # without counts (a store written before they were reported): the fixed tolerances
    store, rid = _applied({**GOOD, **moved}, AFTER, State.UNVERIFIED)
    figs = {f["name"]: f for f in _check(build(store, rid), "at_boundary")["figures"]}
    assert (figs["forget_accuracy"]["tolerance"], figs["forget_accuracy"]["tolerance_from"]) == (
        0.05,
        "fixed",
    )


def test_resurfacing_after_the_window_is_not_within():
    e = Erasure("r1", 1, ["a"], 0.0)
    e.metrics_at_boundary = dict(GOOD)
    state, why = _checked(e, {**AFTER, "forget_accuracy": 0.9, "reversion_ratio": 0.8})
    assert state is State.UNVERIFIED
    assert why == "not within: resurfacing (forget_accuracy, reversion_ratio)"


def test_a_figure_without_a_reading_is_refused():
    with pytest.raises(ValueError, match="figure 'x' has no reading"):
        verdict([{"id": "c", "title": "t", "figures": [{"name": "x", "verdict": None}]}])
    assert verdict([])["verdict"] == "not verified"  # nothing judged is not verified


def test_retraining_reference_runs_give_the_distance_and_the_noise_floor(erased, tmp_path):
    cert0 = _cert(erased)
    refs = []
    # two retrainings: 0.40 throughout, and 0.44 at t=0 drifting to 0.64 at t=1000, so their
    # spread (the noise floor) at t is 0.04 + 0.2 * t / 1000: each moment has its own
    for i in range(2):
        run = tmp_path / f"retrain-{i}"
        run.mkdir()
        lines = [
            {"event": "eval", "t": t, "version": k, "bd_asr": 0.1,
             "bd_mia_auc": 0.40 + i * (0.04 + 0.2 * t / 1000)}
            for k, t in enumerate((0.0, 1000.0))
        ]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        refs.append(run)
    cert = _cert(erased, references=refs)
    figs = {f["name"]: f for f in _check(cert, "retraining")["figures"]}
    mia = figs["mia_auc@boundary"]
    floors = {}
    for moment in ("boundary", "verified"):
        f = figs[f"mia_auc@{moment}"]
        floors[moment] = f["noise_floor"]
        assert f["noise_floor"] == pytest.approx(2 * (f["reference"] - 0.40))  # at its own t
        ok = abs(f["value"] - f["reference"]) <= f["band"]
        assert f["verdict"] == ("within" if ok else "not within") and f["tolerance"] == f["band"]
        if not ok:
            assert f["side"] == ("above" if f["value"] > f["reference"] else "below")
    assert floors["verified"] > floors["boundary"] >= 0.04  # verified later, the spread wider
    v = _check(cert0, "at_boundary")["figures"][1]["value"]
    assert mia["value"] == v
    assert figs["asr@verified"]["band"] == 0.01  # a zero floor counts as 0.01
    assert "forget_accuracy@boundary" not in figs  # the references never measured it
    assert [x["sha256"] for x in cert["sources"]["references"]] == [
        hashlib.sha256((r / "metrics.jsonl").read_bytes()).hexdigest() for r in refs
    ]
    assert "distance to retraining" not in {x["check"] for x in cert["not_verified"]}


def test_regenerating_gives_the_same_json(erased, tmp_path):
    run_dir, store, r = erased
    first = to_json(_cert(erased))
    copy = tmp_path / "later"
    copy.mkdir()
    _copy_run(run_dir, copy)
    with ErasureStore(copy / "erasures.sqlite", readonly=True) as again:
        second = to_json(build(again, r.id, events=copy / "metrics.jsonl"))
    assert first == second
    json.loads(first)  # strict JSON: no NaN (a reversion ratio may be one)


def test_sample_digests_are_the_protocol_s_salted_digest_with_the_request_id():
    assert sample_digest("req-1", "case 7") == digest("req-1", "case 7").hex()
    assert sample_digest("req-1", "case 7") != sample_digest("req-2", "case 7")


def test_the_model_hash_ignores_the_order_of_the_tensors_not_their_values():
    a = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    b = {"b": torch.zeros(3), "w": torch.ones(2, 3)}
    assert model_sha256(a) == model_sha256(b)
    b["w"][0, 0] = 1.5
    assert model_sha256(a) != model_sha256(b)


# -- the HTML: escaped, bounded, self-contained ----------------------------------------------


def _hostile_store(path):
    store = ErasureStore(path)
    r, _ = store.submit(0, ["x"], HOSTILE, 1, reason=HOSTILE + "y" * 100_000)
    store.transition(r.id, State.ERASING, actor="server", model_version=1, detail=HOSTILE)
    store.transition(r.id, State.FAILED, actor=HOSTILE, model_version=2, detail="<blink>" * 2000)
    store.record_refusal(
        "silo-1", "ipv4:x", "/m", "NOT_FOUND", f"no erasure request {r.id} {HOSTILE}"
    )
    return store, r


def test_hostile_strings_are_escaped_and_cut(tmp_path):
    store, r = _hostile_store(tmp_path / "s.sqlite")
    cert = build(store, r.id)
    page = render(cert)
    for tag in ("<script", "<img", "<blink"):
        assert tag not in page.lower()
    assert "&lt;script&gt;" in page and "&quot;quotes&quot;" in page and "&lt;blink&gt;" in page
    assert len(cert["request"]["reason"]) < 600 and "(100" in cert["request"]["reason"]
    assert len(page) < 60_000  # 100 kB of reason and 15 kB of markup do not get through
    assert cert["refusals"]["rows"][0]["code"] == "NOT_FOUND"
    assert cert["outcome"]["state"] == "failed"


class _Markup(HTMLParser):
    """The tags and attributes of a page, and the text of its style elements."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.css: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))

    def handle_data(self, data):
        if self.tags and self.tags[-1][0] == "style":
            self.css.append(data)


def test_the_page_fetches_nothing_and_needs_no_script(erased, tmp_path):
    store, r = _hostile_store(tmp_path / "s.sqlite")
    for page in (render(_cert(erased)), render(build(store, r.id))):
        m = _Markup()
        m.feed(page)
        tags = {t for t, _ in m.tags}
        assert not tags & {"script", "link", "iframe", "object", "embed", "img", "base", "frame"}
        attrs = {k for _, kv in m.tags for k, _ in kv}
        assert not attrs & {"src", "href", "srcset", "action", "formaction", "background"}
        assert not [k for k in attrs if k.startswith("on")]  # no event handlers either
        css = " ".join(m.css).lower()
        assert "url(" not in css and "@import" not in css and "@font-face" not in css
        assert ("meta", [("http-equiv", "Content-Security-Policy"), ("content", CSP)]) in m.tags
    # a certificate without hostile input names no address at all
    assert not re.search(r"https?://", render(_cert(erased)))


# -- the service -------------------------------------------------------------------------------


@pytest.fixture
def service(erased, tmp_path):
    """The Certificate RPC over a copy of the real run's files."""
    run_dir, _, r = erased
    _copy_run(run_dir, tmp_path)
    store = ErasureStore(tmp_path / "erasures.sqlite")
    principals = [(TOKENS["admin"], Principal("admin", "admin"))] + [
        (TOKENS[f"silo-{i}"], Principal(f"silo-{i}", "silo", i)) for i in range(3)
    ]
    catalog = StaticCatalog(samples={i: set() for i in range(3)})
    svc = ErasureService(
        store, Authorizer.from_tokens(principals), catalog, events=tmp_path / "metrics.jsonl"
    )
    server, port = serve(svc, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = erasure_pb2_grpc.ErasureStub(channel)

    def call(rid, who="admin"):
        md = [("authorization", f"Bearer {TOKENS[who]}")] if who else []
        return stub.Certificate(pb.CertificateRequest(request_id=rid), metadata=md, timeout=30)

    try:
        yield call, store, svc, r, tmp_path, port
    finally:
        channel.close()
        server.stop(0).wait()
        store.close()


def _code(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def test_the_service_serves_it_to_the_admin_and_the_request_s_silo_only(service):
    call, store, _, r, folder, _ = service
    offline = to_json(build(store, r.id, events=folder / "metrics.jsonl"))
    for who in ("admin", "silo-2"):
        reply = call(r.id, who)
        assert reply.json == offline and reply.html.startswith("<!DOCTYPE html>")
    assert _code(lambda: call(r.id, "silo-0")) == C.NOT_FOUND
    assert _code(lambda: call(r.id, None)) == C.UNAUTHENTICATED
    assert _code(lambda: call("0" * 32)) == C.NOT_FOUND
    assert _code(lambda: call("x" * 129)) == C.INVALID_ARGUMENT
    # refused like every other call, and the ones naming the request are in its certificate
    refused = [(x.who, x.code) for x in store.refusals() if x.method.endswith("/Certificate")]
    assert sorted(refused) == sorted(
        [
            ("silo-0", "NOT_FOUND"),
            ("unauthenticated", "UNAUTHENTICATED"),
            ("admin", "NOT_FOUND"),
            ("admin", "INVALID_ARGUMENT"),
        ]
    )
    listed = json.loads(call(r.id).json)["refusals"]["rows"]
    assert [(x["who"], x["code"]) for x in listed] == [("silo-0", "NOT_FOUND")]


def test_a_certificate_over_its_bound_is_refused(service):
    call, store, svc, r, _, _ = service
    svc.limits = Limits(max_certificate_bytes=10_000)
    assert _code(lambda: call(r.id)) == C.RESOURCE_EXHAUSTED
    assert store.refusals(1)[0].code == "RESOURCE_EXHAUSTED"


# -- the command line ----------------------------------------------------------------------------


def test_the_command_online_and_offline(service, tmp_path, capsys):
    call, store, _, r, folder, port = service
    online, offline = tmp_path / "online", tmp_path / "offline"
    common = ["--address", f"127.0.0.1:{port}", "--token", TOKENS["silo-2"]]
    assert erase(["certificate", r.id, "--out", str(online), *common]) == 0
    assert erase(["certificate", r.id, "--out", str(offline), "--run", str(folder)]) == 0
    for name in ("certificate.json", "certificate.html"):
        assert (online / name).read_text() == (offline / name).read_text()
    capsys.readouterr()
    # unknown request, online and offline; bad combinations and missing files: one line, exit 2
    assert erase(["certificate", "nope", "--out", str(online), *common]) == 2
    assert erase(["certificate", "nope", "--out", str(offline), "--run", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "NOT_FOUND" in err and "no erasure request 'nope' in" in err
    for bad in (
        ["--events", str(folder / "metrics.jsonl")],
        ["--store", str(tmp_path / "absent.sqlite")],
        ["--run", str(folder), "--store", str(folder / "erasures.sqlite")],
        ["--reference", str(folder)],
        ["--run", str(folder), "--reference", str(tmp_path / "absent")],
    ):
        assert erase(["certificate", r.id, "--out", str(offline), *bad]) == 2, bad
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_readonly_store_changes_nothing(erased, tmp_path):
    run_dir, _, r = erased
    _copy_run(run_dir, tmp_path)
    path = tmp_path / "erasures.sqlite"
    before = path.read_bytes()
    with ErasureStore(path, readonly=True) as s:
        assert s.get(r.id) is not None and s.refusals() == []
        with pytest.raises(Exception, match="readonly"):
            s.submit(0, None, "admin", 1)
        with pytest.raises(RequestNotFound):
            build(s, "0" * 32)
    assert path.read_bytes() == before
    with pytest.raises(FileNotFoundError):
        ErasureStore(tmp_path / "absent.sqlite", readonly=True)


# -- in a real browser -----------------------------------------------------------------------


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("the chromium binary is missing: install it with `apt-get install -y chromium`")


def _browse(binary: str, page: Path, tmp: Path, *flags: str, timeout: float = 60.0) -> str:
    """Run headless Chromium on ``page``; its stdout. Killed (its whole process group, by the
    pid started here) on timeout, and always left with nothing running."""
    cmd = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp / 'profile'}",
        "--no-first-run",
        *flags,
        page.as_uri(),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium did not finish within {timeout} s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the process started here
        except ProcessLookupError:
            pass
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("chromium left processes running")
    return out.decode("utf-8", errors="replace")


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("style", "script", "title")

    def handle_endtag(self, tag):
        self._skip -= tag in ("style", "script", "title")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def test_chromium_renders_the_certificate_with_the_request_s_figures(erased, tmp_path):
    from PIL import Image

    binary = _chromium()
    cert = _cert(erased)
    page = tmp_path / "certificate.html"
    page.write_text(render(cert), encoding="utf-8")
    shot = tmp_path / "certificate.png"
    _browse(binary, page, tmp_path, "--window-size=1200,2000", f"--screenshot={shot}")
    with Image.open(shot) as im:
        assert im.format == "PNG" and im.size == (1200, 2000)
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 50, "a page, not a blank screen"
    reader = _Text()
    dom = _browse(binary, page, tmp_path, "--dump-dom")
    reader.feed(dom)
    text = " ".join(" ".join(reader.parts).split())
    r = cert["request"]
    at = {f["name"]: f for f in _check(cert, "at_boundary")["figures"]}
    for expected in (
        r["id"],
        f"{r['samples']['count']} sample(s) of silo 2",
        r["samples"]["digests"][0],
        "What was NOT verified",
        f"model version {cert['model']['after']['version']}",
        cert["model"]["after"]["sha256"],
        cert["model"]["checked"]["sha256"],
        f"{at['mia_auc']['value']:.4g}",
        "distance to retraining",
        "Erasure request",
        f"Verdict: {cert['verdict']['reading']}",
    ):
        assert expected in text, expected
    # every figure row's Reading cell is filled, with one of the three readings
    cells = re.findall(r'<td class="reading">(.*?)</td>', dom)
    figures = [f for c in cert["checks"] if c["ran"] for f in c["figures"]]
    assert len(cells) == len(figures) > 10
    words = [re.sub(r"<[^>]+>|\s*\((above|below)\)", "", c) for c in cells]
    assert words == [f["verdict"] for f in figures]
    for x in cert["verdict"]["not_within"]:  # each check not within is named at the top
        assert x["title"] in text[: text.index("1. The request")]


def test_facts_are_kept_with_their_audit_row_and_append_only(tmp_path):
    store = ErasureStore(tmp_path / "s.sqlite")
    r, _ = store.submit(1, ["a"], "silo-1", 3)
    store.transition(r.id, State.ERASING, actor="server", model_version=3, facts={"k": "v"})
    rows = store.audit(r.id)
    assert [a.facts for a in rows] == [{}, {"k": "v"}]
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        store._db.execute("UPDATE audit_facts SET value = 'w'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        store._db.execute("DELETE FROM audit_facts")
    store.close()


def test_the_timeline_shows_the_servers_removal_before_the_silos_part():
    # Prepare: a whole-silo request whose removal by the server came into force as it
    # started (version 4), before the silo's part (the boundary, version 6)
    store = ErasureStore(":memory:")
    r, _ = store.submit(1, [], "silo-1", 3)
    store.transition(r.id, State.ERASING, actor="server", model_version=3)
    store.note(r.id, actor="server", model_version=4, detail=f"{REMOVAL_NOTE} of silo 1's work")
    store.transition(
        r.id, State.CALIBRATING, actor="server", model_version=6, boundary_version=6,
        metrics=GOOD,
    )  # fmt: skip
    # Execute
    steps = build(store, r.id)["timeline"]
    # Assert: the two moments, in order; a request without a removal has no such step
    assert [s["step"] for s in steps][:4] == [
        "requested", "silo_started", "server_removal", "in_global_model",
    ]  # fmt: skip
    assert steps[2]["reached"] and steps[2]["model_version"] == 4
    store2, rid = _applied(GOOD)
    assert "server_removal" not in [s["step"] for s in build(store2, rid)["timeline"]]
