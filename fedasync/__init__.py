"""fedasync core: the arithmetic that makes stale updates safe to use.

Pure torch/numpy/stdlib (never flwr, monai, grpc). Generic over ``Params`` (a dict of named
tensors), so the same pieces serve federated silos, async RL actors and pipeline stages.
Papers per module: FedAsync (Xie et al. 2019, arXiv:1903.03934) in ``staleness`` and
``aggregators``; FedBuff (Nguyen et al. 2022) in ``aggregators``; FedAdam (Reddi et al. 2021)
in ``optim``; DC-ASGD (Zheng et al. 2017) and error feedback (Seide et al. 2014; Karimireddy
et al. 2019) in ``corrections``; PPO/IMPALA ratios in ``importance``; Halimi et al. 2022,
FedEraser (Liu et al. 2021) and AFU-IC (Cai & Zhang 2026) in ``unlearning``.
"""

from fedasync.aggregators import (
    Aggregator,
    FedAsyncAggregator,
    FedBuffAggregator,
    FoldResult,
    fedavg,
)
from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.contributions import MomentShares, applied_change
from fedasync.corrections import (
    DelayErrorFeedback,
    ErrorFeedback,
    delay_compensate,
    delay_compensate_delta,
    identity,
    topk,
)
from fedasync.importance import (
    clipped_surrogate,
    decoupled_ppo_loss,
    effective_sample_size,
    importance_ratio,
    masked_mean,
    staleness_aware_weight,
    token_staleness,
    truncated_importance_weight,
)
from fedasync.optim import OPTIMIZER_KINDS, OptimizerKind, ServerOptimizer
from fedasync.privacy import GaussianMechanism, gaussian_epsilon
from fedasync.staleness import (
    WEIGHT_FUNCTIONS,
    BoundDecision,
    StalenessBound,
    WeightFn,
    WeightFnName,
    constant,
    exponential,
    hinge,
    make_weight_fn,
    polynomial,
)
from fedasync.types import Params, Update
from fedasync.unlearning import (
    ContributionLedger,
    ErasureJump,
    GradientSignature,
    UpdateHistory,
    federaser_step,
    l2_distance,
    params_to_vector,
    project_to_ball,
    vector_to_params,
)
from fedasync.validation import NormOutlierDetector, Rejection, RejectReason, check_tensors
from fedasync.versions import FutureVersionError, TimedHistory, VersionedSnapshots, staleness

__all__ = [
    "ContributionLedger",
    "ErasureJump",
    "GradientSignature",
    "UpdateHistory",
    "federaser_step",
    "params_to_vector",
    "l2_distance",
    "project_to_ball",
    "vector_to_params",
    "WEIGHT_FUNCTIONS",
    "BoundDecision",
    "DelayErrorFeedback",
    "ErrorFeedback",
    "Aggregator",
    "FedAsyncAggregator",
    "FedBuffAggregator",
    "FoldResult",
    "GaussianMechanism",
    "gaussian_epsilon",
    "FutureVersionError",
    "MomentShares",
    "NormOutlierDetector",
    "Params",
    "RejectReason",
    "Rejection",
    "ServerOptimizer",
    "StalenessBound",
    "Update",
    "TimedHistory",
    "VersionedSnapshots",
    "WeightFn",
    "WeightFnName",
    "OPTIMIZER_KINDS",
    "OptimizerKind",
    "check_tensors",
    "clipped_surrogate",
    "decoupled_ppo_loss",
    "constant",
    "delay_compensate",
    "delay_compensate_delta",
    "effective_sample_size",
    "exponential",
    "applied_change",
    "fedavg",
    "hinge",
    "identity",
    "importance_ratio",
    "load_checkpoint",
    "make_weight_fn",
    "masked_mean",
    "polynomial",
    "save_checkpoint",
    "staleness",
    "staleness_aware_weight",
    "token_staleness",
    "topk",
    "truncated_importance_weight",
]
