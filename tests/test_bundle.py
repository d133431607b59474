"""A run's models as MONAI bundles: monai.bundle alone loads them (no fedasync module in the
loading process) and scores them on the run's held-out set as the run did; ``fedasync
export`` makes one of a kept version and names the kept ones for any other; an erased model's
metadata names the erasure requests it honours; no bundle holds a sample id."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from inprocess import CHECKED, SMALL, InProcessGrid, checked_rows

from clients.app import app as client_app
from server.app import run_server
from server.benchmark import federation
from server.erasure.certificate import build
from server.erasure.store import ErasureStore
from simulations.cli import main as cli
from simulations.config import load_config

BASE = [*SMALL, "server.checkpoint_every=2", "server.keep_models=3"]
ERASE = (  # tests/test_erasure_e2e.py's: a share of silo 2's samples relabelled away
    "run.max_versions=30",
    "erasures=[{silo: 2, at_s: 10, fraction: 0.3}]",
    "unlearning.method=relabel",
    "lab.erasure.relearn_versions=4",
    "unlearning.steps=5",
    "lab.backdoor.enabled=true",
    "lab.backdoor.silo=1",
    "lab.backdoor.target_label=0",
)
LOAD = """
import json, sys
sys.modules["transformers"] = None  # optional to MONAI (its Transchex alone): 4 s of import
import numpy as np
import torch
from monai.bundle import ConfigParser

arrays, *bundles = sys.argv[1:]
data = np.load(arrays)
images, labels = torch.from_numpy(data["images"]), torch.from_numpy(data["labels"])
scores = {}
for root in bundles:
    parser = ConfigParser()
    parser.read_config(root + "/configs/inference.json")
    parser["bundle_root"] = root
    net = parser.get_parsed_content("network_def")
    path = parser.get_parsed_content("checkpoint")
    net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
    net.eval()
    post = parser.get_parsed_content("postprocessing")
    with open(root + "/configs/metadata.json") as f:
        seg = json.load(f)["network_data_format"]["outputs"]["pred"]["format"] == "labels"
    correct = inter = denom = 0.0
    with torch.no_grad():
        for start in range(0, len(images), 256):
            out = net(images[start : start + 256])
            pred = torch.stack([post({"pred": o})["pred"] for o in out])[:, 0]
            y = labels[start : start + 256]
            if seg:
                p, t = (pred > 0).float(), (y > 0).float()
                inter += float((p * t).sum())
                denom += float(p.sum() + t.sum())
            else:
                correct += float((pred == y).sum())
    scores[root] = (1.0 if denom == 0 else 2 * inter / denom) if seg else correct / len(images)
ours = {"fedasync", "server", "clients", "medical_data", "simulations", "protocol", "runkit"}
print(json.dumps({"scores": scores, "ours": sorted(m for m in sys.modules if m.split(".")[0] in ours)}))
"""


def _cfg(out: Path, name: str, *overrides: str):
    return load_config(None, [f"run.out_dir={out}", f"run.name={name}", *BASE, *overrides])


def _meta(bundle: Path) -> dict:
    return json.loads((bundle / "configs" / "metadata.json").read_text())


def _score_with_monai_alone(tmp: Path, cfg, bundles: list[Path]) -> dict:
    """Each bundle's score on the run's held-out set, computed in a process that imports
    monai, torch and numpy only; and the fedasync modules that process imported."""
    test = federation(cfg).test  # (the arrays only; saved for the loading process)
    arrays = tmp / "heldout.npz"
    np.savez(arrays, images=test.images, labels=test.labels)
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(arrays), *map(str, bundles)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short real run: 10 versions, evaluated every 2, a checkpoint every 2, 3 kept."""
    out = tmp_path_factory.mktemp("bundle")
    cfg = _cfg(out, "r", "run.max_versions=10")
    summary = run_server(InProcessGrid(client_app, cfg.silos.count), cfg, out / "r")
    return cfg, out / "r", summary


def test_final_best_and_exported_bundles_load_with_monai_alone_and_score_as_the_run(run):
    # Prepare: an exported version the run evaluated (snapshots kept: 6, 8, 10)
    cfg, run_dir, summary = run
    assert cli(["export", str(run_dir), "--version", "8"]) == 0
    bundles = [run_dir / "bundle" / n for n in ("final", "best", "version-8")]
    # Execute
    got = _score_with_monai_alone(run_dir.parent, cfg, bundles)
    # Assert: no fedasync module in the loading process, and the run's own scores
    assert got["ours"] == []
    evals = {e["version"]: e["score"] for e in summary["evals"]}
    best_version = max(evals, key=lambda v: (evals[v], -v))  # the first of the best
    for bundle, version in zip(bundles, (10, best_version, 8)):
        meta = _meta(bundle)["fedasync"]
        assert meta["model_version"] == version
        assert abs(got["scores"][str(bundle)] - evals[version]) <= 1e-6, bundle.name
        assert meta["evaluation"]["score"] == evals[version]
    assert summary["bundles"] == {n: str(run_dir / "bundle" / n) for n in ("final", "best")}


def test_bundle_metadata_follows_monai_and_says_the_run_without_sample_ids(run):
    cfg, run_dir, summary = run
    meta = _meta(run_dir / "bundle" / "final")
    for key in (
        "version",
        "monai_version",
        "pytorch_version",
        "numpy_version",
        "required_packages_version",
        "task",
        "description",
        "authors",
        "copyright",
        "network_data_format",
    ):
        assert meta[key] not in (None, ""), key
    image = meta["network_data_format"]["inputs"]["image"]
    assert (image["num_channels"], image["spatial_shape"]) == (1, [28, 28])
    pred = meta["network_data_format"]["outputs"]["pred"]
    assert pred["num_channels"] == 3 and len(pred["channel_def"]) == 3
    ours = meta["fedasync"]
    fed = federation(cfg)
    silos = ours["training_data"]["silos"]
    assert {s: v["num_samples"] for s, v in silos.items()} == {
        str(i): len(s) for i, s in enumerate(fed.silos)
    }
    # the config hash as docs/deployment.md says to recompute it: config.yaml, canonical JSON
    import hashlib

    import yaml

    from simulations.config import to_yaml

    canonical = json.dumps(yaml.safe_load(to_yaml(cfg)), sort_keys=True, separators=(",", ":"))
    assert ours["config_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()
    assert ours["erasures"] == {"honoured": [], "applied_later": []}
    weights = torch.load(run_dir / "bundle/final/models/model.pt", weights_only=True)
    assert ours["network"]["num_parameters"] == sum(t.numel() for t in weights.values())
    text = json.dumps(meta)
    ids = [str(i) for s in (*fed.silos, fed.test) for i in s.sample_ids]
    assert not [i for i in ids if i in text], "a bundle never holds a sample id"


def test_export_of_a_version_not_kept_names_the_kept_ones(run, capsys):
    _, run_dir, _ = run
    kept = sorted(int(p.stem.split("-")[1]) for p in (run_dir / "models").glob("version-*.pt"))
    assert kept == [6, 8, 10]  # server.keep_models=3: the newest three checkpoints
    # Execute: version 4 was checkpointed, and dropped since
    code = cli(["export", str(run_dir), "--version", "4"])
    # Assert: one line, exit 2, naming what is kept
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "version 4 is not kept" in err and "6, 8, 10" in err
    assert not (run_dir / "bundle" / "version-4").exists()


def test_export_refuses_an_out_folder_that_holds_something(run, tmp_path, capsys):
    _, run_dir, _ = run
    (tmp_path / "mine.txt").write_text("keep me")
    assert cli(["export", str(run_dir), "--version", "10", "--out", str(tmp_path)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_best_model_survives_a_resume(run, tmp_path):
    # Prepare: a run's folder, copied; resumed with nothing left to do (its version cap)
    import shutil

    cfg, run_dir, _ = run
    copy = tmp_path / "r"
    shutil.copytree(run_dir, copy)
    best_before = _meta(copy / "bundle" / "best")["fedasync"]
    resumed = _cfg(tmp_path, "r", "run.max_versions=10", "run.resume=true")
    # Execute
    run_server(InProcessGrid(client_app, cfg.silos.count), resumed, copy)
    # Assert: the best bundle is the one before the resume (kept in the checkpoint)
    best_after = _meta(copy / "bundle" / "best")["fedasync"]
    assert best_after["model_version"] == best_before["model_version"]
    assert best_after["weights_sha256"] == best_before["weights_sha256"]


def test_an_erased_model_names_the_erasure_it_honours_and_nothing_older_is_kept(tmp_path):
    # Prepare: snapshots kept far enough back to reach before the erasure
    cfg = _cfg(tmp_path, "e", *ERASE, "server.keep_models=100")
    run_dir = tmp_path / "e"
    # Execute
    summary = run_server(InProcessGrid(client_app, cfg.silos.count), cfg, run_dir)
    # Assert
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED  # checked after its window: the bundle says which
    boundary = checked_rows(summary)[0]["boundary_version"]
    for name in ("final", "best"):
        meta = _meta(run_dir / "bundle" / name)
        (row,) = meta["fedasync"]["erasures"]["honoured"]
        assert row == {
            "request": req["id"],
            "silo": 2,
            "scope": "samples",
            "samples": req["samples"],
            "boundary_version": boundary,
            "state": req["state"],
        }
        assert meta["fedasync"]["model_version"] >= boundary, "no model from before erasing"
        text = json.dumps(meta)
        assert not [i for i in federation(cfg).silos[2].sample_ids if str(i) in text]
    kept = [int(p.stem.split("-")[1]) for p in (run_dir / "models").glob("version-*.pt")]
    assert kept and min(kept) >= boundary
    # the certificate's hash of the model when checked is the bundle's of that version
    store = ErasureStore(run_dir / "erasures.sqlite", readonly=True)
    try:
        at = build(store, req["id"], events=run_dir / "metrics.jsonl")["model"]["checked"]
    finally:
        store.close()
    assert at["version"] in kept
    assert (
        cli(["export", str(run_dir), "--version", str(at["version"]), "--out", str(tmp_path / "x")])
        == 0
    )
    assert _meta(tmp_path / "x")["fedasync"]["weights_sha256"] == at["sha256"]


def test_an_erasure_forgets_the_best_model_and_every_snapshot_before_it(tmp_path):
    from types import SimpleNamespace

    from server.evaluation import BestModel
    from server.loop import AsyncServer
    from server.models import ModelStore

    # Prepare: versions 2 and 4 kept, 4 the best so far
    params = {"w": torch.ones(2)}
    srv = SimpleNamespace(best=BestModel(), models=ModelStore(tmp_path, 10), version=4)
    srv._new_version = lambda p: setattr(srv, "version", srv.version + 1)
    for v in (2, 4):
        srv.models.save(v, params)
    assert srv.best.offer(4, 0.9, params) and not srv.best.offer(4, 0.9, params)
    params["w"].add_(1.0)  # the loop folds into its weights in place
    assert torch.equal(srv.best.params["w"], torch.ones(2)), "the best is a copy"
    # Execute: the erasure's model becomes version 5
    AsyncServer.apply_erasure(srv, params)  # type: ignore[arg-type]
    # Assert
    assert srv.best.params is None and srv.models.versions() == []
    assert not srv.best.offer(5, float("nan"), params) and srv.best.offer(5, 0.1, params)


@pytest.mark.parametrize(
    ("name", "channels", "classes", "size"),
    [
        ("cnn-small", 3, 9, (28, 28)),
        ("densenet121", 1, 2, (64, 64)),
        ("resnet18", 1, 2, (64, 64)),
        ("unet-small", 1, 2, (64, 64)),
        ("unet", 1, 2, (64, 64)),
        ("mlp-small", 1, 2, (1, 30)),
    ],
)
def test_every_network_is_said_with_monai_and_torch_targets(name, channels, classes, size):
    """The bundle's network_def is the run's network: its state_dict loads strictly and
    the outputs are the same to the bit."""
    from monai.bundle import ConfigParser

    from medical_data.bundle_config import network_entries
    from medical_data.networks import build_network

    entries = json.loads(json.dumps(network_entries(name, channels, classes, size)))
    targets = {v for v in _values(entries, "_target_")}
    assert all(t.startswith(("monai.", "torch.")) for t in targets), targets
    torch.manual_seed(0)
    ours = build_network(name, channels, classes, size).eval()
    theirs = ConfigParser(entries).get_parsed_content("network_def").eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(3, channels, *size)
    with torch.no_grad():
        assert torch.equal(theirs(x), ours(x))


def _values(tree, key):
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == key:
                yield v
            yield from _values(v, key)
    elif isinstance(tree, list):
        for v in tree:
            yield from _values(v, key)


def test_preprocessing_reads_a_file_as_the_datalist_reader_does(tmp_path):
    """The bundle's MONAI preprocessing of an image file gives (to interpolation at the
    border) what medical_data.datalist feeds the network from the same file."""
    import nibabel as nib
    from monai.bundle import ConfigParser

    from medical_data.bundle_config import preprocessing
    from medical_data.datalist import load_datalist
    from medical_data.registry import get_spec

    yy, xx = np.mgrid[0:100, 0:80]  # not square, to be padded; an off-centre blob on a ramp
    image = 200 + 900 * np.exp(-((yy - 40) ** 2 + (xx - 50) ** 2) / 600.0) + 3 * yy
    nib.save(nib.Nifti1Image(image.astype(np.float32), np.eye(4)), tmp_path / "img.nii.gz")
    entry = {"image": "img.nii.gz", "label": 0}
    (tmp_path / "dataset.json").write_text(json.dumps({"training": [entry]}))
    spec = get_spec("radiomics-slice")  # 64x64, one channel
    want = load_datalist(tmp_path / "dataset.json", spec).images[0]
    pre = ConfigParser({"pre": preprocessing(spec)}).get_parsed_content("pre")
    got = np.asarray(pre({"image": str(tmp_path / "img.nii.gz")})["image"])
    assert got.shape == want.shape == (1, 64, 64) and got.dtype == np.float32
    assert np.abs(got - want).mean() < 0.02
    assert np.abs(got - want)[:, 8:-8, 8:-8].max() < 0.06


def test_a_runs_bundle_trains_again_from_its_weights_on_a_datalist(run, tmp_path):
    """The round trip: the final bundle of a built-in benchmark's run, given a datalist as
    ``<bundle>/data/dataset.json``, is a task (``task.bundle``) that starts from its weights."""
    import shutil

    from medical_data.datalist import write_datalist
    from medical_data.monai_bundle import read_bundle
    from medical_data.tasks import select

    # Prepare: a copy of the final bundle with some of the benchmark's samples as files
    cfg, run_dir, _ = run
    again = tmp_path / "again"
    shutil.copytree(run_dir / "bundle" / "final", again)
    fed = federation(cfg)
    some = lambda d, n: select(d, [str(i) for i in d.sample_ids[:n]], keep=True)  # noqa: E731
    lists = {"training": some(fed.silos[0], 24), "validation": some(fed.test, 120)}
    write_datalist(again / "data", lists, fed.spec.task)
    b = read_bundle(again)
    trained, fresh = b.network(pretrained=True), b.network()
    task_cfg = _cfg(tmp_path, "r2", f"task.bundle={again}", "silos.count=2", "run.max_versions=2")
    # Execute
    summary = run_server(InProcessGrid(client_app, 2), task_cfg, tmp_path / "r2")
    # Assert: it trained; its version 0 is the bundle's weights: on the held-out files they
    # score as the run's model on those samples' arrays (within 0.05: the files' intensities
    # are rescaled by their percentiles), well above a fresh network
    from clients.task import BundleTask
    from medical_data.tasks import evaluate

    held = BundleTask(b, b.items("train"), b.items("validate"))
    cpu = torch.device("cpu")
    first = summary["evals"][0]
    on_arrays = evaluate(trained, lists["validation"], task=fed.spec.task, device=cpu)["score"]
    assert summary["versions"] == 2 and first["version"] == 0
    assert abs(first["score"] - held.evaluate(trained, device=cpu)["score"]) <= 1e-6
    assert abs(first["score"] - on_arrays) <= 0.05
    assert first["score"] > held.evaluate(fresh, device=cpu)["score"] + 0.1
    assert (tmp_path / "r2" / "bundle" / "final" / "configs" / "train.json").is_file()
