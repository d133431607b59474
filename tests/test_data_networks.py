"""Forward passes of medical_data.networks give the shapes the benchmarks need."""

import pytest
import torch
from torch import nn

from medical_data.networks import build_network, network_for
from medical_data.registry import BENCHMARKS, get_spec


@pytest.mark.parametrize(
    ("name", "channels", "classes", "size", "out"),
    [
        ("cnn-small", 1, 3, (28, 28), (2, 3)),
        ("cnn-small", 3, 9, (64, 64), (2, 9)),
        ("unet-small", 1, 2, (64, 64), (2, 2, 64, 64)),
        ("unet", 1, 2, (64, 64), (2, 2, 64, 64)),
        ("resnet18", 1, 2, (64, 64), (2, 2)),
        ("densenet121", 1, 2, (64, 64), (2, 2)),
    ],
)
def test_forward_shapes(name: str, channels: int, classes: int, size: tuple, out: tuple) -> None:
    torch.manual_seed(0)
    net = build_network(name, channels, classes, size).eval()
    with torch.no_grad():
        y = net(torch.randn(2, channels, *size))
    assert tuple(y.shape) == out


def test_no_batchnorm_anywhere() -> None:
    for name, size in [
        ("cnn-small", (28, 28)),
        ("unet-small", (64, 64)),
        ("unet", (64, 64)),
        ("resnet18", (64, 64)),
    ]:
        net = build_network(name, 1, 2, size)
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


def test_default_networks_match_specs() -> None:
    assert get_spec("brain-tissue").network == "cnn-small"
    for spec in BENCHMARKS.values():
        net = network_for(spec)
        assert isinstance(net, nn.Module)


def test_bad_network_arguments() -> None:
    with pytest.raises(ValueError, match="unknown network"):
        build_network("vgg", 1, 2, (28, 28))
    with pytest.raises(ValueError, match="divisible by 16"):
        build_network("unet-small", 1, 2, (28, 28))
    with pytest.raises(ValueError, match="unet needs H, W divisible by 16"):
        build_network("unet", 1, 2, (28, 28))
    with pytest.raises(ValueError, match="unknown benchmark.*brain-tissue"):
        get_spec("nope")
