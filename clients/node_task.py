"""What a node's messages are about: which silo it is, the data it holds and its task.

The silo is the node's ``partition-id``. Its data comes from its node config: ``datalist``
(deployment: the hospital's own Decathlon datalist, read only here, with the run's benchmark's
shapes; with ``bundle`` too, the hospital's own MONAI bundle on it, ``clients.bundle_silo``),
else its partition of the run's benchmark, split as in simulation (or its share of the run's
``task.bundle``). Caches (the federation, the silo's data, a template of the network, keyed by
what they are built from) live as long as the process: in simulation a Ray actor, in
deployment a warm worker. A node on its own datalist refuses the benchmarks' instruments
(``clients.lab``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import torch
from flwr.app import Context

from clients.bundle_silo import BUNDLE, bundle_silo_task, own_bundle_task
from clients.lab import instruments, refuse_instruments
from clients.task import ArrayTask, SiloTask
from medical_data.federation import Federation, SiloData
from medical_data.networks import build_network
from medical_data.registry import BenchmarkSpec, get_spec
from medical_data.tasks import relearning_data, site_heldout, training_data
from protocol import keys as P
from protocol.config import build_silos, parse_setup


@lru_cache(maxsize=4)
def _federation(setup_json: str) -> Federation:
    setup = parse_setup(setup_json)
    return build_silos(setup.data, setup.num_silos, setup.seed)


@dataclass(frozen=True)
class Silo:
    """What this node works with: its silo id, the run's benchmark spec (task, shapes), the
    data it trains on (with the trigger in backdoor verification runs) and what it evaluates
    on (its datalist's ``validation`` list, else its training data)."""

    id: int
    spec: BenchmarkSpec
    data: SiloData
    heldout: SiloData
    own: bool
    """Its own datalist (deployment), not a partition of the benchmark."""
    validation: SiloData | None = None
    """Its datalist's ``validation`` list (deployment), when there is one: samples no model
    trained on, what the erasure's membership test compares the forget samples with."""


def _silo(context: Context, setup_json: str, *, relearn: bool = False, handler: str = "") -> Silo:
    """This node's silo, from its node config (``partition-id``, ``datalist``). A node on its
    own datalist refuses a setup (or a train request, ``relearn``) that asks for a benchmark
    instrument (``clients.lab``): its data is used as it was read."""
    if "partition-id" not in context.node_config:
        raise ValueError("this SuperNode has no 'partition-id' in its node config")
    silo = int(context.node_config["partition-id"])
    setup = parse_setup(setup_json)
    path = str(context.node_config.get(P.DATALIST, ""))
    if not path:
        fed = _federation(setup_json)
        data = _silo_data(setup_json, silo)
        return Silo(silo, fed.spec, data, data, own=False)
    asked = instruments(setup.backdoor, relearn=relearn, emulate=bool(setup.emulate_speeds))
    refuse_instruments(silo, asked, handler=handler or "message")
    spec = get_spec(setup.data.benchmark)
    try:
        stamp = Path(path).expanduser().stat().st_mtime_ns  # an edited datalist is read again
    except OSError:
        stamp = 0  # (load_datalist says what is missing)
    train, held = _datalist(path, spec.name, stamp)
    return Silo(silo, spec, train, train if held is None else held, own=True, validation=held)


@lru_cache(maxsize=4)
def _datalist(path: str, benchmark: str, stamp: int) -> tuple[SiloData, SiloData | None]:
    """The silo's ``training`` and (when present) ``validation`` lists, read once per
    datalist version (``stamp``: its modification time)."""
    from medical_data.datalist import has_list, load_datalist

    spec = get_spec(benchmark)
    train = load_datalist(path, spec, "training")
    held = load_datalist(path, spec, "validation") if has_list(path, "validation") else None
    return train, held


@lru_cache(maxsize=4)
def _template(name: str, channels: int, classes: int, size: tuple[int, int]) -> torch.nn.Module:
    """The network, built once per shape: a template that is never trained itself."""
    return build_network(name, channels, classes, size)


def _network(setup_json: str, spec: BenchmarkSpec) -> torch.nn.Module:
    """A fresh copy of the run's network, for one message."""
    name = parse_setup(setup_json).data.network or spec.network
    template = _template(name, spec.in_channels, spec.num_classes, tuple(spec.image_size))
    return copy.deepcopy(template)


@lru_cache(maxsize=2)
def _site_heldout(setup_json: str, silo: int) -> SiloData:
    """Silo ``silo``'s share of the test set (``medical_data.tasks.site_heldout``)."""
    setup = parse_setup(setup_json)
    return site_heldout(_federation(setup_json), silo, setup.backdoor, setup.seed)


@lru_cache(maxsize=8)
def _silo_data(setup_json: str, silo: int) -> SiloData:
    setup = parse_setup(setup_json)
    return training_data(_federation(setup_json), silo, setup.backdoor, setup.seed)


def _task(
    context: Context, setup_json: str, *, relearn: bool = False, handler: str = ""
) -> SiloTask:
    """This node's task: a MONAI bundle (the node's own ``bundle`` node config in
    deployment, else the run's ``task.bundle`` in simulation) on its items, or the built-in
    benchmark's silo (:func:`_silo`)."""
    setup = parse_setup(setup_json)
    own_bundle = str(context.node_config.get(BUNDLE, ""))
    if not own_bundle and setup.task.bundle is None:
        here = _silo(context, setup_json, relearn=relearn, handler=handler)
        template = _template(
            setup.data.network or here.spec.network,
            here.spec.in_channels,
            here.spec.num_classes,
            tuple(here.spec.image_size),
        )
        unseen = (
            (lambda: here.validation) if here.own else partial(_site_heldout, setup_json, here.id)
        )
        return ArrayTask(here.spec, here.data, here.heldout, template, unseen)
    if "partition-id" not in context.node_config:
        raise ValueError("this SuperNode has no 'partition-id' in its node config")
    silo = int(context.node_config["partition-id"])
    datalist = str(context.node_config.get(P.DATALIST, ""))
    if datalist or own_bundle:
        asked = instruments(setup.backdoor, relearn=relearn, emulate=bool(setup.emulate_speeds))
        refuse_instruments(silo, asked, handler=handler)
    if relearn:
        raise ValueError("a relearning attack trains on another silo's data: benchmark silos only")
    if own_bundle:
        if not datalist:
            raise ValueError("a node with a bundle needs its 'datalist' in its node config")
        return own_bundle_task(own_bundle, datalist, setup.task.cache, setup.task.workers)
    assert setup.task.bundle is not None
    return bundle_silo_task(setup.task.bundle, setup_json, silo)


@lru_cache(maxsize=2)
def _relearning_data(setup_json: str) -> SiloData:
    """The backdoored silo's poisoned samples a relearning attack trains on (a verification
    run's instrument: ``_task`` refuses it on a node's own data)."""
    setup = parse_setup(setup_json)
    if not setup.backdoor or "silo" not in setup.backdoor:
        raise ValueError("a relearning job in a run whose setup names no backdoored silo")
    return relearning_data(_federation(setup_json), setup.backdoor, setup.seed)
