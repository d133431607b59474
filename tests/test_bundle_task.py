"""A MONAI bundle is a silo's task: read by MONAI's ids, trained on fedasync's one loop from
volumes streamed from disk, evaluated by sliding window, in simulation and on a hospital's
node (``medical_data.monai_bundle``, ``clients.task.BundleTask``)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from clients.lab import LAB_SETTING
from clients.task import BundleTask, split_items
from medical_data import monai_bundle as mb
from medical_data.volumes import write_brain_volumes, write_bundle
from protocol.messages import TrainRefusal, TrainReply, TrainRequest
from server.app import run_server
from server.clock import client_setup


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    """Eight training volumes of two sites, two held out, and the bundle that trains on them."""
    root = tmp_path_factory.mktemp("brain3d")
    datalist = write_brain_volumes(root / "data", 8, validation=2, sites=2, seed=0)
    return write_bundle(root / "bundle", datalist.parent)


def _edited(bundle_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of the bundle with its train.json edited by ``edit(config)``."""
    folder = tmp_path / "edited"
    (folder / "configs").mkdir(parents=True)
    config = json.loads((bundle_dir / "configs" / "train.json").read_text())
    edit(config)
    (folder / "configs" / "train.json").write_text(json.dumps(config))
    return folder


def test_a_zoo_style_bundle_is_read_by_monais_ids_without_building_its_trainer(bundle_dir):
    # Execute
    b = mb.read_bundle(bundle_dir)
    net = b.network()
    # Assert: the parts MONAI names; its ignite trainer is there but never built
    assert type(net).__name__ == "BasicUNet" and b.task == "segmentation"
    assert type(b.loss()).__name__ == "DiceCELoss" and b.batch_size() == 2
    opt = b.optimizer(net.parameters())
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9
    assert type(b.inferer("validate")).__name__ == "SlidingWindowInferer"
    assert len(b.items("train")) == 8 and {i["site"] for i in b.items("train")} == {0, 1}
    assert b.has("train#trainer") and importlib.util.find_spec("ignite") is None
    spec = b.spec()
    assert (spec.in_channels, spec.num_classes, spec.image_size) == (1, 4, (32, 32, 32))


def test_every_network_of_a_bundle_is_built_anew_from_torchs_seed(bundle_dir):
    # (a parser's cached network, trained in place by one run, was the next run's start)
    b = mb.read_bundle(bundle_dir)
    torch.manual_seed(0)
    first = b.network()
    torch.manual_seed(0)
    again = b.network()
    torch.manual_seed(1)
    other = b.network()
    key = next(iter(first.state_dict()))
    assert first is not again and torch.equal(first.state_dict()[key], again.state_dict()[key])
    assert not torch.equal(first.state_dict()[key], other.state_dict()[key])


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda c: c["train"].update(inferer=c["validate"]["inferer"]), "'train#inferer'"),
        (lambda c: c.pop("loss"), "cannot build 'train#trainer#loss_function'"),
        (lambda c: c["network_def"].update(_target_="NoSuchNet"), "cannot build 'network_def'"),
        (lambda c: c.pop("network_def"), "no 'network_def'"),
    ],
)
def test_a_part_fedasync_cannot_drive_is_a_one_line_error_naming_its_id(
    bundle_dir, tmp_path, edit, says
):
    folder = _edited(bundle_dir, tmp_path, edit)
    with pytest.raises(mb.BundleError) as err:
        b = mb.read_bundle(folder)
        BundleTask(b, b.items("train")[:2], [])
        b.loss()
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_bundle_task_trains_in_place_and_evaluates_by_sliding_window(bundle_dir):
    # Prepare
    b = mb.read_bundle(bundle_dir)
    task = BundleTask(b, b.items("train")[:4], b.items("validate"), cache=2)
    model = task.network()
    before = copy.deepcopy(model.state_dict())
    client = client_setup_default()
    # Execute
    stats = task.train(
        model, steps=2, client=client, seed=0, exclude=[], device=torch.device("cpu"), stop=None
    )
    again = task.network()
    again.load_state_dict(before)
    same = task.train(
        again, steps=2, client=client, seed=0, exclude=[], device=torch.device("cpu"), stop=None
    )
    scores = task.evaluate(model, device=torch.device("cpu"))
    forget = task.forget_samples(task.sample_ids()[:3])
    stat = forget.statistic(model, np.arange(3), torch.device("cpu"))
    # Assert: trained (every parameter moved), reproducibly for a seed; scored on held-out
    # volumes; a statistic per sample; ids are the files' names
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items() if "conv" in k)
    assert stats["train_loss"] == same["train_loss"] and np.isfinite(stats["train_loss"])
    assert 0.0 <= scores["score"] <= 1.0 and np.isfinite(scores["loss"])
    assert len(forget) == 3 and stat.shape == (3,) and np.isfinite(stat).all()
    assert task.sample_ids()[0] == "brain3d-s0-0000"


def client_setup_default():
    from protocol.config import ClientConfig

    return ClientConfig()


def test_a_datalist_splits_into_silos_by_site_or_seeded():
    items = [{"image": f"v{i}.nii.gz", "site": i % 3} for i in range(9)]
    natural = split_items(items, 3, "natural", 0)
    assert [sorted({i["site"] for i in g}) for g in natural] == [[0], [1], [2]]
    a, b = split_items(items, 3, "iid", 1), split_items(items, 3, "iid", 1)
    assert a == b and sorted(i["image"] for g in a for i in g) == sorted(i["image"] for i in items)
    with pytest.raises(ValueError, match="silo 4 would have none"):
        split_items(items[:4], 5, "iid", 0)


def test_a_bundle_run_trains_and_writes_a_bundle_that_monai_loads_and_trains_again(
    small_cfg, bundle_dir
):
    # Prepare: two silos (the two sites), a few versions
    cfg = small_cfg(
        f"task.bundle={bundle_dir}",
        "silos.count=2",
        "run.max_versions=4",
        "server.eval_every=2",
        "client.local_steps=1",
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(InProcessGrid(client_app, 2), cfg, run_dir)
    final = run_dir / "bundle" / "final"
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(final / "configs" / "train.json"))
    net = parser.get_parsed_content("network_def")
    weights = torch.load(final / "models" / "model.pt", weights_only=True)
    # Assert: the run's versions, evaluated on the bundle's validation list; its final model
    # loads strictly into the bundle's network_def by monai.bundle alone, and is where a
    # run on that bundle starts
    assert summary["versions"] == 4 and summary["evals"][-1]["version"] == 4
    assert net.load_state_dict(weights, strict=True)
    again = mb.read_bundle(final).network(pretrained=True)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in weights.items())
    meta = json.loads((final / "configs" / "metadata.json").read_text())
    assert meta["fedasync"]["model_version"] == 4 and meta["network_data_format"]


def test_a_hospital_node_trains_its_own_bundle_on_its_datalist_and_refuses_a_backdoor(
    small_cfg, bundle_dir
):
    # Prepare: a node with its own bundle and datalist; the coordinator's run names the bundle
    cfg = small_cfg(f"task.bundle={bundle_dir}", "silos.count=2", "client.local_steps=1")
    grid = InProcessGrid(client_app, 1)
    node, ctx = next(iter(grid.contexts.items()))
    datalist = Path(json.loads((bundle_dir / "configs" / "train.json").read_text())["dataset_dir"])
    ctx.node_config.update(bundle=str(bundle_dir), datalist=str(datalist / "dataset.json"))
    setup = client_setup(cfg).to_json()
    poisoned = client_setup(
        small_cfg("lab.backdoor.enabled=true", "silos.count=2")
    ).to_json()  # (a coordinator's config may name one; the node refuses it)
    params = mb.read_bundle(bundle_dir).network().state_dict()
    # Execute
    [a, b] = grid.push_messages(
        [
            TrainRequest(setup, 1, 0, 1, params).to_message(node),
            TrainRequest(poisoned, 2, 0, 2, params).to_message(node),
        ]
    )
    trained, refused = grid.pull_messages([a, b])
    # Assert: all eight of its own volumes; the backdoor refused in one line
    assert TrainReply.from_message(trained).num_samples == 8
    assert TrainRefusal.from_message(refused).reason == LAB_SETTING


def test_a_node_is_given_its_own_bundle_and_datalist_checked_before_it_starts(bundle_dir, tmp_path):
    import argparse

    from simulations.node import NodeError, own_task_config

    datalist = Path(json.loads((bundle_dir / "configs" / "train.json").read_text())["dataset_dir"])
    ok = argparse.Namespace(
        node_config="partition-id=1 num-partitions=2",
        datalist=datalist / "dataset.json",
        bundle=bundle_dir,
    )
    config = own_task_config(ok)
    assert f'bundle="{bundle_dir.resolve()}"' in config and 'datalist="' in config
    bad = _edited(
        bundle_dir, tmp_path, lambda c: c["train"].update(inferer=c["validate"]["inferer"])
    )
    for args, says in (
        (argparse.Namespace(node_config="", datalist=None, bundle=bundle_dir), "needs --datalist"),
        (argparse.Namespace(node_config="", datalist=tmp_path / "x.json", bundle=None), "no such"),
        (argparse.Namespace(node_config="", datalist=ok.datalist, bundle=bad), "train#inferer"),
    ):
        with pytest.raises(NodeError, match=says):
            own_task_config(args)


def test_a_one_machine_deployment_gives_each_silo_its_share_as_its_own_datalist(
    small_cfg, bundle_dir, tmp_path
):
    from monai.data import load_decathlon_datalist

    from simulations.deploy import bundle_datalists

    cfg = small_cfg(f"task.bundle={bundle_dir}", "silos.count=2")
    files = bundle_datalists(cfg, tmp_path / "hospitals")
    got = {s: load_decathlon_datalist(str(f), True, "training") for s, f in files.items()}
    assert {i["site"] for i in got[0]} == {0} and {i["site"] for i in got[1]} == {1}
    assert sum(len(v) for v in got.values()) == 8 and all(
        Path(i["image"]).is_file() for i in got[0]
    )


def test_a_silo_of_a_bundle_task_is_erased_while_the_others_train(small_cfg, bundle_dir):
    # Prepare: two silos; silo 1 asks to be forgotten once the run is under way
    from fedasync.events import read_events

    cfg = small_cfg(
        f"task.bundle={bundle_dir}",
        "silos.count=2",
        "run.max_versions=10",
        "run.budget_s=60",
        "client.local_steps=1",
        "erasures=[{silo: 1, at_s: 4}]",
        "unlearning.stop=fixed",
        "unlearning.steps=2",
        "lab.erasure.signature_batches=2",
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    run_server(InProcessGrid(client_app, 2), cfg, run_dir)
    events = read_events(run_dir / "metrics.jsonl")
    # Assert: the erasure went through the silo (its ascent and signature on its volumes)
    # to calibration, and no update of silo 1 was taken after the request
    states = {e["state"]: e for e in events if e["event"] == "erasure"}
    done = states["calibrating"]
    assert done["silo_steps"] == 2 and done["silo_signature_rank"] >= 1
    later = [e for e in events if e["event"] == "update" and e["t"] > states["erasing"]["t"]]
    assert later and all(e["silo"] == 0 for e in later)


def test_a_hospital_node_erases_the_items_it_is_asked_for_and_refuses_others(small_cfg, bundle_dir):
    # Prepare: a hospital's node with its own bundle; an erasure of one of its volumes (ids as
    # the erasure service sends them) and one of a volume it does not hold
    from protocol.config import SiloErasure
    from protocol.erasure_messages import UnlearnReply, UnlearnRequest

    cfg = small_cfg(f"task.bundle={bundle_dir}", "silos.count=2")
    grid = InProcessGrid(client_app, 1)
    node, ctx = next(iter(grid.contexts.items()))
    datalist = Path(json.loads((bundle_dir / "configs" / "train.json").read_text())["dataset_dir"])
    ctx.node_config.update(bundle=str(bundle_dir), datalist=str(datalist / "dataset.json"))
    setup = client_setup(cfg).to_json()
    params = mb.read_bundle(bundle_dir).network().state_dict()
    erasure = SiloErasure(steps=2, stop="membership", stop_every=1, signature_batches=2)
    ask = [("brain3d-s0-0000",), ("brain3d-s9-9999",)]
    # Execute
    ids = grid.push_messages(
        [
            UnlearnRequest(setup, j, 0, 0, params, erasure, f).to_message(node)
            for j, f in enumerate(ask)
        ]
    )
    erased, refused = grid.pull_messages(ids)
    # Assert: one volume ascended against its held-out ones, with a signature; the other id
    # refused in one line
    got = UnlearnReply.from_message(erased)
    assert got.num_samples == 1 and got.basis.shape[0] >= 1
    assert got.metrics["compared"] >= 2 and got.metrics["readings"] >= 1
    assert refused.has_error() and "are not held by silo 0" in refused.error.reason
