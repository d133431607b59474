"""The lifecycle of an erasure request, defined once for the store, the service and the loop.

    queued -> erasing -> calibrating -> verified | unverified
       \\---------\\-----------\\--------> failed (with a reason)
    erasing -> queued: its silo went down mid-erasure (started again when it returns)

After the relearning window a calibrating request is checked again: ``verified`` when every
check the server has then reads ``within`` (server/erasure/readings.py), ``unverified`` when
one does not (the audit row says which). ``verified``, ``unverified`` and ``failed`` are
terminal. A request waits in ``queued`` while its silo is
offline; the training server moves it on with ``ErasureStore.transition``. A request whose
silo goes down while erasing (crashes, restarts, goes offline, does not answer) goes back to
``queued`` and is started again when the silo returns; nothing of it is in the model yet (it
is applied only on ``erasing -> calibrating``), so starting again applies it once. After a
restart every unfinished request (queued, erasing, calibrating) is resumed from where it
stood.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """States of an erasure request; the values are what the store writes."""

    QUEUED = "queued"
    ERASING = "erasing"
    CALIBRATING = "calibrating"
    VERIFIED = "verified"
    FAILED = "failed"
    UNVERIFIED = "unverified"


class InvalidTransition(ValueError):
    """A state change the lifecycle does not allow (e.g. verified -> erasing)."""


TERMINAL: frozenset[State] = frozenset({State.VERIFIED, State.UNVERIFIED, State.FAILED})
UNFINISHED: frozenset[State] = frozenset({State.QUEUED, State.ERASING, State.CALIBRATING})
CHECKED: frozenset[State] = frozenset({State.VERIFIED, State.UNVERIFIED})
"""The states a request reaches when checked again after its relearning window."""

ALLOWED: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.ERASING, State.FAILED}),
    State.ERASING: frozenset({State.CALIBRATING, State.QUEUED, State.FAILED}),
    State.CALIBRATING: frozenset({State.VERIFIED, State.UNVERIFIED, State.FAILED}),
    State.VERIFIED: frozenset(),
    State.UNVERIFIED: frozenset(),
    State.FAILED: frozenset(),
}


def is_terminal(state: State | str) -> bool:
    """True for ``verified``, ``unverified`` and ``failed``: nothing follows them."""
    return State(state) in TERMINAL


def can_transition(from_state: State | str, to_state: State | str) -> bool:
    """Whether the lifecycle allows ``from_state -> to_state``."""
    return State(to_state) in ALLOWED[State(from_state)]


def check_transition(from_state: State | str, to_state: State | str) -> None:
    """Raise ``InvalidTransition`` unless ``from_state -> to_state`` is allowed."""
    if not can_transition(from_state, to_state):
        raise InvalidTransition(f"erasure request cannot go from {from_state} to {to_state}")


REMOVAL_NOTE = "the server's removal"
"""How the audit note of a whole-silo erasure's removal by the server begins (written when the
removal comes into force, at the request; the certificate's timeline finds it by this)."""

SILO_PART_NOTE = "the silo's own part"
"""How the audit note of a step of the erasing silo's own part begins, when the lab holds that
part to the removal's bound (``lab.erasure.silo_part_bounded``)."""


ENDED_UNCHECKED = "not checked within the run"
"""How the audit note of a request whose run ended inside its relearning window begins (it
stays ``calibrating``; the certificate's gaps quote it)."""
