"""Every numeric config key's allowed values (``RANGES``), checked by each config section.

One table for the whole config (server/config.py and its erasure sections,
server/config_erasure.py), so that a test can check that no numeric key is missing from it.
"""

from __future__ import annotations

from fedasync.ranges import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    UNIT,
    UNIT_OPEN,
    UNIT_OPEN_LOW,
    Range,
)

RANGES: dict[str, Range] = {
    # run
    "run.seed": NON_NEGATIVE,
    "run.budget_s": POSITIVE,
    "run.max_versions": AT_LEAST_ONE,
    "lab.target_accuracy": UNIT,
    # server
    "server.alpha": UNIT_OPEN_LOW,
    "server.buffer_size": AT_LEAST_ONE,
    "server.staleness.a": NON_NEGATIVE,
    "server.staleness.b": NON_NEGATIVE,
    "server.max_staleness": NON_NEGATIVE,
    "lab.soft_staleness": NON_NEGATIVE,
    "lab.soft_factor": UNIT_OPEN_LOW,
    "server.optimizer.lr": POSITIVE,
    "server.optimizer.momentum": Range(0, 1, hi_open=True),
    "lab.corrections.delay_compensation": NON_NEGATIVE,
    "lab.corrections.error_feedback_topk": UNIT_OPEN_LOW,
    "lab.corrections.residual_budget_mb": NON_NEGATIVE,
    "server.clip_norm": POSITIVE,
    "server.dp.noise_multiplier": POSITIVE,
    "server.dp.epsilon_budget": POSITIVE,
    "server.eval_every": AT_LEAST_ONE,
    "server.checkpoint_every": NON_NEGATIVE,
    "server.keep_models": Range(0, 1000),
    "server.wait_for_nodes_s": POSITIVE,
    "server.reply_timeout_s": POSITIVE,
    "lab.offline_retry_s": NON_NEGATIVE,
    # silos
    "silos.count": AT_LEAST_ONE,
    "lab.speed.straggler_fraction": UNIT,
    "lab.speed.straggler_slowdown": AT_LEAST_ONE,
    "lab.speed.sigma": NON_NEGATIVE,
    "lab.speed.step_time_s": POSITIVE,
    "lab.speed.latency_s": NON_NEGATIVE,
    "lab.speed.jitter": Range(0, 1, hi_open=True),
    "lab.exclude[]": NON_NEGATIVE,
    "lab.exclude_samples[].silo": NON_NEGATIVE,
    "lab.exclude_samples[].fraction": UNIT_OPEN,
    # client
    "client.local_steps": AT_LEAST_ONE,
    "client.batch_size": AT_LEAST_ONE,
    "client.lr": POSITIVE,
    "client.momentum": Range(0, 1, hi_open=True),
    "client.weight_decay": NON_NEGATIVE,
    "client.proximal_mu": NON_NEGATIVE,
    "client.num_threads": AT_LEAST_ONE,
    "client.dp.noise_multiplier": POSITIVE,
    "client.dp.target_epsilon": POSITIVE,
    "client.dp.max_grad_norm": POSITIVE,
    "client.dp.epsilon_budget": POSITIVE,
    # task
    "task.cache": NON_NEGATIVE,
    "task.workers": NON_NEGATIVE,
    # data
    "data.dirichlet_alpha": POSITIVE,
    "data.site_shift": NON_NEGATIVE,
    "data.max_samples": AT_LEAST_ONE,
    # engine
    "engine.num_cpus": AT_LEAST_ONE,
    "engine.client_gpus": NON_NEGATIVE,
    # faults, erasures
    "lab.faults[].silo": NON_NEGATIVE,
    "lab.faults[].at_version": NON_NEGATIVE,
    "lab.faults[].down_s": NON_NEGATIVE,
    "erasures[].silo": NON_NEGATIVE,
    "erasures[].at_s": NON_NEGATIVE,
    "erasures[].fraction": UNIT_OPEN_LOW,
    # unlearning
    "unlearning.steps": NON_NEGATIVE,
    "unlearning.lr": POSITIVE,
    "lab.erasure.stop_every": AT_LEAST_ONE,
    "lab.erasure.radius": NON_NEGATIVE,
    "lab.erasure.server_removal_scale": UNIT_OPEN_LOW,
    "lab.erasure.server_removal_max_drop": UNIT,
    "lab.erasure.radius_floor": UNIT_OPEN_LOW,
    "lab.erasure.calibration_strength": UNIT,
    "lab.erasure.signature_rank": AT_LEAST_ONE,
    "lab.erasure.signature_batches": AT_LEAST_ONE,
    "lab.erasure.sketch_rank": AT_LEAST_ONE,
    "lab.erasure.relearn_versions": NON_NEGATIVE,
    "lab.erasure.watch_every": NON_NEGATIVE,
    "lab.erasure.federaser_interval": AT_LEAST_ONE,
    "lab.erasure.federaser_steps_ratio": UNIT_OPEN_LOW,
    # backdoor
    "lab.backdoor.silo": NON_NEGATIVE,
    "lab.backdoor.fraction": UNIT_OPEN_LOW,
    "lab.backdoor.target_label": NON_NEGATIVE,
    "lab.backdoor.trigger_size": AT_LEAST_ONE,
    "lab.backdoor.relearn_silo": NON_NEGATIVE,
    "lab.backdoor.relearn_after_s": NON_NEGATIVE,
    "lab.backdoor.relearn_samples": AT_LEAST_ONE,
}
"""Every numeric key's allowed values (``name[]`` is every entry of a list); None, where a key
allows it, means off. tests/test_config.py checks that no numeric key is missing here."""
