"""Asynchronous erasure with invariance calibration, carried alongside training.

The design follows AFU-IC (Cai & Zhang 2026; only its abstract is public, so the details
here are ours) and uses Halimi et al. 2022 and FedEraser (Liu et al. 2021) as parts:

1. A request (whole silo, or some of its sample ids) is durable in the erasure store before
   it is acknowledged. While its silo is offline it waits, queued.
2. queued -> erasing: the target silo is sent a ``train.unlearn`` message and stops training;
   everyone else keeps training. The model it starts from is the global model minus the
   silo's recorded contributions (the ledger: a FedEraser-style first-order removal), and it
   runs projected gradient ascent on its forget set within an L2 ball around that model
   (Halimi et al.) or relabelling. It replies with the erasure delta and a low-rank
   *gradient signature* of the forget data: an orthonormal basis of the directions in which
   training on that data would move the model (never the data itself).
3. erasing -> calibrating: the server applies removal + erasure delta to the *current* model
   (other silos moved it meanwhile); that version is the **erasure boundary** B. From then
   on every update is calibrated: projected out of the (merged) signature subspace, so that
   neither other silos' data nor stale work can pull the model back along the erased data's
   directions. Work based before B carries the erased influence: the target silo's own is
   always dropped; the others' is projected (rule ``project``) or dropped (rule ``drop``).
4. calibrating -> verified | unverified after ``relearn_versions`` more versions: the
   verification metrics (forget accuracy, test accuracy, membership-inference AUC, backdoor
   ASR) are measured again on the model that kept training (the relearning check), and every
   check the server has then is read as the certificate reads it (server/erasure/readings.py):
   all within, verified; one not within, unverified.

The parts, each with its own ``state_dict`` (the coordinator's holds the other two's keys
beside its own, so a checkpoint's layout is what it was before the parts were split):

- lifecycle.py: ``ErasureCoordinator``, the request lifecycle above (queued, erasing,
  calibrating, verified, unverified or failed; requeue when a silo goes down), the ledger,
  audit rows and ``erasure`` events; what it needs of the server's parts is handed to it as
  callables;
- calibration.py: ``Calibration``, step 3's state (signature, jumps, forget gradients, the
  boundary, the window of recent updates) and the calibration of every later update;
- rebuild.py: ``FedEraserRebuild``, the halting baseline's rebuild and its update history.

Beside them: requests.py (the ``Erasure`` record; what the coordinator is given of the
server: its model, ``ServedModel``, its silos' jobs, ``SiloJobs``, and the run's values,
``ErasureRun``), no_erasure.py (``NoErasure``, the erasure part of a run that cannot erase),
bounds.py (an erasure's size and the bound on its delta) and resume.py (a request across a
server restart). The arithmetic is the core's (fedasync.unlearning) and the messages are
protocol's.
"""

from collections.abc import Callable

from server.unlearning.calibration import PROTECTS, Calibration, NoCalibration, UpdateCalibration
from server.unlearning.lifecycle import ErasureCoordinator
from server.unlearning.no_erasure import NoErasure
from server.unlearning.rebuild import FedEraserRebuild, Rebuild
from server.unlearning.requests import (
    WENT_DOWN,
    WENT_OFFLINE,
    Erasure,
    ErasureRun,
    ServedModel,
    SiloJobs,
)

ErasureFactory = Callable[[ServedModel, SiloJobs, ErasureRun], ErasureCoordinator]
"""What makes a run's erasure coordinator (``server.erasure_setup.coordinator_for``), given the
model it changes, the silos' jobs and the run's values."""

__all__ = [
    "PROTECTS",
    "WENT_DOWN",
    "WENT_OFFLINE",
    "Calibration",
    "Erasure",
    "ErasureCoordinator",
    "ErasureFactory",
    "ErasureRun",
    "FedEraserRebuild",
    "NoCalibration",
    "NoErasure",
    "Rebuild",
    "ServedModel",
    "SiloJobs",
    "UpdateCalibration",
]
