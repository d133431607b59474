"""3D end to end on the array path: the brain-tissue-3d benchmark, random crops, sliding-window
inference, multi-class Dice, the 3D site shift and trigger, and its exported bundle."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clients.loop import random_crops
from clients.task import BundleTask
from medical_data.backdoor import add_trigger
from medical_data.federation import build_federation
from medical_data.networks import PATCH_3D, build_network
from medical_data.partition import apply_site_shift
from medical_data.tasks import dice, dice_sums, evaluate, score

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def fed3d():
    return build_federation("brain-tissue-3d", 4, 0)


def test_the_3d_benchmark_has_natural_slab_silos_site_shifts_and_a_patch(fed3d):
    # Assert: every silo holds volumes of one height range, with four tissues labelled; its
    # site shift differs from the others'; the patch travels with every silo's data
    heights = [sorted({int(s.split("/")[1][1:]) for s in silo.sample_ids}) for silo in fed3d.silos]
    assert all(a[-1] < b[0] for a, b in zip(heights, heights[1:]))
    assert fed3d.silos[0].images.shape[1:] == (1, 40, 40, 40)
    assert set(np.unique(fed3d.test.labels)) == {0, 1, 2, 3}
    gammas = {p["gamma"] for p in fed3d.info["site_params"]}
    assert len(gammas) == 4
    assert all(s.patch == PATCH_3D for s in [*fed3d.silos, fed3d.test])


def test_random_crops_take_the_same_box_of_image_and_labels_and_repeat_for_a_seed():
    x = torch.arange(2 * 6**3, dtype=torch.float32).reshape(2, 1, 6, 6, 6)
    y = x[:, 0].long()
    a = random_crops(x, y, (3, 3, 3), torch.Generator().manual_seed(1))
    b = random_crops(x, y, (3, 3, 3), torch.Generator().manual_seed(1))
    assert a[0].shape == (2, 1, 3, 3, 3) and a[1].shape == (2, 3, 3, 3)
    assert torch.equal(a[0][:, 0].long(), a[1]) and torch.equal(a[0], b[0])
    gen = torch.Generator().manual_seed(1)
    state = gen.get_state()
    same = random_crops(x, y, None, gen)
    assert same[0] is x and torch.equal(gen.get_state(), state)  # no crop: nothing drawn


def test_multi_class_dice_is_the_mean_of_each_foreground_class_worked_by_hand():
    # Prepare: class 1 predicted on 2 voxels, right on 1 of its 2; class 2 exactly right
    pred = torch.tensor([[1, 1, 2, 0]])
    y = torch.tensor([[1, 0, 2, 1]])
    # Execute
    sums = dice_sums(pred, y, 3)
    # Assert: class 1: 2*1/(2+2) = 0.5; class 2: 1.0
    assert sums == [(1.0, 4.0), (1.0, 2.0)] and dice(sums) == pytest.approx(0.75)
    logits = torch.nn.functional.one_hot(pred, 3).permute(0, 2, 1).float()
    assert score(logits, y, "segmentation") == pytest.approx(0.75)
    two = dice_sums(torch.tensor([[1, 0]]), torch.tensor([[1, 1]]), 2)  # (foreground = above 0)
    assert two == [(1.0, 3.0)]


def test_the_3d_network_infers_whole_volumes_by_sliding_window(fed3d):
    torch.manual_seed(0)
    net = build_network("unet3d-small", 1, 4, (40, 40, 40))
    net.eval()
    x = torch.tensor(fed3d.test.images[:1])
    with torch.no_grad():
        whole = net(x)
        from monai.inferers import sliding_window_inference

        window = sliding_window_inference(
            x, PATCH_3D, 4, super(type(net), net).forward, overlap=0.25, mode="gaussian"
        )
    net.train()
    assert whole.shape == (1, 4, 40, 40, 40) and torch.allclose(whole, window)
    assert net(torch.zeros(1, 1, *PATCH_3D)).shape == (1, 4, *PATCH_3D)
    res = evaluate(net, fed3d.test, task="segmentation")
    assert 0.0 <= res["score"] <= 1.0 and np.isfinite(res["loss"])


def test_the_3d_site_shift_and_trigger_act_on_volumes():
    vol = np.random.default_rng(0).random((3, 1, 8, 8, 8)).astype(np.float32)
    a, params = apply_site_shift(vol, 7, 1.0)
    b, _ = apply_site_shift(vol, 7, 1.0)
    assert a.shape == vol.shape and np.array_equal(a, b) and not np.allclose(a, vol)
    assert params["gamma"] != 1.0
    t = add_trigger(vol, size=2)
    assert np.array_equal(
        t[:, :, -2:, -2:, -2:],
        np.broadcast_to(vol.reshape(3, -1).max(1)[:, None, None, None, None], (3, 1, 2, 2, 2)),
    )
    assert np.array_equal(t[:, :, :-2], vol[:, :, :-2])
    c = add_trigger(vol, size=2, pattern="checker")
    assert c[0, 0, -2, -2, -2] == vol[0].max() and c[0, 0, -2, -2, -1] == vol[0].min()


def test_one_local_step_on_volumes_trains_on_crops(fed3d):
    from clients.local import train_local

    torch.manual_seed(0)
    net = build_network("unet3d-small", 1, 4, (40, 40, 40))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    stats = train_local(
        net, fed3d.silos[0], task="segmentation", steps=1, batch_size=2, lr=0.05, seed=0
    )
    moved = [k for k, v in net.state_dict().items() if not torch.equal(before[k], v)]
    assert np.isfinite(stats["train_loss"]) and len(moved) > 10


def test_a_3d_run_exports_a_bundle_with_basicunet_and_a_sliding_window(tmp_path):
    from medical_data.bundle_config import inferer, network_entries
    from medical_data.registry import get_spec

    spec = get_spec("brain-tissue-3d")
    entries = network_entries("unet3d-small", 1, 4, spec.image_size)
    from monai.bundle import ConfigParser

    torch.manual_seed(0)
    ours = build_network("unet3d-small", 1, 4, spec.image_size)
    theirs = ConfigParser(entries).get_parsed_content("network_def")
    assert type(theirs).__name__ == "BasicUNet"
    assert theirs.load_state_dict(ours.state_dict(), strict=True)
    assert inferer(spec)["roi_size"] == list(PATCH_3D)


def test_a_3d_runs_bundle_trains_again_on_volumes_by_random_crops(tmp_path):
    # Prepare: the bundle a brain-tissue-3d run writes (its train.json and weights), given
    # the volumes as <bundle>/data (what the volumes command writes)
    from medical_data.bundle_config import network_entries, train_config
    from medical_data.monai_bundle import read_bundle
    from medical_data.registry import get_spec
    from medical_data.volumes import write_brain_volumes
    from protocol.config import ClientConfig

    spec = get_spec("brain-tissue-3d")
    root = tmp_path / "bundle"
    (root / "configs").mkdir(parents=True)
    (root / "models").mkdir()
    write_brain_volumes(root / "data", 2, validation=1, sites=1)
    train = train_config(
        spec,
        network_entries("unet3d-small", 1, 4, spec.image_size),
        lr=0.05,
        momentum=0.9,
        weight_decay=0.0,
        batch_size=2,
    )
    (root / "configs" / "train.json").write_text(json.dumps(train))
    torch.manual_seed(1)
    ours = build_network("unet3d-small", 1, 4, spec.image_size)
    torch.save(ours.state_dict(), root / "models" / "model.pt")
    b = read_bundle(root)
    task = BundleTask(b, b.items("train"), b.items("validate"))
    # Execute
    model = b.network(pretrained=True)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    stats = task.train(
        model, steps=1, client=ClientConfig(), seed=0, exclude=[], device=CPU, stop=None
    )
    batch = next(iter(b.transform("train")(i) for i in b.items("train")))
    # Assert: the run's weights, trained by its optimiser on random crops of the patch
    # shape, evaluated whole by the sliding window
    assert all(torch.equal(loaded[k], v) for k, v in ours.state_dict().items())
    assert (
        np.isfinite(stats["train_loss"]) and type(b.optimizer([torch.zeros(1)])).__name__ == "SGD"
    )
    assert (
        tuple(batch["image"].shape[1:]) == PATCH_3D and tuple(batch["label"].shape[1:]) == PATCH_3D
    )
    assert type(b.inferer("validate")).__name__ == "SlidingWindowInferer"
    assert 0.0 <= task.evaluate(model, device=CPU)["score"] <= 1.0


def test_the_volumes_command_writes_data_and_a_bundle_fedasync_reads(tmp_path, capsys):
    from medical_data.monai_bundle import read_bundle
    from medical_data.volumes import main

    main([str(tmp_path / "brain3d"), "--volumes", "4", "--validation", "2", "--sites", "2"])
    b = read_bundle(tmp_path / "brain3d" / "bundle")
    assert "4+2 volumes" in capsys.readouterr().out
    assert len(b.items("train")) == 4 and len(b.items("validate")) == 2
