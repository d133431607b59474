"""Data stays at the hospitals: silos read their own Decathlon datalists; the deployment
ServerApp (``run_server(..., data_here=False)``) reads no silo data, learns sample and class
counts and salted id digests from the silos, and evaluates on its own test set or federated.

Played in-process (the real ServerApp loop and ClientApp on ``InProcessGrid``);
``tests/test_deploy_datalists.py`` runs the same on Flower's deployment engine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import grpc
import nibabel as nib
import numpy as np
import pytest
import torch
from inprocess import InProcessGrid, set_task_identity

import medical_data.federation as federation_module
from clients.app import app as client_app
from clients.lab import LAB_SETTING
from clients.node_log import NODE_EVENTS_ENV
from clients.node_task import _network, _silo, _template
from fedasync.errors import ConfigError, DataError
from fedasync.events import read_events
from medical_data.datalist import class_counts, load_datalist, write_datalist
from medical_data.federation import build_federation
from medical_data.fetch import data_dir
from medical_data.registry import get_spec
from protocol import ids
from protocol.config import SiloErasure
from protocol.messages import (
    Malformed,
    QueryReply,
    QueryRequest,
    TrainRefusal,
    TrainReply,
    TrainRequest,
    UnlearnRequest,
    is_refusal,
)
from server.app import run_server
from server.benchmark import server_test_set
from server.clock import client_setup
from server.erasure_setup import LiveCatalog, known_ids

BRAIN = get_spec("brain-tissue")


@pytest.fixture(scope="module")
def brain():
    """A small brain-tissue federation (3 silos) and its datalists: per silo its training data
    and, as ``validation``, a third of the pooled test set; plus the test set as the
    coordinator's own (``server-test``)."""
    return build_federation("brain-tissue", 3, 0, max_samples=300)


@pytest.fixture(scope="module")
def datalists(brain, tmp_path_factory):
    root = tmp_path_factory.mktemp("hospitals")
    thirds = np.array_split(np.arange(len(brain.test)), 3)
    out = {}
    for s, silo in enumerate(brain.silos):
        held = _subset(brain.test, thirds[s])
        out[s] = write_datalist(
            root / f"silo-{s}", {"training": silo, "validation": held}, "classification"
        )
    out["test"] = write_datalist(root / "server-test", {"test": brain.test}, "classification")
    return out


def _subset(data, idx):
    from medical_data.verification import subset

    return subset(data, idx)


def _grid(datalists, n=3):
    grid = InProcessGrid(client_app, n)
    for i, ctx in enumerate(grid.contexts.values()):
        ctx.node_config["datalist"] = str(datalists[i])
    return grid


def _no_benchmark(monkeypatch):
    """Building any benchmark federation in this process fails the test from here on."""

    def refuse(*args, **kwargs):
        raise AssertionError("a benchmark federation was built")

    monkeypatch.setattr(federation_module, "_build", refuse)


# ----------------------------------------------------------------- the datalist reader


def test_a_written_datalist_reads_back_the_same_images_labels_and_ids(brain, datalists):
    # Execute
    got = load_datalist(datalists[0], BRAIN)
    held = load_datalist(datalists[0], BRAIN, "validation")
    # Assert: lossless (as-stored intensities, the ids kept in each entry's "id")
    silo = brain.silos[0]
    assert np.array_equal(got.images, silo.images) and got.images.dtype == np.float32
    assert np.array_equal(got.labels, silo.labels)
    assert got.sample_ids.tolist() == silo.sample_ids.tolist()
    assert 0 < len(held) < len(brain.test)


def test_real_scans_in_nrrd_give_one_sample_per_slice_padded_resized_and_scaled(tmp_path):
    # Prepare: a hospital's datalist pointing at two real MR volumes with lesion masks
    # (PyRadiomics test scans, 256x256x25 and 256x256x23, NRRD), by path, without ids
    src = data_dir() / "pyradiomics-bhklab-3.1.4"
    doc = {
        "training": [
            {"image": str(src / f"{c}_image.nrrd"), "label": str(src / f"{c}_label.nrrd")}
            for c in ("brain1", "brain2")
        ]
    }
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps(doc))
    spec = get_spec("radiomics-lesion")
    # Execute
    got = load_datalist(path, spec)
    # Assert: 25 + 23 axial slices at the benchmark's 64x64, intensities scaled per volume to
    # [0, 1], masks still binary with the lesion present, ids = path relative to the datalist
    assert got.images.shape == (48, 1, 64, 64) and got.labels.shape == (48, 64, 64)
    assert 0.0 <= got.images.min() and got.images.max() <= 1.0 and got.images.max() > 0.9
    assert set(np.unique(got.labels)) == {0, 1}
    rel = Path(str(src / "brain1_image.nrrd")).resolve()
    first = got.sample_ids[0]
    assert first.endswith("brain1_image.nrrd/s000") and "brain1" in first
    assert len(set(got.sample_ids.tolist())) == 48
    assert rel.exists()
    assert class_counts(got, 2)[1] == int((got.labels.reshape(48, -1) > 0).any(1).sum()) > 0


def _entry_file(tmp_path, name, array):
    nib.save(nib.Nifti1Image(np.asarray(array), np.eye(4)), tmp_path / name)
    return name


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"image": "missing.nii.gz", "label": 0}, "cannot read image"),
        ({"image": "ok.nii.gz", "label": 3}, "label 3 is not a class of brain-tissue"),
        ({"image": "ok.nii.gz", "label": "grey"}, "'label' must be an integer class"),
        ({"image": "ok.nii.gz"}, "no 'label'"),
        ({"label": 1}, "no 'image'"),
        ({"image": "rgb.nii.gz", "label": 1}, "3 channel(s), brain-tissue needs 1"),
        ({"image": "volume.nii.gz", "label": 1}, "a 3D volume, but brain-tissue classifies"),
        ({"image": "ok.nii.gz", "label": 1, "id": "a"}, "repeats the sample id 'a'"),
    ],
)
def test_a_bad_entry_is_a_data_error_naming_the_file_the_entry_and_the_problem(
    tmp_path, bad, message
):
    # Prepare: two good entries, then the bad one (index 2)
    _entry_file(tmp_path, "ok.nii.gz", np.random.default_rng(0).random((28, 28), np.float32))
    _entry_file(tmp_path, "rgb.nii.gz", np.zeros((28, 28, 1, 3), np.float32))
    _entry_file(tmp_path, "volume.nii.gz", np.zeros((28, 28, 4), np.float32))
    good = [{"image": "ok.nii.gz", "label": 0, "id": "a"}, {"image": "ok.nii.gz", "label": 2}]
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps({"training": [*good, bad]}))
    # Execute / Assert
    with pytest.raises(DataError) as info:
        load_datalist(path, BRAIN)
    text = str(info.value)
    assert str(path) in text and "training[2]" in text and message in text, text


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "is not JSON"),
        ('{"validation": []}', "has no 'training' list"),
        ('{"training": []}', "must be a non-empty list"),
        ('{"training": [{"image": "x", "label": 0}], "intensity": "raw"}', "'intensity'"),
    ],
)
def test_a_bad_datalist_is_a_data_error(tmp_path, content, message):
    path = tmp_path / "dataset.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_datalist(path, BRAIN)
    with pytest.raises(DataError, match="does not exist"):
        load_datalist(tmp_path / "absent.json", BRAIN)


# ----------------------------------------------------------------- what silos report


def test_query_carries_a_salt_and_its_reply_bounded_validated_counts_and_digests():
    # Prepare
    set_task_identity()
    query = QueryRequest(_setup_json(), "salt-1").to_message(7)
    query.metadata.__dict__["_message_id"] = "m-1"  # (as the Grid stamps it)
    digests = ids.digest_all("salt-1", ["a", "b"])
    reply = QueryReply(1, 2, (1, 1, 0), digests)
    # Execute
    got = QueryReply.from_message(reply.to_message(reply_to=query))
    # Assert: the same fields back; wrong digest counts and counts are refused
    assert QueryRequest.from_message(query).salt == "salt-1"
    assert got == reply
    with pytest.raises(ValueError, match="3 id digests for 2 samples"):
        QueryReply(1, 2, (), digests + digests[:16])
    with pytest.raises(ValueError, match="class count"):
        QueryReply(1, 2, (3, 0, 0))
    with pytest.raises(ValueError, match="class counts"):
        QueryReply(1, 2, (0,) * 5000)
    bad = reply.to_message(reply_to=query)
    bad.content["config"]["id-digests"] = b"x" * 17
    with pytest.raises(Malformed, match="not a multiple of 16"):
        QueryReply.from_message(bad)
    bad.content["config"]["id-digests"] = "not bytes"
    with pytest.raises(Malformed, match="must be bytes"):
        QueryReply.from_message(bad)


def test_digest_set_checks_ids_without_holding_them():
    # Prepare
    held = ["brain-tissue/z071/x045y102", "brain-tissue/z072/x045y102"]
    known = ids.DigestSet("s1", ids.split(ids.digest_all("s1", held)))
    # Assert: membership and coverage by digest; another salt matches nothing; no listing
    assert held[0] in known and "brain-tissue/z073/x045y102" not in known
    assert known <= set(held) and not known <= {held[0]}
    assert held[0] not in ids.DigestSet("s2", known.digests)
    assert len(known) == 2
    with pytest.raises(TypeError, match="only as digests"):
        list(known)


def test_the_silo_answers_the_query_from_its_datalist(brain, datalists):
    # Prepare
    grid = _grid(datalists)
    node = next(iter(grid.contexts))
    setup = _setup_json()
    # Execute
    [mid] = grid.push_messages([QueryRequest(setup, "salt-1").to_message(node)])
    got = QueryReply.from_message(grid.pull_messages([mid])[0])
    # Assert: its training list's size and class counts; one digest per id under the salt
    silo = brain.silos[0]
    assert (got.silo, got.num_samples) == (0, len(silo))
    assert list(got.class_counts) == np.bincount(silo.labels, minlength=3).tolist()
    assert ids.split(got.id_digests) == [ids.digest("salt-1", s) for s in silo.sample_ids]


def _setup_json(*overrides):
    from simulations.config import load_config

    cfg = load_config(None, ["silos.count=3", "data.max_samples=300", *overrides])
    return client_setup(cfg).to_json()


# ----------------------------------------------------------------- the ClientApp


def test_every_message_trains_a_fresh_copy_of_the_network(datalists, tmp_path):
    # Prepare: DP on (opacus wraps the network for the message), two train messages
    grid = _grid(datalists)
    node = next(iter(grid.contexts))
    grid.contexts[node].node_config["privacy-db"] = str(tmp_path / "ledger.sqlite")
    setup = _setup_json("client.dp.enabled=true", "client.local_steps=2")
    ctx = grid.contexts[node]
    here = _silo(ctx, setup)
    template = _template("cnn-small", 1, 3, (28, 28))
    before = {k: v.clone() for k, v in template.state_dict().items()}
    params = {k: torch.zeros_like(v) for k, v in before.items()}
    # Execute
    replies = []
    for job in (1, 2):
        msg = TrainRequest(setup, job, 0, job, params).to_message(node)
        [mid] = grid.push_messages([msg])
        replies.append(grid.pull_messages([mid])[0])
    # Assert: both trained (no error), from the weights sent; the template was never trained,
    # wrapped or hooked; every call gives another object
    assert all(not r.has_error() for r in replies), [r.error for r in replies if r.has_error()]
    assert all(torch.equal(template.state_dict()[k], v) for k, v in before.items())
    assert not any(m._forward_hooks or m._backward_hooks for m in template.modules())
    assert not any(hasattr(p, "grad_sample") or p.grad is not None for p in template.parameters())
    assert _network(setup, here.spec) is not _network(setup, here.spec)


def test_the_silo_refuses_to_erase_ids_it_does_not_hold(datalists):
    # Prepare
    grid = _grid(datalists)
    node = next(iter(grid.contexts))
    setup = _setup_json()
    model = _network(setup, BRAIN)
    request = UnlearnRequest(
        setup_json=setup,
        job_id=1,
        base_version=0,
        seed=0,
        params=model.state_dict(),
        erasure=SiloErasure(),
        forget=("brain-tissue/z999/x000y000",),
    )
    # Execute
    [mid] = grid.push_messages([request.to_message(node)])
    reply = grid.pull_messages([mid])[0]
    # Assert
    assert reply.has_error() and "are not held by silo 0" in reply.error.reason


def test_a_hospital_node_refuses_a_backdoor_and_trains_on_its_data_as_it_is(
    brain, datalists, monkeypatch, tmp_path
):
    # Prepare: a setup whose backdoor names this silo, all of its samples relabelled to class 0
    monkeypatch.setenv(NODE_EVENTS_ENV, str(tmp_path / "node.jsonl"))
    grid = _grid(datalists)
    node = next(iter(grid.contexts))
    poisoned = _setup_json(
        "lab.backdoor.enabled=true", "lab.backdoor.silo=0", "lab.backdoor.fraction=1.0"
    )
    clean = _setup_json("client.local_steps=1")
    params = _network(clean, BRAIN).state_dict()
    # Execute: a query and a train request under the backdoor, then a train request without
    [q] = grid.push_messages([QueryRequest(poisoned, "salt").to_message(node)])
    queried = grid.pull_messages([q])[0]
    [t] = grid.push_messages([TrainRequest(poisoned, 1, 0, 1, params).to_message(node)])
    refused = grid.pull_messages([t])[0]
    [c] = grid.push_messages([TrainRequest(clean, 2, 0, 2, params).to_message(node)])
    trained = grid.pull_messages([c])[0]
    # Assert: one-line refusals (an error to the query, a typed refusal to the training), both
    # in the node's log; the data trained on is the datalist's, labels and images untouched
    assert queried.has_error() and "refuses the benchmark instrument(s) backdoor" in (
        queried.error.reason
    )
    refusal = TrainRefusal.from_message(refused)
    assert refusal.reason == LAB_SETTING and "\n" not in refusal.detail
    assert not trained.has_error() and not is_refusal(trained)
    assert TrainReply.from_message(trained).num_samples == len(brain.silos[0])
    here = _silo(grid.contexts[node], clean)
    assert np.array_equal(here.data.labels, brain.silos[0].labels)
    assert np.array_equal(here.data.images, brain.silos[0].images)
    log = [e for e in read_events(tmp_path / "node.jsonl") if e["event"] == "refuse"]
    assert [(e["handler"], e["reason"]) for e in log] == [
        ("query", LAB_SETTING),
        ("train", LAB_SETTING),
    ]


def test_a_hospital_node_refuses_to_wait_as_an_emulated_slow_silo(datalists, tmp_path, monkeypatch):
    # Prepare: a setup that asks every silo to wait after training (lab.emulate_speed)
    monkeypatch.setenv(NODE_EVENTS_ENV, str(tmp_path / "node.jsonl"))
    grid = _grid(datalists)
    node = next(iter(grid.contexts))
    slowed = _setup_json("lab.emulate_speed=true", "client.local_steps=1")
    assert json.loads(slowed)["emulate_speeds"]  # (what the coordinator would send)
    params = _network(slowed, BRAIN).state_dict()
    # Execute
    [t] = grid.push_messages([TrainRequest(slowed, 1, 0, 1, params).to_message(node)])
    refused = grid.pull_messages([t])[0]
    # Assert: a typed one-line refusal naming the instrument, in the node's log
    refusal = TrainRefusal.from_message(refused)
    assert refusal.reason == LAB_SETTING and "emulate_speed" in refusal.detail
    log = [e for e in read_events(tmp_path / "node.jsonl") if e["event"] == "refuse"]
    assert [e["asked"] for e in log] == [["emulate_speed"]]


@pytest.mark.parametrize("fault", ["nan", "replay"])
def test_a_hospital_node_refuses_an_injected_fault(datalists, fault, monkeypatch, tmp_path):
    # Prepare
    monkeypatch.setenv(NODE_EVENTS_ENV, str(tmp_path / "node.jsonl"))
    grid = _grid(datalists)
    node = next(iter(grid.contexts))
    setup = _setup_json("client.local_steps=1")
    params = _network(setup, BRAIN).state_dict()
    msg = TrainRequest(setup, 1, 0, 1, params, fault=fault).to_message(node)
    # Execute
    [mid] = grid.push_messages([msg])
    reply = grid.pull_messages([mid])[0]
    # Assert
    refusal = TrainRefusal.from_message(reply)
    assert refusal.reason == LAB_SETTING and f"fault={fault}" in refusal.detail
    [event] = [e for e in read_events(tmp_path / "node.jsonl") if e["event"] == "refuse"]
    assert event["asked"] == [f"fault={fault}"]


# ----------------------------------------------------------------- the coordinator


def _run(small_cfg, grid, monkeypatch, *overrides):
    """Run the deployment ServerApp's loop on ``grid`` with a config whose data folder does
    not exist, and no benchmark federation buildable in this process (the config is checked
    first: its preflight builds one, as ``fedasync deploy`` does on the launcher's side)."""
    cfg = small_cfg("data.max_samples=300", *overrides)
    absent = Path(cfg.run.out_dir) / "no-data-here"
    cfg = replace(cfg, data=replace(cfg.data, data_dir=str(absent)))
    _no_benchmark(monkeypatch)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(grid, cfg, run_dir, wall_clock=True, data_here=False)
    assert not absent.exists()  # nobody loaded (and cached) the benchmark
    return summary, read_events(run_dir / "metrics.jsonl")


def test_a_coordinator_without_data_trains_and_evaluates_by_the_silos(
    small_cfg, brain, datalists, monkeypatch
):
    # Prepare: the benchmark cannot be built in this process (server or silos)
    grid = _grid(datalists)
    # Execute
    summary, events = _run(
        small_cfg, grid, monkeypatch, "run.max_versions=4", "server.eval_every=1"
    )
    # Assert: it trained; the only evaluation is the silos' at the end, on their validation
    # lists, weighted by their sizes; what it knows of the data is what the silos reported
    assert summary["versions"] >= 4 and summary["updates_rejected_total"] == 0
    assert summary["evaluation"] == {"on": "silos (federated)", "samples": None}
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["version"] for e in evals] == [summary["versions"]]
    silo_evals = {e["silo"]: e for e in events if e["event"] == "silo_eval"}
    sizes = {s: len(load_datalist(datalists[s], BRAIN, "validation")) for s in range(3)}
    assert {s: e["num_samples"] for s, e in silo_evals.items()} == sizes
    want = sum(silo_evals[s]["score"] * sizes[s] for s in range(3)) / sum(sizes.values())
    assert evals[0]["eval_samples"] == sum(sizes.values())
    assert evals[0]["score"] == pytest.approx(want) and 0.0 <= want <= 1.0
    counts = {s: np.bincount(brain.silos[s].labels, minlength=3).tolist() for s in range(3)}
    assert {int(s): v["class_counts"] for s, v in summary["silo_data"].items()} == counts
    roster = next(e for e in events if e["event"] == "roster")
    assert {int(s): v["class_counts"] for s, v in roster["silos"].items()} == counts
    assert summary["per_silo"]["1"]["eval"]["num_samples"] == sizes[1]


def test_a_coordinator_with_its_own_test_set_evaluates_during_the_run(
    small_cfg, brain, datalists, monkeypatch
):
    # Prepare
    grid = _grid(datalists)
    # Execute
    summary, events = _run(
        small_cfg,
        grid,
        monkeypatch,
        "run.max_versions=4",
        "server.eval_every=2",
        f"data.server_test={datalists['test']}",
    )
    # Assert: evaluated at 0, every 2 versions and at the end on the coordinator's set; no
    # silo was asked
    versions = [e["version"] for e in events if e["event"] == "eval"]
    assert versions[:3] == [0, 2, 4] and versions[-1] == summary["versions"]
    assert summary["evaluation"]["samples"] == len(brain.test)
    assert summary["evaluation"]["on"] == "coordinator test set (data.server_test)"
    assert not [e for e in events if e["event"] == "silo_eval"]
    assert not [m for m in grid.pushed if m.metadata.message_type == "evaluate"]


def test_a_silo_with_a_bad_datalist_is_named_at_the_roster_query(
    small_cfg, datalists, tmp_path, caplog
):
    # Prepare: silo 1's datalist has a label outside the benchmark's classes at entry 2
    doc = json.loads(Path(datalists[1]).read_text())
    doc["training"][2]["label"] = 7
    bad = Path(datalists[1]).parent / "bad.json"
    bad.write_text(json.dumps(doc))
    grid = _grid({**datalists, 1: bad})
    cfg = small_cfg("data.max_samples=300", "server.wait_for_nodes_s=5")
    # Execute
    with caplog.at_level(logging.ERROR, "fedasync.server"), pytest.raises(RuntimeError) as info:
        run_server(grid, cfg, Path(cfg.run.out_dir) / "t", wall_clock=True, data_here=False)
    # Assert: the run does not start; the log says which file, entry and what is wrong
    assert "silos [1] did not answer the roster query" in str(info.value)
    assert "bad.json, training[2]: label 7 is not a class of brain-tissue" in caplog.text


def test_a_coordinator_checks_erasure_ids_against_the_digests_the_silos_reported(brain, tmp_path):
    # Prepare: the erasure service on a coordinator that knows silo 0's ids only as digests
    from server.erasure.auth import Authorizer, Principal
    from server.erasure.gen import erasure_pb2 as pb
    from server.erasure.gen import erasure_pb2_grpc
    from server.erasure.service import ErasureService, serve
    from server.erasure.store import ErasureStore

    salt = ids.new_salt()
    held = brain.silos[0].sample_ids.tolist()
    reports = {0: QueryReply(0, len(held), (), ids.digest_all(salt, held))}
    catalog = LiveCatalog(1, known_ids(None, reports, salt), lambda: 3, lambda silo: True)
    store = ErasureStore(tmp_path / "erasures.sqlite")
    auth = Authorizer.from_tokens([("tok", Principal("silo-0", "silo", 0))])
    service = ErasureService(store, auth, catalog)
    server, port = serve(service, "127.0.0.1:0")
    md = [("authorization", "Bearer tok")]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = erasure_pb2_grpc.ErasureStub(ch)

            def submit(sample_ids):
                req = pb.SubmitRequest(silo=0, sample_ids=sample_ids)
                return stub.Submit(req, metadata=md, timeout=10)

            # Execute / Assert: an id the silo does not hold is refused at once, nothing kept
            with pytest.raises(grpc.RpcError) as info:
                submit([held[0], "brain-tissue/z999/x000y000"])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "1 unknown sample id(s)" in info.value.details()
            assert store.list() == []
            # ...its own ids are accepted; all the rest of them make it a whole-silo erasure
            assert submit(held[:2]).silo == 0
            rest = store.get(submit(held[2:]).id)
            assert rest is not None and rest.whole_silo
    finally:
        server.stop(0).wait()
        store.close()


def test_what_a_coordinator_without_data_cannot_do_is_refused_at_the_start(small_cfg, datalists):
    cfg = small_cfg("data.max_samples=300", "erasures=[{silo: 0, at_s: 1, fraction: 0.5}]")
    with pytest.raises(ConfigError, match="submit the ids through the erasure service"):
        run_server(_grid(datalists), cfg, Path(cfg.run.out_dir) / "t", data_here=False)


def test_the_coordinators_test_set_must_exist(small_cfg, tmp_path):
    cfg = small_cfg(f"data.server_test={tmp_path / 'absent.json'}")
    with pytest.raises(DataError, match="data.server_test=.*no such file"):
        server_test_set(cfg, BRAIN)


def test_flowers_fedavg_baseline_without_data_is_evaluated_by_the_silos(
    small_cfg, datalists, monkeypatch
):
    # Prepare: Flower's FedAvg (the deployment baseline) on silos with their own datalists
    from server.flower_sync import run_flower_fedavg

    class Blocking(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            return list(self.pull_messages(self.push_messages(messages)))

    grid = _grid(datalists)
    grid.__class__ = Blocking
    cfg = small_cfg("data.max_samples=300", "run.max_versions=2")
    _no_benchmark(monkeypatch)
    # Execute
    summary = run_flower_fedavg(grid, cfg, Path(cfg.run.out_dir) / "t", data_here=False)
    # Assert: two rounds, then one federated evaluation of the final model
    sizes = sum(len(load_datalist(datalists[s], BRAIN, "validation")) for s in range(3))
    assert summary["versions"] == 2
    assert [(e["version"], e["eval_samples"]) for e in summary["evals"]] == [(2, sizes)]
