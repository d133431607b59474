"""MONAI networks for the benchmarks, by name.

Every network normalises with GroupNorm (never BatchNorm; mlp-small has no norm layer), so
per-sample gradients (opacus) and small or skewed silo batches behave; activations are not
in-place for the same reason.

| name        | MONAI building block                     | for                       |
|-------------|------------------------------------------|---------------------------|
| cnn-small   | 3 `blocks.Convolution` units + linear    | 28x28 .. 64x64 classif.   |
| densenet121 | `nets.DenseNet121`, spatial_dims=2       | classification, >= 64x64  |
| resnet18    | `nets.resnet18`, spatial_dims=2          | classification, >= 64x64  |
| unet-small  | `nets.BasicUNet` features (8,8,16,32,64,8) | segmentation, 2^4 | H, W |
| unet        | `nets.BasicUNet`, MONAI's default widths (32,32,64,128,256,32), 2.0M parameters (7.9 MB) | segmentation, 2^4 | H, W |
| mlp-small   | `nets.FullyConnectedNet` hidden (64, 32) | tabular features (1 x F)  |
| unet3d-small | `nets.BasicUNet` in 3D, features (8,8,16,32,64,8), sliding window of 24^3 in eval mode | 3D segmentation |

``mlp-small`` flattens its ``(B, C, H, W)`` input (FullyConnectedNet's first layer) to
``C*H*W`` features, two ReLU hidden layers (no norm, no dropout: nothing opacus objects to),
about 4.1k parameters on breast-fna's 30 features.

Seconds per SGD step, batch 32, ``torch.set_num_threads(1)``, this project's 2-core CPU:
cnn-small 28x28 0.018 (64x64 0.062), unet-small 64x64 0.20, densenet121 64x64 0.92,
resnet18 64x64 1.5; mlp-small 1x30 under 0.001. ``unet`` 64x64 at batch 8: 0.22.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from monai.networks.blocks import Convolution
from monai.networks.nets import BasicUNet, DenseNet121, FullyConnectedNet, resnet18
from torch import nn

from medical_data.registry import BenchmarkSpec

NETWORKS = (
    "cnn-small",
    "densenet121",
    "resnet18",
    "unet-small",
    "unet",
    "mlp-small",
    "unet3d-small",
)
PATCH_3D = (24, 24, 24)
"""unet3d-small's sliding window: the training crop of brain-tissue-3d."""
MLP_HIDDEN = (64, 32)
"""``mlp-small``'s hidden layer widths."""


def _group_norm(channels: int, max_groups: int = 8) -> tuple[str, dict[str, int]]:
    groups = max(g for g in range(1, max_groups + 1) if channels % g == 0)
    return ("group", {"num_groups": groups})


CNN_WIDTHS = (16, 32, 64)
"""cnn-small's channel widths, unit by unit."""


class SmallCNN(nn.Module):
    """Conv(16) -> Conv(32, stride 2) -> Conv(64, stride 2) -> global avg pool -> Linear.

    Input ``(B, C, H, W)``, output logits ``(B, num_classes)``; about 25k parameters.
    """

    def __init__(self, in_channels: int, num_classes: int, widths: tuple[int, ...] = CNN_WIDTHS):
        super().__init__()
        self.features = nn.Sequential(
            *(Convolution(**kw) for kw in self.unit_args(in_channels, widths))
        )
        self.head = nn.Linear(widths[-1], num_classes)

    @staticmethod
    def unit_args(in_channels: int, widths: tuple[int, ...] = CNN_WIDTHS) -> list[dict[str, Any]]:
        """The keyword arguments of each ``blocks.Convolution`` unit of ``features``, in order
        (what the unit is built from here and in a MONAI bundle's config, server/bundle.py)."""
        chans = (in_channels, *widths)
        return [
            {
                "spatial_dims": 2,
                "in_channels": chans[i],
                "out_channels": w,
                "strides": 1 if i == 0 else 2,
                "kernel_size": 3,
                "act": ("relu", {"inplace": False}),
                "norm": _group_norm(w),
            }
            for i, w in enumerate(widths)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(b, num_classes)`` for images ``(b, in_channels, H, W)``, average-pooled."""
        return self.head(self.features(x).mean(dim=(2, 3)))


class PatchwiseBasicUNet(BasicUNet):
    """MONAI's ``BasicUNet`` whose forward pass in eval mode on volumes larger than ``roi`` is
    MONAI's sliding-window inference (``roi`` windows, a quarter overlap, Gaussian blending),
    as a bundle's ``SlidingWindowInferer`` runs it; in training mode (random crops of ``roi``)
    the network is called directly. No module of its own: its state dict is ``BasicUNet``'s,
    so its bundle names ``BasicUNet`` and the window in its inferer."""

    def __init__(self, *args: Any, roi: tuple[int, ...] = PATCH_3D, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.roi = tuple(roi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(b, classes, *spatial)`` for volumes ``(b, channels, *spatial)``."""
        if self.training or all(s <= r for s, r in zip(x.shape[2:], self.roi)):
            return super().forward(x)
        from monai.inferers import sliding_window_inference

        out = sliding_window_inference(
            x, self.roi, 4, super().forward, overlap=0.25, mode="gaussian"
        )
        return out  # type: ignore[return-value]


def _no_batchnorm(net: nn.Module) -> nn.Module:
    """Swap BatchNorm for GroupNorm and in-place ReLU for plain ReLU, in place.

    MONAI 1.6 `ResNet` does not pass ``norm`` on to its residual blocks, so they keep
    BatchNorm and in-place ReLU whatever is asked for.
    """
    for parent in list(net.modules()):
        for key, child in parent.named_children():
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                groups = _group_norm(child.num_features)[1]["num_groups"]
                setattr(parent, key, nn.GroupNorm(groups, child.num_features))
            elif isinstance(child, nn.ReLU) and child.inplace:
                setattr(parent, key, nn.ReLU(inplace=False))
    return net


MONAI_CLASSES: dict[str, Callable[..., nn.Module]] = {
    "monai.networks.nets.DenseNet121": DenseNet121,
    "monai.networks.nets.resnet18": resnet18,
    "monai.networks.nets.BasicUNet": BasicUNet,
    "monai.networks.nets.FullyConnectedNet": FullyConnectedNet,
}
"""What each network but cnn-small is an instance of (or, resnet18, made by), by dotted path."""


def monai_recipe(
    name: str, in_channels: int, num_classes: int, image_size: tuple[int, ...]
) -> tuple[str, dict[str, Any]]:
    """The MONAI class or function (its dotted path, a key of MONAI_CLASSES) network ``name``
    is built by, and its keyword arguments; ValueError when the images do not fit it.
    ``resnet18`` has its BatchNorm swapped afterwards (`_no_batchnorm`); ``cnn-small`` is a
    class of this module's (`SmallCNN`), not a recipe; ``unet3d-small`` is ``BasicUNet`` in 3D
    (`PatchwiseBasicUNet` adds its sliding window)."""
    if name == "unet3d-small":
        if len(image_size) != 3:
            raise ValueError(f"unet3d-small needs volumes (D, H, W), got {image_size}")
        return "monai.networks.nets.BasicUNet", {
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": num_classes,
            "features": (8, 8, 16, 32, 64, 8),
            "norm": ("group", {"num_groups": 4}),
            "act": ("LeakyReLU", {"negative_slope": 0.1, "inplace": False}),
        }
    if len(image_size) != 2:
        raise ValueError(f"{name} takes 2D images, got {image_size}: use unet3d-small")
    h, w = image_size
    if name == "densenet121":
        if min(h, w) < 64:
            raise ValueError(f"densenet121 needs images >= 64x64, got {image_size}")
        return "monai.networks.nets.DenseNet121", {
            "spatial_dims": 2,
            "in_channels": in_channels,
            "out_channels": num_classes,
            "norm": ("group", {"num_groups": 8}),
            "act": ("relu", {"inplace": False}),
        }
    if name == "resnet18":
        if min(h, w) < 32:
            raise ValueError(f"resnet18 needs images >= 32x32, got {image_size}")
        return "monai.networks.nets.resnet18", {
            "spatial_dims": 2,
            "n_input_channels": in_channels,
            "num_classes": num_classes,
            "norm": ("group", {"num_groups": 8}),
            "act": ("relu", {"inplace": False}),
        }
    if name in ("unet-small", "unet"):
        if h % 16 or w % 16:
            raise ValueError(f"{name} needs H, W divisible by 16, got {image_size}")
        small = name == "unet-small"
        return "monai.networks.nets.BasicUNet", {
            "spatial_dims": 2,
            "in_channels": in_channels,
            "out_channels": num_classes,
            "features": (8, 8, 16, 32, 64, 8) if small else (32, 32, 64, 128, 256, 32),
            "norm": ("group", {"num_groups": 4 if small else 8}),
            "act": ("LeakyReLU", {"negative_slope": 0.1, "inplace": False}),
        }
    if name == "mlp-small":
        return "monai.networks.nets.FullyConnectedNet", {
            "in_channels": in_channels * h * w,
            "out_channels": num_classes,
            "hidden_channels": MLP_HIDDEN,
            "dropout": None,
            "act": ("relu", {"inplace": False}),
        }
    raise ValueError(f"unknown network {name!r}; choose one of {NETWORKS}")


def build_network(
    name: str, in_channels: int, num_classes: int, image_size: tuple[int, ...]
) -> nn.Module:
    """Build network ``name`` for ``(B, in_channels, *image_size)`` inputs.

    Classifiers return logits ``(B, num_classes)``; ``unet-small`` returns per-pixel logits
    ``(B, num_classes, H, W)`` and needs H and W divisible by 16 (``unet`` too); ``mlp-small`` takes any
    size (it sees ``in_channels * H * W`` features) and classifies only.
    """
    if name == "cnn-small":
        return SmallCNN(in_channels, num_classes)
    target, kwargs = monai_recipe(name, in_channels, num_classes, image_size)
    if name == "unet3d-small":
        return PatchwiseBasicUNet(**kwargs)
    net = MONAI_CLASSES[target](**kwargs)
    return _no_batchnorm(net) if name == "resnet18" else net


def network_for(spec: BenchmarkSpec) -> nn.Module:
    """The default network of a benchmark, sized from its spec."""
    return build_network(spec.network, spec.in_channels, spec.num_classes, spec.image_size)
