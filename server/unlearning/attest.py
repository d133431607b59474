"""What the erasure store keeps of an erasure for its certificate (server/erasure/certificate.py).

The audit rows carry the request's states and the verification metrics; these are the
*facts* beside them (named strings, ``ErasureStore.transition``'s ``facts``), recorded when
they happen so that a certificate can be regenerated from the store alone, long after the
model has moved on: how the erasure was carried out (``erasing``), the global model's version
and SHA-256 just before the boundary and at it, and the calibration in force from it
(``calibrating``), and the model's SHA-256 when it was verified (``verified``).

Hashing a model is one pass over its bytes (about 0.1 s for 30 MB), twice per erasure and once
per verification: erasures are rare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedasync import Params
from fedasync.checkpoint import state_digest

if TYPE_CHECKING:
    from server.config import UnlearningConfig
    from server.config_lab import ErasureLab


def model_sha256(params: Params) -> str:
    """Hex SHA-256 of a global model: its named tensors sorted by name, each fed as name,
    dtype, shape and bytes (``fedasync.checkpoint.state_digest``). The same for a model loaded
    from a checkpoint (``server.checkpoint.load_state(path).params``)."""
    return state_digest({name: params[name] for name in sorted(params)})


def erasing_facts(cfg: UnlearningConfig, federaser: bool) -> dict[str, str]:
    """The audit row of ``erasing``: how the erasure is carried out."""
    if federaser:
        return {"erasure_method": "federaser"}
    return {"erasure_method": cfg.method, "erasure_stop": cfg.stop}


def boundary_facts(
    cfg: UnlearningConfig, lab: ErasureLab, before: tuple[int, str], params: Params
) -> dict[str, str]:
    """The audit row of ``calibrating``: the model's version and SHA-256 just before the
    boundary (``before``) and at it (``params``, the model in force), and the calibration in
    force from it (the keys that decide what it protects, ``lab.erasure.*``, and when it is
    verified, ``lab.erasure.relearn_versions``)."""
    return {
        "model_before_version": str(before[0]),
        "model_before_sha256": before[1],
        "model_sha256": model_sha256(params),
        "calibration_protect": lab.protect,
        "calibration_target": lab.calibration_target,
        "calibration_pre_boundary": lab.pre_boundary,
        "relearn_versions": str(lab.relearn_versions),
    }


def verified_facts(params: Params) -> dict[str, str]:
    """The audit row of ``verified``: the SHA-256 of the model the verification measured."""
    return {"model_sha256": model_sha256(params)}
