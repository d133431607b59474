"""Configs written under earlier names, read as today's: every key that moved or became a
constant, so that a run folder's saved ``config.yaml`` still resumes and a benchmark's saved
run still reads back.

`migrated` takes the layers a config is built from (a YAML file, ``key=value`` overrides, a
Flower run config, a dict) and returns each with its old keys under their new names
(``MOVED``). A key that became a constant (``FIXED``) is accepted when it holds the constant's
value and dropped; any other value is a one-line ConfigError naming it. A key given under both
its old and its new name with different values is refused too.
"""

from __future__ import annotations

import importlib
from typing import Any

from fedasync.errors import ConfigError

MOVED: dict[str, str] = {
    "run.target_accuracy": "lab.target_accuracy",
    "server.offline_retry_s": "lab.offline_retry_s",
    "run.compare_sync": "lab.compare_sync",
    "silos.speed_profile": "lab.speed.profile",
    "server.soft_staleness": "lab.soft_staleness",
    "server.soft_factor": "lab.soft_factor",
    **{
        f"server.corrections.{k}": f"lab.corrections.{k}"
        for k in ("delay_compensation", "error_feedback_topk", "residual_budget_mb")
    },
    **{
        f"silos.{k}": f"lab.speed.{k}"
        for k in (
            "straggler_fraction",
            "straggler_slowdown",
            "sigma",
            "step_time_s",
            "latency_s",
            "jitter",
        )
    },
    **{
        f"unlearning.{k}": f"lab.erasure.{k}"
        for k in (
            "server_removal_max_drop",
            "stop_every",
            "signature_rank",
            "signature_batches",
            "signature_dtype",
            "sketch_rank",
            "relearn_versions",
            "radius",
        )
    },
}
"""Old key -> its name today."""

FIXED: dict[str, str] = {
    "server.poll_interval_s": "server.reply_pull:POLL_INTERVAL_S",
    "server.reply_stall_s": "server.reply_pull:REPLY_STALL_S",
    "server.corrections.max_snapshots": "server.dispatch:MAX_SNAPSHOTS",
    "server.norm_outlier_factor": "server.intake:NORM_OUTLIER_FACTOR",
    "server.dp.delta": "server.privacy:CENTRAL_DELTA",
    "engine.client_cpus": "simulations.launcher:CLIENT_CPUS",
    "unlearning.stop_alpha": "protocol.config:STOP_ALPHA",
    "unlearning.stop_probe": "protocol.config:STOP_PROBE",
    "unlearning.max_attempts": "server.unlearning.lifecycle:MAX_ATTEMPTS",
    "client.dp.delta": "protocol.config:DP_DELTA",
    "client.dp.accountant": "protocol.config:DP_ACCOUNTANT",
    "data.test_fraction": "protocol.config:TEST_FRACTION",
}
"""Old key -> the constant (``module:NAME``) it became."""


def constant(key: str) -> Any:
    """The value of the constant the old ``key`` became."""
    module, _, name = FIXED[key].partition(":")
    return getattr(importlib.import_module(module), name)


def _pop(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    """``(True, value)`` removed from the nested ``tree`` at dotted ``key``, else (False, None)."""
    *parents, leaf = key.split(".")
    node: Any = tree
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return False, None
    if leaf not in node:
        return False, None
    value = node.pop(leaf)
    node = tree
    for p in parents:  # an emptied section goes too (its new home may be elsewhere)
        if not node[p]:
            del node[p]
            break
        node = node[p]
    return True, value


def _get(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    node: Any = tree
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return False, None
        node = node[p]
    return True, node


def _put(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {p} must be a section")
    node[leaf] = value


def migrate(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` (a plain nested dict of config keys, changed in place and returned) with every
    old key under today's name; ConfigError for an old key that cannot be read as today's."""
    for old, new in MOVED.items():
        found, value = _pop(tree, old)
        if not found:
            continue
        there, current = _get(tree, new)
        if there and current != value:
            raise ConfigError(f"{old} is now {new}: give it once, as {new}")
        _put(tree, new, value)
    for old in FIXED:
        found, value = _pop(tree, old)
        if not found:
            continue
        fixed = constant(old)
        if value != fixed:
            raise ConfigError(
                f"{old}={str(value)[:40]} is no longer a setting: it is fixed at {fixed} "
                f"({FIXED[old].replace(':', '.')}); remove it"
            )
    return tree


SERVICE_KEYS = ("unlearning.service", "unlearning.address")
"""The two keys that were one setting (the erasure service, and where it listened): today's
``unlearning.address`` alone (None: no service)."""


def merged_service(layers: list[Any]) -> list[Any]:
    """``layers`` (plain dicts, after `migrate`, or omegaconf containers) with
    ``unlearning.service`` read into ``unlearning.address``. Merged over the layers in turn,
    not layer by layer, since one may turn the service on and another say where: a layer that
    gives ``service`` decides whether it runs, at the address given with it, else the one last
    given, else ``SERVICE_ADDRESS``; a layer that gives only an address is today's form (the
    service on there; null: off). One last layer holds the result; without ``service`` in any
    layer the layers are returned as they were."""
    import copy

    from server.config_erasure import SERVICE_ADDRESS

    if not any(_get(_tree(layer), "unlearning.service")[0] for layer in layers):
        return layers
    out: list[Any] = []
    address: Any = None
    last: Any = None  # the address last given, whether or not the service was on
    for layer in layers:
        tree = _tree(layer)
        has_on, on = _get(tree, "unlearning.service")
        has_at, at = _get(tree, "unlearning.address")
        if has_at and at not in (None, ""):
            last = at
        if has_on:
            if not isinstance(on, bool):
                raise ConfigError(
                    f"unlearning.service={str(on)[:40]!r}: true or false (today: "
                    f"unlearning.address={SERVICE_ADDRESS}, or null for no service)"
                )
            address = (last or SERVICE_ADDRESS) if on else None
        elif has_at:
            address = at
        if has_on or has_at:
            tree = copy.deepcopy(tree) if tree is layer else tree
            for key in SERVICE_KEYS:
                _pop(tree, key)
            layer = tree
        out.append(layer)
    return [*out, {"unlearning": {"address": address}}]


def merged_dp(layers: list[Any]) -> list[Any]:
    """``layers`` with ``client.dp.enabled`` read into ``client.dp.noise_multiplier`` and
    ``target_epsilon`` (DP-SGD is on when one is set). Merged over the layers in turn: a layer
    that gives ``enabled`` decides whether DP is on, with the target epsilon given with it or
    before, else the noise multiplier given with it or before, else 1.0 (its default then); off,
    neither is set. A layer without ``enabled`` is today's form. One last layer holds the
    result; without ``enabled`` in any layer the layers are returned as they were."""
    import copy

    key = "client.dp.enabled"
    if not any(_get(_tree(layer), key)[0] for layer in layers):
        return layers
    out: list[Any] = []
    noise: Any = None
    target: Any = None
    said_noise: Any = None  # the numbers last given, whether or not DP was on
    said_target: Any = None
    for layer in layers:
        tree = _tree(layer)
        has_on, on = _get(tree, key)
        has_n, n = _get(tree, "client.dp.noise_multiplier")
        has_t, t = _get(tree, "client.dp.target_epsilon")
        if has_n:
            said_noise = n
        if has_t:
            said_target = t
        if has_on:
            if not isinstance(on, bool):
                raise ConfigError(
                    f"{key}={str(on)[:40]!r}: true or false (today DP-SGD is on when "
                    "client.dp.noise_multiplier or client.dp.target_epsilon is set)"
                )
            if not on:
                noise, target = None, None
            elif said_target is not None:
                noise, target = None, said_target
            else:
                noise, target = (1.0 if said_noise is None else said_noise), None
            tree = copy.deepcopy(tree) if tree is layer else tree
            for k in (key, "client.dp.noise_multiplier", "client.dp.target_epsilon"):
                _pop(tree, k)
            layer = tree
        else:
            noise = n if has_n else noise
            target = t if has_t else target
        out.append(layer)
    return [*out, {"client": {"dp": {"noise_multiplier": noise, "target_epsilon": target}}}]


def _tree(layer: Any) -> Any:
    """A layer as a plain nested dict (an omegaconf container converted, unresolved)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(layer, DictConfig):
        return OmegaConf.to_container(layer, resolve=False)
    return layer


def migrated(*layers: Any) -> list[Any]:
    """``layers`` (plain dicts or omegaconf containers, left as they were), each that holds an
    old key replaced by a plain dict with it under today's name; the others as they were."""
    import copy

    from omegaconf import DictConfig, OmegaConf

    out = []
    for layer in layers:
        tree: Any = layer
        if isinstance(layer, DictConfig):
            tree = OmegaConf.to_container(layer, resolve=False)
        if isinstance(tree, dict) and any(_get(tree, k)[0] for k in (*MOVED, *FIXED)):
            layer = migrate(copy.deepcopy(tree))
        out.append(layer)
    return merged_dp(merged_service(out))
