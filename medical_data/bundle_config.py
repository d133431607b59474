"""A benchmark's network and data as a MONAI bundle's config says them: MONAI and torch only.

A hospital loads a federated model with ``monai.bundle.ConfigParser`` and nothing of
fedasync, so every network is said here as ConfigParser entries whose targets are MONAI's or
torch's, built to the very module ``medical_data.networks.build_network`` builds (same
submodule names, so the run's state_dict loads strictly; same outputs):

- the MONAI networks (densenet121, resnet18, unet-small, unet, mlp-small): ``network_def`` is
  the MONAI class with the arguments ``networks.monai_recipe`` gives ``build_network``. Where
  the run's network differs from what that call builds (resnet18: MONAI 1.6's ``ResNet``
  gives its residual blocks BatchNorm and in-place ReLU whatever is asked, and
  ``networks._no_batchnorm`` swaps them), the differences are found by building both and
  comparing them module by module, and each becomes a ``network_edits`` entry calling
  ``monai.networks.utils.replace_modules`` on ``network_base``; ``network_def`` is then
  ``network_base`` after its edits (``_requires_``);
- ``cnn-small`` (``networks.SmallCNN``, a class of this project's): a ``torch.nn.Sequential``
  of named children: ``features`` (its ``blocks.Convolution`` units, from
  ``SmallCNN.unit_args``), ``pool`` (``AdaptiveAvgPool2d(1)``: torch computes it as the mean
  over H and W that ``SmallCNN.forward`` takes), ``flatten`` and ``head`` (the linear layer).
  ``torch.nn.Sequential`` takes its children positionally, which a ConfigParser component
  cannot pass, so that one entry is an expression (``$torch.nn.Sequential(...)``).

``preprocessing`` says in MONAI transforms what ``medical_data.datalist`` does to a
hospital's image before the network sees it (intensity percentiles to [0, 1], the longer side
resized to the benchmark's size, padded square); ``postprocessing`` takes the predicted class
(classification) or label map (segmentation) as the run scores it: the argmax of the logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from medical_data.networks import MONAI_CLASSES, SmallCNN, build_network, monai_recipe
from medical_data.registry import BenchmarkSpec, is_tabular

PERCENTILES = (0.5, 99.5)
"""The intensity percentiles a datalist's image is mapped from to [0, 1] (``"auto"``)."""


def plain(x: Any) -> Any:
    """``x`` with tuples as lists, as JSON holds them."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    return x


def network_entries(
    name: str, in_channels: int, num_classes: int, image_size: tuple[int, ...]
) -> dict[str, Any]:
    """The ConfigParser entries that define ``network_def``, network ``name`` of
    ``build_network`` (the module docstring says how); ValueError as ``build_network``."""
    if name == "cnn-small":
        return _cnn_small(in_channels, num_classes)
    target, kwargs = monai_recipe(name, in_channels, num_classes, image_size)
    if name == "unet3d-small":  # BasicUNet's own modules; the window is the bundle's inferer
        return {"network_def": {"_target_": target, **plain(kwargs)}}
    base = {"_target_": target, **plain(kwargs)}
    with torch.random.fork_rng(devices=[]):  # (both draw their initial weights)
        built = build_network(name, in_channels, num_classes, image_size)
        made = MONAI_CLASSES[target](**kwargs)
    edits = module_edits(built, made)
    if not edits:
        return {"network_def": base}
    return {
        "network_base": base,
        "network_edits": [
            {
                "_target_": "monai.networks.utils.replace_modules",
                "parent": "@network_base",
                "name": path,
                "new_module": module,
            }
            for path, module in edits
        ],
        "network_def": {
            "_target_": "monai.utils.first",
            "_requires_": "@network_edits",
            "_desc_": (
                "network_base once network_edits are applied: the network the run trained "
                f"({name}: where it differs from what {target} builds)"
            ),
            "iterable": ["@network_base"],
        },
    }


def _cnn_small(in_channels: int, num_classes: int) -> dict[str, Any]:
    units = SmallCNN.unit_args(in_channels)
    return {
        "imports": ["$import collections"],
        "cnn_units": [
            {"_target_": "monai.networks.blocks.Convolution", **plain(kw)} for kw in units
        ],
        "cnn_layers": {
            "features": "$torch.nn.Sequential(*@cnn_units)",
            "pool": {"_target_": "torch.nn.AdaptiveAvgPool2d", "output_size": 1},
            "flatten": {"_target_": "torch.nn.Flatten"},
            "head": {
                "_target_": "torch.nn.Linear",
                "in_features": units[-1]["out_channels"],
                "out_features": num_classes,
            },
        },
        "network_def": "$torch.nn.Sequential(collections.OrderedDict(@cnn_layers))",
    }


def module_edits(built: nn.Module, made: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    """Where ``built`` (the run's network) differs from ``made`` (what its MONAI class
    builds): ``(submodule path, ConfigParser component of built's module there)``, outermost
    first. TypeError naming the path for a difference this cannot say."""
    theirs = dict(made.named_modules())
    edits: list[tuple[str, dict[str, Any]]] = []
    for path, module in built.named_modules():
        if any(path.startswith(p + ".") for p, _ in edits):
            continue  # inside a module already replaced
        other = theirs.get(path)
        if other is not None and _same(other, module, path):
            continue
        config = _config(module, path)
        assert config is not None  # (strict: TypeError otherwise)
        edits.append((path, config))
    return edits


def _same(a: nn.Module, b: nn.Module, path: str) -> bool:
    """The same kind of module, built alike where it matters (``_config``)."""
    return type(a) is type(b) and _config(a, path, strict=False) == _config(b, path, strict=False)


def _config(module: nn.Module, path: str, *, strict: bool = True) -> dict[str, Any] | None:
    """``module`` as a ConfigParser component, for the kinds ``_no_batchnorm`` makes; None
    for another kind unless ``strict`` (then TypeError naming ``path``)."""
    if isinstance(module, nn.GroupNorm):
        return {
            "_target_": "torch.nn.GroupNorm",
            "num_groups": module.num_groups,
            "num_channels": module.num_channels,
            "eps": module.eps,
            "affine": module.affine,
        }
    if type(module) is nn.ReLU:
        return {"_target_": "torch.nn.ReLU", "inplace": module.inplace}
    if type(module) is nn.LeakyReLU:
        return {
            "_target_": "torch.nn.LeakyReLU",
            "negative_slope": module.negative_slope,
            "inplace": module.inplace,
        }
    if strict:
        raise TypeError(
            f"{path or 'the network'}: a {type(module).__name__} where MONAI's network has "
            "another module; medical_data/bundle_config.py cannot say it in a bundle config"
        )
    return None


def preprocessing(spec: BenchmarkSpec) -> dict[str, Any]:
    """MONAI dictionary transforms (key ``image``) that make what the network takes of a
    hospital's file, as ``medical_data.datalist`` reads it (intensity ``"auto"``)."""
    if is_tabular(spec.image_size):
        return {
            "_target_": "monai.transforms.Compose",
            "_desc_": (
                f"{spec.name}: each sample is a (1, 1, {spec.image_size[1]}) float array of "
                "the benchmark's standardised features (z-scores), taken as stored"
            ),
            "transforms": [
                {"_target_": "monai.transforms.EnsureTyped", "keys": "image", "dtype": "float32"}
            ],
        }
    if len(spec.image_size) == 3:
        return {
            "_target_": "monai.transforms.Compose",
            "_desc_": f"a {'x'.join(map(str, spec.image_size))} volume, intensities in [0, 1]",
            "transforms": [
                {"_target_": "monai.transforms.LoadImaged", "keys": "image", "image_only": True},
                {"_target_": "monai.transforms.EnsureChannelFirstd", "keys": "image"},
                {"_target_": "monai.transforms.EnsureTyped", "keys": "image", "dtype": "float32"},
            ],
        }
    h, w = spec.image_size
    lo, hi = PERCENTILES
    return {
        "_target_": "monai.transforms.Compose",
        "_desc_": (
            "a 2D image file (one channel a file, or their list) as fedasync reads a "
            f"datalist: each channel's {lo}-{hi} percentiles to [0, 1] (8-bit files: "
            f"fedasync divides by 255 instead), the longer side resized to {max(h, w)}, "
            f"padded to {h}x{w}"
        ),
        "transforms": [
            {"_target_": "monai.transforms.LoadImaged", "keys": "image", "image_only": True},
            {"_target_": "monai.transforms.EnsureChannelFirstd", "keys": "image"},
            {
                "_target_": "monai.transforms.ScaleIntensityRangePercentilesd",
                "keys": "image",
                "lower": lo,
                "upper": hi,
                "b_min": 0.0,
                "b_max": 1.0,
                "clip": True,
                "channel_wise": True,
            },
            {
                "_target_": "monai.transforms.Resized",
                "keys": "image",
                "spatial_size": max(h, w),
                "size_mode": "longest",
                "mode": "area",
            },
            {
                "_target_": "monai.transforms.SpatialPadd",
                "keys": "image",
                "spatial_size": [h, w],
                "method": "symmetric",
            },
            {"_target_": "monai.transforms.EnsureTyped", "keys": "image", "dtype": "float32"},
        ],
    }


def postprocessing(spec: BenchmarkSpec) -> dict[str, Any]:
    """The prediction as the run scores it: the argmax over the network's output channels
    (key ``pred``): a class index, or a label map of ``spec.image_size``."""
    return {
        "_target_": "monai.transforms.Compose",
        "transforms": [
            {"_target_": "monai.transforms.AsDiscreted", "keys": "pred", "argmax": True}
        ],
    }


def network_data_format(spec: BenchmarkSpec) -> dict[str, Any]:
    """MONAI's ``network_data_format``: what the network takes and what it gives."""
    shape = list(spec.image_size)
    tabular = is_tabular(spec.image_size)
    inputs = {
        "image": {
            "type": "series" if tabular else "image",
            "format": "sequence" if tabular else "magnitude",
            "modality": spec.modality,
            "num_channels": spec.in_channels,
            "spatial_shape": shape,
            "dtype": "float32",
            "value_range": [] if tabular else [0, 1],
            "is_patch_data": False,
            "channel_def": (
                {"0": "standardised features (z-scores)"}
                if tabular
                else {str(c): f"intensity, channel {c}" for c in range(spec.in_channels)}
            ),
        }
    }
    classes = {str(i): n for i, n in enumerate(spec.class_names)}
    seg = spec.task == "segmentation"
    outputs = {
        "pred": {
            "type": "image" if seg else "probabilities",
            "format": "labels" if seg else "classes",
            "num_channels": spec.num_classes,
            "spatial_shape": shape if seg else [],
            "dtype": "float32",
            "value_range": [],
            "is_patch_data": False,
            "channel_def": classes,
        }
    }
    return {"inputs": inputs, "outputs": outputs}


DATA_DIR = "data"
"""Where a run's bundle's ``train.json`` reads its datalist: ``<bundle>/data/dataset.json``."""


def train_config(
    spec: BenchmarkSpec,
    network: dict[str, Any],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    batch_size: int,
) -> dict[str, Any] | None:
    """A model-zoo style ``configs/train.json`` for a built-in benchmark's model, so that a
    bundle a run wrote trains again (``fedasync simulate task.bundle=DIR``, starting from its
    ``models/model.pt``): ``network_def`` (``network``, as :func:`network_entries`), the
    run's loss (cross-entropy, or MONAI's DiceCE with softmax and one-hot labels) and SGD with
    the run's ``lr``, ``momentum`` and ``weight_decay``; the image's transforms of
    :func:`preprocessing` applied alike to a segmentation's label file (nearest-neighbour),
    a random crop of ``spec.patch`` on volumes; the datalist
    ``<bundle_root>/data/dataset.json`` (Decathlon: ``training``, ``validation``; what
    ``medical_data.datalist.write_datalist`` writes), which the hospital supplies. None for a
    tabular benchmark (no image files to read)."""
    if is_tabular(spec.image_size):
        return None
    seg = spec.task == "segmentation"
    keys = ["image", "label"] if seg else ["image"]
    deterministic: list[dict[str, Any]] = []
    for t in preprocessing(spec)["transforms"]:
        t = dict(t)
        name = t["_target_"].rsplit(".", 1)[-1]
        if seg and name in ("LoadImaged", "EnsureChannelFirstd", "SpatialPadd"):
            t["keys"] = keys
        elif seg and name == "Resized":
            t.update(keys=keys, mode=["area", "nearest"])
        elif seg and name == "EnsureTyped":
            t.update(keys=keys, dtype=["float32", "int64"])
        deterministic.append(t)
    random: list[dict[str, Any]] = []
    if spec.patch is not None:
        random.append(
            {
                "_target_": "monai.transforms.RandSpatialCropd",
                "keys": keys,
                "roi_size": list(spec.patch),
                "random_size": False,
            }
        )
    datalist = "os.path.join(@bundle_root, '" + DATA_DIR + "', 'dataset.json')"
    entries = dict(network)
    loss = (
        {"_target_": "monai.losses.DiceCELoss", "to_onehot_y": True, "softmax": True}
        if seg
        else {"_target_": "torch.nn.CrossEntropyLoss"}
    )
    return {
        "imports": ["$import os", "$import torch", "$import monai", *entries.pop("imports", [])],
        "bundle_root": ".",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "train_datalist": f"$monai.data.load_decathlon_datalist({datalist}, True, 'training')",
        "val_datalist": f"$monai.data.load_decathlon_datalist({datalist}, True, 'validation')",
        **entries,
        "network": "$@network_def.to(@device)",
        "loss": loss,
        "optimizer": {
            "_target_": "torch.optim.SGD",
            "params": "$@network.parameters()",
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
        },
        "train": {
            "deterministic_transforms": deterministic,
            "random_transforms": random,
            "preprocessing": {
                "_target_": "monai.transforms.Compose",
                "transforms": "$@train#deterministic_transforms + @train#random_transforms",
            },
            "dataset": {
                "_target_": "monai.data.Dataset",
                "data": "@train_datalist",
                "transform": "@train#preprocessing",
            },
            "dataloader": {
                "_target_": "monai.data.DataLoader",
                "dataset": "@train#dataset",
                "batch_size": batch_size,
                "shuffle": True,
                "num_workers": 0,
            },
            "inferer": {"_target_": "monai.inferers.SimpleInferer"},
        },
        "validate": {
            "preprocessing": {
                "_target_": "monai.transforms.Compose",
                "transforms": "$@train#deterministic_transforms",
            },
            "dataset": {
                "_target_": "monai.data.Dataset",
                "data": "@val_datalist",
                "transform": "@validate#preprocessing",
            },
            "inferer": inferer(spec),
        },
    }


def inferer(spec: BenchmarkSpec) -> dict[str, Any]:
    """The network called on the image, or on volumes (``spec.patch``) MONAI's sliding window
    as the run evaluated them (``medical_data.networks.PatchwiseBasicUNet``)."""
    if spec.patch is None:
        return {"_target_": "monai.inferers.SimpleInferer"}
    return {
        "_target_": "monai.inferers.SlidingWindowInferer",
        "roi_size": list(spec.patch),
        "sw_batch_size": 4,
        "overlap": 0.25,
        "mode": "gaussian",
    }
