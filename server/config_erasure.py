"""The config's erasure sections: ``unlearning`` and ``erasures``.

Part of the one reference of every ``fedasync simulate`` key (server/config.py, whose module
docstring says how sections are written: each field documented under it, each section checking
its own keys in ``__post_init__``, choices as ``Literal`` types that omegaconf sees as a
``str`` carrying its Literal). ``FedAsyncConfig`` holds these sections and checks what needs the
whole config (which silos exist, the data's classes, the keys of different sections that must
agree); every numeric key's range is in server/config_ranges.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from fedasync.ranges import check, check_ranges, choices
from fedasync.unlearning import SHARE_RULES
from server.config_ranges import RANGES

ErasureMethod = Literal["pga", "relabel"]
"""``unlearning.method``."""
SERVICE_ADDRESS = "127.0.0.1:50151"
"""The erasure service's usual address (this machine only): what ``unlearning.service=true``
listened on by default before ``unlearning.address`` said both."""

ErasureStop = Literal["fixed", "membership"]
"""``unlearning.stop``."""
RemovalPart = Literal["total", "unique"]
"""``lab.erasure.server_removal_part``."""
RadiusScaling = Literal["linear", "sqrt", "none"]
"""``lab.erasure.radius_scaling``: fedasync.unlearning.SHARE_RULES (checked equal at import)."""
SignatureDtype = Literal["float32", "float16"]
"""``lab.erasure.signature_dtype``."""
PreBoundary = Literal["project", "drop"]
"""``lab.erasure.pre_boundary``."""
CalibrationTarget = Literal["reply", "applied"]
"""``lab.erasure.calibration_target``."""
Protect = Literal["subspace", "jump", "both", "gradient", "onesided"]
"""``lab.erasure.protect``."""


ERASURE_METHODS: tuple[str, ...] = choices(ErasureMethod)
ERASURE_STOPS: tuple[str, ...] = choices(ErasureStop)
REMOVAL_PARTS: tuple[str, ...] = choices(RemovalPart)
SIGNATURE_DTYPES: tuple[str, ...] = choices(SignatureDtype)
PRE_BOUNDARIES: tuple[str, ...] = choices(PreBoundary)
CALIBRATION_TARGETS: tuple[str, ...] = choices(CalibrationTarget)
PROTECTS: tuple[str, ...] = choices(Protect)

if choices(RadiusScaling) != tuple(SHARE_RULES):  # not an assert: kept under python -O
    raise AssertionError(f"RadiusScaling {choices(RadiusScaling)} != SHARE_RULES {SHARE_RULES}")

if not TYPE_CHECKING:  # what omegaconf sees: a str carrying its Literal (server/config.py)
    ErasureMethod, ErasureStop, RadiusScaling, SignatureDtype, PreBoundary = (
        Annotated[str, t]
        for t in (ErasureMethod, ErasureStop, RadiusScaling, SignatureDtype, PreBoundary)
    )
    CalibrationTarget, Protect, RemovalPart = (
        Annotated[str, t] for t in (CalibrationTarget, Protect, RemovalPart)
    )


@dataclass
class ErasureRequestConfig:
    """An erasure scheduled in a simulation (live ones come through the erasure service); an
    entry of ``erasures``: FedAsyncConfig checks it, naming its index."""

    silo: int = 0
    """Whose data is erased."""
    at_s: float = 0.0
    """Virtual second at which it is submitted."""
    fraction: float = 1.0
    """1.0: the whole silo; less: a seeded fraction of its samples (a sample-level erasure)."""


@dataclass
class UnlearningConfig:
    """Asynchronous erasure with invariance calibration (AFU-IC style; see docs/erasure.md)."""

    method: ErasureMethod = "pga"
    """Silo-side erasure: pga (projected gradient ascent, Halimi et al. 2022) or relabel."""
    steps: int = 5
    """Local erasure steps (with ``stop=membership``: the most the silo may take)."""
    lr: float = 0.01
    """Local erasure learning rate."""
    stop: ErasureStop = "membership"
    """PGA: when the silo stops (relabelling takes its ``steps``). Default ``membership``: with
    the server's ``unique`` removal it was the one setting verified on every seed of the three
    benchmarks, whole-silo, never over-erasing (docs/measured.md). ``fixed``: after ``steps``.
    ``membership``: as soon as its forget
    samples cannot be told apart from its own held-out samples (a two-sided Mann–Whitney test
    on the true-label confidence at significance 0.05, protocol.config.STOP_ALPHA; past an overshoot it returns
    to its reading closest to indistinguishable), at most ``steps`` (docs/erasure.md)."""
    address: str | None = None
    """Run the erasure gRPC service during the run (live requests), listening here
    (``host:port``; port 0: any free port, written to the run folder's ``erasure_address``;
    ``SERVICE_ADDRESS``, ``127.0.0.1:50151``, is the usual one). None: no service. One key for
    what were two, ``unlearning.service`` (true/false) and ``unlearning.address`` (where it
    listened when on): an address that is not used said nothing, and both are still read
    (server/config_migrate.py: ``service=true`` without an address is ``SERVICE_ADDRESS``)."""
    credentials: str | None = None
    """Credentials file (fedasync erase credentials); None: generated in the run folder."""
    tls_certfile: str | None = None
    """PEM certificate the erasure service serves TLS with (None: insecure, for simulation on
    one machine); ``fedasync deploy local`` gives it the SuperLink's."""
    tls_keyfile: str | None = None
    """Its private key (PEM)."""

    @property
    def service(self) -> bool:
        """Whether the erasure service runs (``unlearning.address`` is set)."""
        return self.address is not None

    def __post_init__(self) -> None:
        """Checked when built: ranges, the choices, the address and the TLS files' pairing."""
        check_ranges(self, "unlearning.", RANGES)
        check(self.method in ERASURE_METHODS, "unlearning.method must be pga or relabel")
        check(self.stop in ERASURE_STOPS, "unlearning.stop must be fixed or membership")
        address = self.address
        check(
            address is None
            or (
                0 < len(address) <= 300 and ":" in address and not any(c.isspace() for c in address)
            ),
            f"unlearning.address={str(address)[:60]!r}: host:port (e.g. {SERVICE_ADDRESS}), or "
            "null for no erasure service",
        )
        check(
            (self.tls_certfile is None) == (self.tls_keyfile is None),
            "unlearning.tls_certfile and unlearning.tls_keyfile go together",
        )
