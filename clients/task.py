"""The silo's task: what a hospital brings, behind one Protocol that knows no FL framework.

In the spirit of MONAI's ``monai.fl.client.ClientAlgo``, a :class:`SiloTask` builds the
network, trains it N local steps in place from the weights it was given, evaluates it on the
silo's held-out data, lists the silo's sample ids, and gives any of its samples as an erasure
uses them (``clients.unlearn.Samples``: the loss the erasure ascends, the per-sample statistic
of its membership test and of verification). The ClientApp
(clients/app.py) is an adapter: it reads a Flower message, loads the weights into the task's
network, calls the task and answers with the delta; nothing here imports Flower.

Two kinds of task:
- :class:`ArrayTask`: a built-in benchmark's silo, its samples as arrays in memory
  (``medical_data.federation.SiloData``), trained by ``clients.local`` (and, under DP, by
  ``clients.dp``; erased by ``clients.unlearn``);
- :class:`BundleTask`: a MONAI bundle (``medical_data.monai_bundle``) on the silo's items of a
  datalist, streamed from disk through the bundle's transforms, 2D or 3D, evaluated through
  the bundle's inferer (a sliding window for volumes).

Both train on the silo's one loop (``clients.loop.run_steps``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from clients.local import train_local
from clients.loop import FP32, Precision, run_steps
from clients.unlearn import ArraySamples, Samples
from fedasync import seeds
from medical_data import monai_bundle as mb
from medical_data.federation import SiloData
from medical_data.registry import BenchmarkSpec
from medical_data.tasks import evaluate as evaluate_arrays
from medical_data.tasks import select
from protocol.config import ClientConfig

Stop = Callable[[int, int], None]
"""The check before local step ``step`` of ``steps``; raises to end the job."""


class SiloTask(Protocol):
    """A silo's task (see the module docstring). Implementations own their data."""

    spec: BenchmarkSpec
    """Task kind, channels, classes and patch shape, as the server knows them."""

    def network(self) -> nn.Module:
        """A fresh copy of the network (the weights are loaded into it by the caller)."""
        ...

    def sample_ids(self) -> list[str]:
        """The ids of the samples the silo trains on."""
        ...

    def class_counts(self) -> list[int]:
        """Per class, its samples (segmentation: those containing it); [] when unknown."""
        ...

    def train(
        self,
        model: nn.Module,
        *,
        steps: int,
        client: ClientConfig,
        seed: int,
        exclude: Sequence[str],
        device: torch.device,
        stop: Stop | None,
    ) -> dict[str, float]:
        """Train ``model`` ``steps`` local steps in place on the samples not in ``exclude``;
        return ``train_loss``, ``train_score`` and any other metrics."""
        ...

    def evaluate(self, model: nn.Module, *, device: torch.device) -> dict[str, float]:
        """``loss`` and ``score`` of ``model`` on the silo's held-out samples."""
        ...

    def evaluated_samples(self) -> int:
        """How many samples :meth:`evaluate` scores."""
        ...

    def forget_samples(self, ids: Sequence[str]) -> Samples:
        """Samples ``ids`` as an erasure uses them (``clients.unlearn.Samples``: the batches it
        ascends, the loss it ascends, the per-sample membership statistic it tests)."""
        ...

    def heldout_samples(self) -> Samples | None:
        """Samples no model trained on, drawn as the training samples are (the membership
        test's unseen side), as :meth:`forget_samples`; None when the silo has none."""
        ...


@dataclass
class ArrayTask:
    """A built-in benchmark's silo: samples as arrays (``data``, ``heldout``)."""

    spec: BenchmarkSpec
    data: SiloData
    heldout: SiloData
    template: nn.Module
    """The network, never trained itself: every call of :meth:`network` copies it."""
    unseen: Callable[[], SiloData | None] | None = None
    """The silo's samples no model trained on (built when an erasure asks: its share of the
    test set in simulation, its datalist's ``validation`` list in deployment)."""

    def network(self) -> nn.Module:
        """A copy of the template."""
        return copy.deepcopy(self.template)

    def sample_ids(self) -> list[str]:
        """The training samples' ids."""
        return [str(s) for s in self.data.sample_ids.tolist()]

    def class_counts(self) -> list[int]:
        """Per class, its samples (segmentation: those containing it)."""
        from medical_data.datalist import class_counts

        return class_counts(self.data, self.spec.num_classes)

    def train(
        self,
        model: nn.Module,
        *,
        steps: int,
        client: ClientConfig,
        seed: int,
        exclude: Sequence[str],
        device: torch.device,
        stop: Stop | None,
    ) -> dict[str, float]:
        """``clients.local.train_local`` on the samples not excluded (see :class:`SiloTask`)."""
        return train_local(
            model,
            select(self.data, list(exclude)),
            task=self.spec.task,
            steps=steps,
            batch_size=client.batch_size,
            lr=client.lr,
            momentum=client.momentum,
            weight_decay=client.weight_decay,
            proximal_mu=client.proximal_mu,
            seed=seed,
            device=device,
            stop=stop,
            precision=Precision(client.precision),
        )

    def evaluate(self, model: nn.Module, *, device: torch.device) -> dict[str, float]:
        """Loss and score on the held-out samples (see :class:`SiloTask`)."""
        return evaluate_arrays(model, self.heldout, task=self.spec.task, device=device)

    def evaluated_samples(self) -> int:
        """The held-out samples."""
        return len(self.heldout)

    def forget_samples(self, ids: Sequence[str]) -> ArraySamples:
        """Samples ``ids`` (those of them the silo holds) as arrays."""
        return ArraySamples(select(self.data, list(ids), keep=True), self.spec.task)

    def heldout_samples(self) -> ArraySamples | None:
        """The unseen samples (``unseen``) as arrays, or None."""
        held = None if self.unseen is None else self.unseen()
        return None if held is None or len(held) == 0 else ArraySamples(held, self.spec.task)


@dataclass
class BundleTask:
    """A MONAI bundle on one silo's datalist items (``items`` to train on, ``heldout`` to
    evaluate on; without held-out items it evaluates on its training items through the
    bundle's validation transforms). ``cache``: items whose deterministic transforms stay in
    memory; ``workers``: DataLoader worker processes."""

    bundle: mb.MonaiBundle
    items: list[dict[str, Any]]
    heldout: list[dict[str, Any]]
    cache: int = 0
    workers: int = 0
    template: nn.Module | None = None
    _train: Any = field(default=None, repr=False)
    _held: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.bundle.check_train_inferer()
        self.spec = self.bundle.spec()
        if self.template is None:
            self.template = self.bundle.network()

    def network(self) -> nn.Module:
        """A copy of the template."""
        assert self.template is not None
        return copy.deepcopy(self.template)

    def sample_ids(self) -> list[str]:
        """The training samples' ids."""
        return [mb.item_id(i) for i in self.items]

    def class_counts(self) -> list[int]:
        """None known (counting a volume's classes means reading it: not at a roster query)."""
        return []  # (counting a volume's classes means reading it: not at a roster query)

    def training_set(self, exclude: Sequence[str]) -> Any:
        """The MONAI dataset of the items not in ``exclude``, through the training transforms
        (all of them: the one kept, with its cache; else one made for the message)."""
        if not exclude:
            if self._train is None:
                self._train = mb.dataset(self.items, self.bundle.transform("train"), self.cache)
            return self._train
        gone = set(exclude)
        kept = [i for i in self.items if mb.item_id(i) not in gone]
        return mb.dataset(kept, self.bundle.transform("train"), 0)

    def _heldout_set(self) -> Any:
        if self._held is None:
            items = self.heldout or self.items
            self._held = mb.dataset(items, self.bundle.transform("validate"), 0)
        return self._held

    def train(
        self,
        model: nn.Module,
        *,
        steps: int,
        client: ClientConfig,
        seed: int,
        exclude: Sequence[str],
        device: torch.device,
        stop: Stop | None,
    ) -> dict[str, float]:
        """``steps`` steps of the bundle's optimiser (made anew for the message: silos keep
        no optimiser state) on batches of ``train#dataloader#batch_size`` items drawn with
        replacement (seeded), through the bundle's training transforms (their random crops
        seeded too)."""
        from monai.data import DataLoader
        from torch.utils.data import RandomSampler

        data = self.training_set(exclude)
        if len(data) == 0:
            raise ValueError("no training data: every sample of this silo is excluded")
        size = self.bundle.batch_size()
        draws = torch.Generator().manual_seed(seed)
        sampler = RandomSampler(data, replacement=True, num_samples=steps * size, generator=draws)
        loader = DataLoader(  # (MONAI seeds the transforms' random states from ``generator``)
            data,
            batch_size=size,
            sampler=sampler,
            num_workers=self.workers,
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(seeds.torch_seed(seed, "bundle.transforms")),
        )
        model.to(device).train()
        opt = self.bundle.optimizer(model.parameters())
        loss_fn, task = self.bundle.loss(), self.spec.task
        totals = run_steps(
            model,
            mb.batches(loader),
            lambda out, y: loss_fn(out, y),
            lambda step: opt.step(),
            zero_grad=lambda: opt.zero_grad(set_to_none=True),
            steps=steps,
            device=device,
            before=None if stop is None else lambda step: stop(step, steps),
            score=lambda out, y: mb.batch_score(out, y, task),
            precision=Precision(client.precision) if client else FP32,
        )
        n = max(totals.nonempty, 1)
        return {"train_loss": totals.loss / n, "train_score": totals.score / n}

    def evaluate(self, model: nn.Module, *, device: torch.device) -> dict[str, float]:
        """Loss and score on the held-out samples (see :class:`SiloTask`)."""
        return mb.evaluate(model, self.bundle, self._heldout_set(), device=device)

    def evaluated_samples(self) -> int:
        """The held-out items (else the training items)."""
        return len(self.heldout or self.items)

    def forget_samples(self, ids: Sequence[str]) -> BundleSamples:
        """Items ``ids`` (all of them: none named) as an erasure uses them."""
        wanted = set(ids)
        items = [i for i in self.items if not wanted or mb.item_id(i) in wanted]
        return BundleSamples(self.bundle, items)

    def heldout_samples(self) -> BundleSamples | None:
        """The held-out items (the membership test's unseen samples), or None."""
        return BundleSamples(self.bundle, self.heldout) if self.heldout else None


@dataclass
class BundleSamples:
    """Some of a bundle task's items as an erasure uses them (``clients.unlearn.Samples``):
    training batches of ``train#dataloader#batch_size`` through the training transforms (the
    ``batch_size`` an erasure asks for is the federation's, for arrays: a bundle says its
    own), evaluation and the membership statistic through the validation transforms and
    inferer, the signature's fixed batches through the training transforms seeded alike."""

    bundle: mb.MonaiBundle
    items: list[dict[str, Any]]

    def __len__(self) -> int:
        """How many items."""
        return len(self.items)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Loss and score through ``validate#inferer``."""
        data = mb.dataset(self.items, self.bundle.transform("validate"), 0)
        return mb.evaluate(model, self.bundle, data, device=device)

    def draws(
        self, batch_size: int, gen: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless seeded batches of the bundle's size, drawn with replacement."""
        from monai.data import DataLoader
        from torch.utils.data import RandomSampler

        data = mb.dataset(self.items, self.bundle.transform("train"), 0)
        size = self.bundle.batch_size()
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        sampler = RandomSampler(data, replacement=True, num_samples=2**31 - 1, generator=gen)
        loader = DataLoader(
            data,
            batch_size=size,
            sampler=sampler,
            num_workers=0,
            generator=torch.Generator().manual_seed(seed),
        )
        return mb.batches(loader)

    def chunk(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Items ``idx`` through the training transforms, their random parts seeded by the
        items chosen (the same batch every call)."""
        from monai.data import DataLoader

        data = mb.dataset([self.items[i] for i in idx], self.bundle.transform("train"), 0)
        first = int(np.asarray(idx, dtype=np.int64)[0]) if len(idx) else 0
        seed = seeds.torch_seed(first, "bundle.chunk", len(idx))
        loader = DataLoader(
            data, batch_size=len(idx), num_workers=0, generator=torch.Generator().manual_seed(seed)
        )
        return next(iter(mb.batches(loader)))

    def statistic(self, model: nn.Module, idx: np.ndarray, device: torch.device) -> np.ndarray:
        """``medical_data.monai_bundle.statistic`` of items ``idx``."""
        data = mb.dataset([self.items[i] for i in idx], self.bundle.transform("validate"), 0)
        return mb.statistic(model, self.bundle, data, device=device)

    def loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The bundle's loss."""
        loss_fn = self.bundle.loss()
        return lambda out, y: loss_fn(out, y)


def split_items(
    items: list[dict[str, Any]], num_silos: int, partition: str, seed: int
) -> list[list[dict[str, Any]]]:
    """A bundle's datalist split into ``num_silos`` silos: ``natural`` by each item's
    ``site`` (sites in sorted order, dealt to silos in turn; without sites, contiguous blocks
    of the datalist's order), ``iid`` by a seeded shuffle. Raises ValueError (one line) when a
    silo would get nothing."""

    if partition == "natural":
        sites = [i.get("site") for i in items]
        if all(s is not None for s in sites):
            order = sorted(set(map(str, sites)))
            groups: list[list[dict[str, Any]]] = [[] for _ in range(num_silos)]
            for item in items:
                groups[order.index(str(item["site"])) % num_silos].append(item)
        else:
            groups = [list(b) for b in np.array_split(np.array(items, dtype=object), num_silos)]
    elif partition == "iid":
        perm = seeds.rng(seed, "bundle.iid").permutation(len(items))
        shuffled = [items[k] for k in perm]
        groups = [list(b) for b in np.array_split(np.array(shuffled, dtype=object), num_silos)]
    else:
        raise ValueError(
            f"data.partition={partition[:20]}: a bundle's datalist splits natural or iid"
        )
    empty = [k for k, g in enumerate(groups) if not g]
    if empty:
        raise ValueError(
            f"the bundle's datalist has {len(items)} items for {num_silos} silos: silo "
            f"{empty[0]} would have none"
        )
    return groups
