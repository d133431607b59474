"""A MONAI bundle as a task: its network, loss, optimiser, transforms, datalist and inferers.

A training bundle in the model zoo's layout (``configs/train.json`` or ``.yaml``,
``configs/metadata.json``, ``models/``) is read with ``monai.bundle.ConfigParser`` by the ids
that ``monai.bundle.properties.TrainProperties`` defines, and the zoo's top-level ``loss`` and
``optimizer``, as MONAI's own ``monai.fl.client.MonaiAlgo`` reads one:

| part            | id                                                                 |
|-----------------|--------------------------------------------------------------------|
| network         | ``network_def``                                                    |
| training data   | ``train#dataset#data`` (a list of dicts: ``image``, ``label``, ...) |
| its transforms  | ``train#preprocessing``, else ``train#dataset#transform``           |
| training forward| ``train#inferer`` (a ``SimpleInferer``: the network called on a batch)|
| loss            | ``loss``, else ``train#trainer#loss_function``                      |
| optimiser       | ``optimizer`` (its ``_target_`` and arguments; ``params`` is ours)  |
| batch size      | ``train#dataloader#batch_size`` (default 2)                         |
| held-out data   | ``validate#dataset#data``, transforms ``validate#preprocessing``    |
| evaluation      | ``validate#inferer`` (e.g. ``SlidingWindowInferer``)                 |

``ConfigParser.get_parsed_content`` builds only what an id needs, so the zoo's ignite
``SupervisedTrainer`` (``train#trainer``) and handlers that reference its evaluator are never
built: fedasync drives the parts with its own loop (clients/loop.py), which the erasure
needs. A part that is missing or cannot be built is a :class:`BundleError` naming its id, in
one line. Nothing of the bundle is re-declared in fedasync's config.

Data is streamed from disk: a silo's dataset is MONAI's ``CacheDataset`` over its items with
``cache`` items' deterministic transforms kept in memory, or ``Dataset`` (``cache=0``), so a
silo's memory is bounded by its cache setting, not by the size of its data. 2D and 3D alike.

The score of a segmentation bundle is the mean over the foreground classes of each class's
Dice pooled over the evaluated volumes (a class absent from both prediction and labels counts
1); of a classification bundle, the accuracy.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedasync.errors import ConfigError
from medical_data.registry import BenchmarkSpec

CONFIG_NAMES = ("train.json", "train.yaml", "train.yml")


class BundleError(ConfigError):
    """A bundle that cannot be driven: the message names the bundle and the id."""


def _bounded(text: object, limit: int = 160) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit] + "..."


@dataclass
class MonaiBundle:
    """A parsed training bundle (read with :func:`read_bundle`, cached per folder and
    modification time; treat as read-only)."""

    root: Path
    parser: Any
    """``monai.bundle.ConfigParser`` over ``configs/train.*``."""
    metadata: dict[str, Any]

    # ------------------------------------------------------------------ reading parts

    def has(self, id_: str) -> bool:
        """Whether the config has ``id_`` (``#`` or ``::`` separated)."""
        return self.parser.get(id_.replace("#", "::"), None) is not None

    def parsed(self, id_: str) -> Any:
        """The content of ``id_`` built anew (never the parser's cached object: a network, a
        loss or a transform is the caller's own); BundleError naming it when missing or
        failing."""
        key = id_.replace("#", "::")
        if not self.has(key):
            raise BundleError(f"bundle {self.root}: no '{id_}' in its config, which fedasync needs")
        try:
            return self.parser.get_parsed_content(key, instantiate=True, lazy=False)
        except Exception as e:  # noqa: BLE001 - any failure of the bundle's own code, in one line
            raise BundleError(
                f"bundle {self.root}: cannot build '{id_}' ({type(e).__name__}: {_bounded(e)})"
            ) from e

    def network(self, *, pretrained: bool = False) -> nn.Module:
        """A fresh ``network_def`` (torch's global generator draws its initial weights); with
        ``pretrained``, the weights of the bundle's ``models/model.pt`` when it has one (a
        zoo model to fine-tune, or a bundle a run wrote, trained again)."""
        net = self.parsed("network_def")
        if not isinstance(net, nn.Module):
            raise BundleError(f"bundle {self.root}: 'network_def' is not a torch module")
        weights = self.root / "models" / "model.pt"
        if pretrained and weights.is_file():
            try:
                state = torch.load(weights, map_location="cpu", weights_only=True)
                net.load_state_dict(state.get("model", state) if "model" in state else state)
            except Exception as e:  # noqa: BLE001 - a file that is not these weights
                raise BundleError(
                    f"bundle {self.root}: models/model.pt does not load into 'network_def' "
                    f"({type(e).__name__}: {_bounded(e)})"
                ) from e
        return net

    def loss(self) -> nn.Module:
        """The top-level ``loss`` (the zoo's), else the trainer's ``loss_function``."""
        for id_ in ("loss", "train#trainer#loss_function"):
            if self.has(id_):
                return self.parsed(id_)
        raise BundleError(f"bundle {self.root}: no 'loss' in its config, which fedasync needs")

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The bundle's ``optimizer`` (its target and arguments) over ``params``."""
        from pydoc import locate

        if not self.has("optimizer"):
            raise BundleError(f"bundle {self.root}: no 'optimizer' in its config")
        raw = dict(self.parser.get("optimizer"))
        target = raw.pop("_target_", None)
        cls: Any = locate(str(target)) if isinstance(target, str) else None
        if cls is None:
            cls = getattr(torch.optim, str(target), None)
        if cls is None:
            raise BundleError(f"bundle {self.root}: 'optimizer' names {_bounded(target, 60)}")
        kwargs = {}
        for k, v in raw.items():
            if k == "params" or k.startswith("_"):
                continue
            if isinstance(v, str) and v[:1] in "$@%":
                kwargs[k] = self.parsed(f"optimizer#{k}")
            else:
                kwargs[k] = v
        try:
            return cls(params, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise BundleError(
                f"bundle {self.root}: cannot build 'optimizer' ({type(e).__name__}: {_bounded(e)})"
            ) from e

    def items(self, which: str) -> list[dict[str, Any]]:
        """The datalist of ``which`` ("train" or "validate"): a list of dicts."""
        data = self.parsed(f"{which}#dataset#data")
        if not isinstance(data, Sequence) or not all(isinstance(d, dict) for d in data):
            raise BundleError(f"bundle {self.root}: '{which}#dataset#data' is not a list of dicts")
        return [dict(d) for d in data]

    def transform(self, which: str) -> Callable[[Any], Any]:
        """``{which}#preprocessing``, else ``{which}#dataset#transform``."""
        for id_ in (f"{which}#preprocessing", f"{which}#dataset#transform"):
            if self.has(id_):
                return self.parsed(id_)
        if which == "validate":
            raise BundleError(f"bundle {self.root}: no 'validate#preprocessing' in its config")
        raise BundleError(f"bundle {self.root}: no 'train#preprocessing' in its config")

    def inferer(self, which: str) -> Callable[[torch.Tensor, nn.Module], torch.Tensor]:
        """``{which}#inferer`` (default: the network called on the batch)."""
        from monai.inferers import SimpleInferer

        return self.parsed(f"{which}#inferer") if self.has(f"{which}#inferer") else SimpleInferer()

    def check_train_inferer(self) -> None:
        """Training calls the network on a batch: a ``train#inferer`` that does more (e.g. a
        sliding window in training) cannot be driven."""
        from monai.inferers import SimpleInferer

        inf = self.inferer("train")
        if type(inf) is not SimpleInferer:
            raise BundleError(
                f"bundle {self.root}: 'train#inferer' is {type(inf).__name__}; fedasync trains "
                "with the network called on each batch (SimpleInferer)"
            )

    def batch_size(self) -> int:
        """``train#dataloader#batch_size``, default 2."""
        if self.has("train#dataloader#batch_size"):
            return int(self.parsed("train#dataloader#batch_size"))
        return 2

    @functools.cached_property
    def task(self) -> str:
        """ "segmentation" or "classification": the metadata's output format, else what the
        first training label is (a file: segmentation)."""
        fmt = (
            self.metadata.get("network_data_format", {})
            .get("outputs", {})
            .get("pred", {})
            .get("format", "")
        )
        if fmt in ("segmentation", "classification"):
            return str(fmt)
        first = self.items("train")[:1]
        label = first[0].get("label") if first else None
        return "segmentation" if isinstance(label, str) else "classification"

    def spec(self) -> BenchmarkSpec:
        """What the server needs to know of it, as a benchmark's spec: the task, the
        network's input channels and classes (from ``network_def``'s arguments), the shape
        of its patches (the metadata's ``spatial_shape``)."""
        net = self.parser.get("network_def")
        args = dict(net) if isinstance(net, dict) else {}
        channels = int(args.get("in_channels", 1))
        classes = int(args.get("out_channels", args.get("num_classes", 2)))
        inputs = self.metadata.get("network_data_format", {}).get("inputs", {})
        shape = tuple(inputs.get("image", {}).get("spatial_shape", ()))
        return BenchmarkSpec(
            name=str(self.metadata.get("name", self.root.name))[:80],
            task="segmentation" if self.task == "segmentation" else "classification",
            modality=str(inputs.get("image", {}).get("modality", "")),
            in_channels=channels,
            num_classes=classes,
            image_size=shape,  # type: ignore[arg-type]
            class_names=tuple(f"class {i}" for i in range(classes)),
            network="bundle",
            natural_split="the datalist's site (else its order)",
            description=f"MONAI bundle {self.root}",
        )

    def network_def(self) -> dict[str, Any]:
        """The raw ``network_def`` entries, for the bundles a run writes."""
        return {"network_def": copy.deepcopy(self.parser.get("network_def"))}


def _config_file(root: Path) -> Path:
    for name in CONFIG_NAMES:
        if (root / "configs" / name).is_file():
            return root / "configs" / name
    raise BundleError(
        f"bundle {root}: no configs/train.json or configs/train.yaml (a training bundle)"
    )


@functools.lru_cache(maxsize=4)
def _read(root: str, stamp: int) -> MonaiBundle:
    from monai.bundle import ConfigParser

    path = Path(root)
    parser = ConfigParser()
    try:
        parser.read_config(str(_config_file(path)))
    except BundleError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed file, in one line
        raise BundleError(f"bundle {path}: its config cannot be read ({_bounded(e)})") from e
    parser["bundle_root"] = str(path)
    meta_file = path / "configs" / "metadata.json"
    metadata = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    bundle = MonaiBundle(path, parser, metadata)
    if not bundle.has("network_def"):
        raise BundleError(f"bundle {path}: no 'network_def' in its config, which fedasync needs")
    return bundle


def read_bundle(root: str | Path) -> MonaiBundle:
    """The bundle in folder ``root`` (read once per version of its config file)."""
    path = Path(root).expanduser().resolve()
    if not path.is_dir():
        raise BundleError(f"bundle {_bounded(path)}: no such folder")
    return _read(str(path), _config_file(path).stat().st_mtime_ns)


# ---------------------------------------------------------------------- data


def item_id(item: dict[str, Any]) -> str:
    """A datalist item's sample id: its ``id``, else its image file's name without the
    extensions (``imagesTr/case_001.nii.gz`` -> ``case_001``)."""
    if "id" in item:
        return str(item["id"])
    image = item.get("image")
    if isinstance(image, list | tuple):
        image = image[0] if image else ""
    name = Path(str(image)).name
    for ext in (".nii.gz", ".nii", ".nrrd", ".mha", ".png", ".jpg", ".npy", ".dcm"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def dataset(items: list[dict[str, Any]], transform: Any, cache: int) -> Any:
    """MONAI's ``CacheDataset`` over ``items`` keeping ``cache`` items' deterministic
    transforms in memory, or its ``Dataset`` (``cache=0``): every other read streams from
    disk."""
    from monai.data import CacheDataset, Dataset

    if cache <= 0:
        return Dataset(items, transform=transform)
    return CacheDataset(items, transform=transform, cache_num=cache, num_workers=0, progress=False)


def _plain(x: Any) -> torch.Tensor:
    """``x`` as a plain tensor: a MONAI ``MetaTensor``'s data without its metadata, which
    every torch call on it would otherwise carry along (training needs none of it)."""
    return x.as_tensor() if hasattr(x, "as_tensor") else torch.as_tensor(x)


def batches(loader: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(image, label)`` of each batch of a MONAI loader (dicts keyed ``image``, ``label``),
    plain tensors."""
    for batch in loader:
        yield _plain(batch["image"]), _plain(batch["label"])


def label_map(y: torch.Tensor) -> torch.Tensor:
    """A label batch ``(b, 1, *spatial)`` or ``(b, *spatial)`` as ``(b, *spatial)`` int64."""
    if y.ndim >= 3 and y.shape[1] == 1:
        y = y[:, 0]
    return y.long()


def class_dice(out: torch.Tensor, y: torch.Tensor, classes: int) -> np.ndarray:
    """Per foreground class, the (intersection, denominator) sums of ``argmax(out)`` against
    ``y``: ``(classes - 1, 2)``."""
    pred, lab = out.argmax(dim=1), label_map(y)
    rows = []
    for c in range(1, classes):
        p, t = pred == c, lab == c
        rows.append((float((p & t).sum()), float(p.sum() + t.sum())))
    return np.asarray(rows, dtype=np.float64).reshape(-1, 2)


def dice_score(sums: np.ndarray) -> float:
    """Mean over foreground classes of pooled Dice (a class absent from both: 1)."""
    if len(sums) == 0:
        return math.nan
    per = [1.0 if d == 0 else 2.0 * i / d for i, d in sums]
    return float(np.mean(per))


def batch_score(out: torch.Tensor, y: torch.Tensor, task: str) -> float:
    """A batch's score: mean foreground Dice, or accuracy."""
    if task == "segmentation":
        return dice_score(class_dice(out, y, out.shape[1]))
    return float((out.argmax(dim=1) == y.view(-1).long()).float().mean())


@torch.no_grad()
def evaluate(
    model: nn.Module, bundle: MonaiBundle, data: Any, *, device: torch.device | None = None
) -> dict[str, float]:
    """Loss and score of ``model`` on ``data`` (a dataset of held-out items, one at a time,
    through the bundle's ``validate#inferer``)."""
    from monai.data import DataLoader

    device = device or torch.device("cpu")
    model.to(device).eval()
    inferer, loss_fn, task = bundle.inferer("validate"), bundle.loss(), bundle.task
    total, n, correct = 0.0, 0, 0.0
    sums: np.ndarray | None = None
    for x, y in batches(DataLoader(data, batch_size=1, num_workers=0)):
        x, y = x.to(device), y.to(device)
        out = inferer(x, model)
        total += float(loss_fn(out, y if task == "segmentation" else y.view(-1).long()))
        if task == "segmentation":
            s = class_dice(out, y, out.shape[1])
            sums = s if sums is None else sums + s
        else:
            correct += float((out.argmax(dim=1) == y.view(-1).long()).sum())
        n += 1
    if n == 0:
        return {"loss": math.nan, "score": math.nan}
    score = dice_score(sums) if sums is not None else correct / n
    return {"loss": total / n, "score": score}


@torch.no_grad()
def statistic(
    model: nn.Module, bundle: MonaiBundle, data: Any, *, device: torch.device | None = None
) -> np.ndarray:
    """Per item of ``data``, the logit-scaled softmax confidence in its true label averaged
    over its voxels (LiRA's statistic), through ``validate#inferer``: ``(len(data),)``."""
    from monai.data import DataLoader

    from fedasync.erasure_metrics import logit_scale, true_label_confidence

    device = device or torch.device("cpu")
    was_training = model.training
    model.to(device).eval()
    inferer, out_all = bundle.inferer("validate"), []
    for x, y in batches(DataLoader(data, batch_size=1, num_workers=0)):
        logits = inferer(x.to(device), model).float().cpu()
        out_all.append(logit_scale(true_label_confidence(logits, label_map(y).numpy())))
    model.train(was_training)
    return np.concatenate(out_all) if out_all else np.zeros(0)
