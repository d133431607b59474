"""Benchmark registry: what each federated medical-imaging benchmark is.

A `BenchmarkSpec` names the task, modality, tensor shapes and default network of one
benchmark; `medical_data.federation.build_federation` turns a spec into silos. Offline
benchmarks use real images with real labels that ship in PyPI packages (see
`medical_data.offline` for sources and licences); online ones read files a user downloaded
(see `medical_data.online`), and their channel count, classes and size come from the file.
One offline benchmark is tabular (``breast-fna``: features measured on images, each sample a
one-row ``(1, 1, W)`` "image"); see `is_tabular`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedasync.errors import ConfigError

PARTITIONS = ("natural", "dirichlet", "iid")
"""How samples are split into silos: natural groups, Dirichlet label skew, or iid."""


@dataclass(frozen=True)
class BenchmarkSpec:
    """Static description of one benchmark."""

    name: str
    """Registry key, e.g. ``"brain-tissue"``."""
    task: Literal["classification", "segmentation"]
    """Classification: one label per image. Segmentation: one label per pixel."""
    modality: str
    """Imaging modality, e.g. ``"MR T1"``, ``"CT/MR"``, ``"fluorescence microscopy"``."""
    in_channels: int
    """Image channels C of the ``(N, C, H, W)`` arrays."""
    num_classes: int
    """Number of classes (segmentation: including background)."""
    image_size: tuple[int, ...]
    """``(H, W)`` in pixels; ``(D, H, W)`` in voxels for volumes; ``(1, F)`` for a tabular
    benchmark of F features."""
    class_names: tuple[str, ...]
    """One name per class index."""
    network: str
    """Default network name for `medical_data.networks.build_network`."""
    natural_split: str
    """What a natural silo is, e.g. ``"axial slab"`` or ``"patient/organ"``."""
    description: str
    """One paragraph: source, labels, licence."""
    offline: bool = True
    """True when the data ships in an installed or fetched PyPI package."""
    patch: tuple[int, ...] | None = None
    """Volumes: the random crop a training step takes of each sample and the window of the
    sliding-window inference that evaluates whole volumes (None: whole images)."""


BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in (
        BenchmarkSpec(
            name="brain-tissue",
            task="classification",
            modality="MR T1 (MNI152 2009c template)",
            in_channels=1,
            num_classes=3,
            image_size=(28, 28),
            class_names=("csf/other", "grey matter", "white matter"),
            network="cnn-small",
            natural_split="axial slab (contiguous slice range per silo)",
            description=(
                "28x28 patches from axial slices of the ICBM 2009c nonlinear symmetric T1 "
                "template (nilearn wheel, BSD-3 package; template (c) McConnell Brain Imaging "
                "Centre, free use). Label = tissue at the patch centre from the template's "
                "grey/white-matter probability maps, centres inside the brain mask only."
            ),
        ),
        BenchmarkSpec(
            name="brain-tissue-3d",
            task="segmentation",
            modality="MR T1 (MNI152 2009c template), 3D",
            in_channels=1,
            num_classes=4,
            image_size=(40, 40, 40),
            class_names=("outside", "other brain", "grey matter", "white matter"),
            network="unet3d-small",
            natural_split="axial slab (contiguous heights per silo)",
            description=(
                "160 volumes of 40^3 voxels at 2 mm cut at seeded places inside the brain of "
                "the ICBM 2009c nonlinear symmetric T1 template (nilearn wheel, BSD-3 package; "
                "template (c) McConnell Brain Imaging Centre, free use). Labels per voxel: "
                "outside the brain, other brain tissue (CSF and the rest), grey matter, white "
                "matter, the most probable tissue of the template's probability maps. Trained "
                "on random 24^3 crops, evaluated by sliding-window inference (24^3 windows)."
            ),
            patch=(24, 24, 24),
        ),
        BenchmarkSpec(
            name="radiomics-lesion",
            task="segmentation",
            modality="MR (brain, breast) and CT (lung)",
            in_channels=1,
            num_classes=2,
            image_size=(64, 64),
            class_names=("background", "lesion"),
            network="unet-small",
            natural_split="patient/organ/modality (5 patients)",
            description=(
                "All axial slices of the 5 test scans shipped with PyRadiomics "
                "(sdist pyradiomics-bhklab==3.1.4, BSD-3): brain MR x2, breast MR, lung CT x2, "
                "with expert lesion masks; slices padded square and resized to 64x64."
            ),
        ),
        BenchmarkSpec(
            name="radiomics-slice",
            task="classification",
            modality="MR (brain, breast) and CT (lung)",
            in_channels=1,
            num_classes=2,
            image_size=(64, 64),
            class_names=("no lesion", "lesion"),
            network="cnn-small",
            natural_split="patient/organ/modality (5 patients)",
            description="Same slices as radiomics-lesion; label = slice contains lesion.",
        ),
        BenchmarkSpec(
            name="nuclei",
            task="segmentation",
            modality="fluorescence microscopy (DSB2018)",
            in_channels=1,
            num_classes=2,
            image_size=(64, 64),
            class_names=("background", "nucleus"),
            network="unet-small",
            natural_split="spatial region (128x128 block of the slide)",
            description=(
                "Non-overlapping 64x64 tiles of the 512x512 Data Science Bowl 2018 nuclei "
                "image shipped in the stardist==0.9.2 wheel (BSD-3; DSB2018 stage-1 data, "
                "CC0); binary mask from the 125-nucleus instance mask."
            ),
        ),
        BenchmarkSpec(
            name="breast-fna",
            task="classification",
            modality="tabular: 30 nuclear features from digitized fine-needle-aspirate images",
            in_channels=1,
            num_classes=2,
            image_size=(1, 30),
            class_names=("malignant", "benign"),
            network="mlp-small",
            natural_split="iid (the data has no site information: natural = the seeded iid split)",
            description=(
                "Wisconsin Diagnostic Breast Cancer (569 breast masses; scikit-learn wheel, BSD-3; "
                "data UCI, CC BY 4.0): 30 features (mean, standard error and worst value of 10 "
                "nuclear measurements) computed from an image of each fine-needle aspirate; "
                "tabular features derived from images, not images, each sample a (1, 1, 30) "
                "array of z-scores (train-split mean/std). Label = malignant/benign (biopsy); "
                "a fixed stratified 25% (seed 0) is the test split."
            ),
        ),
        BenchmarkSpec(
            name="medmnist",
            task="classification",
            modality="from the file (MedMNIST v2, e.g. PathMNIST)",
            in_channels=3,
            num_classes=9,
            image_size=(28, 28),
            class_names=tuple(f"class {i}" for i in range(9)),
            network="cnn-small",
            natural_split="none (use dirichlet or iid)",
            description=(
                "A MedMNIST .npz a user downloaded (data_dir=path/to/xxxmnist.npz, CC BY 4.0); "
                "channels/classes/size are taken from the file; official test split is the test set."
            ),
            offline=False,
        ),
        BenchmarkSpec(
            name="mednist",
            task="classification",
            modality="mixed (MONAI MedNIST: CT, MR, X-ray)",
            in_channels=1,
            num_classes=6,
            image_size=(64, 64),
            class_names=("AbdomenCT", "BreastMRI", "CXR", "ChestCT", "Hand", "HeadCT"),
            network="cnn-small",
            natural_split="none (use dirichlet or iid)",
            description=(
                "MONAI MedNIST folder a user downloaded (data_dir=folder with one sub-folder "
                "of .jpeg per class); class names are taken from the folders."
            ),
            offline=False,
        ),
        BenchmarkSpec(
            name="decathlon",
            task="segmentation",
            modality="from dataset.json (Medical Segmentation Decathlon)",
            in_channels=1,
            num_classes=2,
            image_size=(64, 64),
            class_names=("background", "foreground"),
            network="unet-small",
            natural_split="patient (case)",
            description=(
                "A Medical Segmentation Decathlon task folder (data_dir=TaskXX_Name, CC BY-SA "
                "4.0): axial slices of imagesTr/labelsTr resized to 64x64."
            ),
            offline=False,
        ),
    )
}


def is_tabular(image_size: tuple[int, ...]) -> bool:
    """True for the one-row ``(1, F)`` "images" of a tabular benchmark (``breast-fna``): a
    vector of F features, where image operations (site shift, trigger square) do not apply."""
    return len(image_size) == 2 and image_size[0] == 1


def get_spec(name: str) -> BenchmarkSpec:
    """Return the spec registered as ``name``; raise ConfigError listing valid names."""
    try:
        return BENCHMARKS[name]
    except KeyError:
        known = ", ".join(sorted(BENCHMARKS))
        raise ConfigError(
            f"unknown benchmark {name!r} (data.benchmark, --benchmark); known benchmarks: {known}"
        ) from None
