"""DDPG pricing agents for the continuous-time market, with a critic-divergence detector.

Papers: DDPG (Lillicrap et al. 2016: deterministic policy gradient, target networks with soft
updates, final layers initialised in ±3e-3); the pricing market of Calvano et al. (AER 2020);
failure mode 2 of "Failure Modes of Deep Multi-Agent RL in Asynchronous Pricing" (arXiv
2606.09884): the critic diverges at high event rates, and such a run is marked corrupted (the
agent raises `CriticDiverged`) rather than averaged in.

Departures from the paper's DDPG:
- Semi-MDP transitions: each transition carries its own discount ``e^{-ρ·elapsed}`` (in
  [0, 1]) and the TD target is ``r + discount · Q'(s', μ'(s'))``.
- Scalar action (the price). States and actions are normalised inside the agent with the
  action range: ``x -> (x - mid) / half_width``, mid and half width of [low, high], so every
  state component must be a price in the same units as the action (the replay buffer stores
  normalised values). Rewards are not rescaled.
- Gaussian exploration noise (not Ornstein-Uhlenbeck), sd ``max(noise_min, noise_sd ·
  exp(-noise_decay · acted))`` in units of the half width, ``acted`` counting exploring acts.
- Learning starts once the buffer holds ``warmup`` transitions; batches are sampled with
  replacement.
- ``target_q_clip`` clamps every TD target to ``[-q_bound/2, q_bound/2]``: a blunt stabiliser
  that keeps the critic's regression target inside the detector's bound. It knows nothing of
  the reward range, so it can also hide a divergence that would otherwise be detected.

Known behaviour: the actor's tanh saturates. An actor that overshoots to an end of the range
can stay there, its gradient vanishing: on a one-state bandit whose best price is a tenth of
the range from an end, 5 of 10 runs ended at the end after 800 updates with actor_lr 1e-3, and
none of 10 after 1500 with 1e-4 (Lillicrap et al.'s actor rate). ``action_reg`` > 0 adds a
penalty on the pre-tanh output to the actor's loss, which keeps it out of saturation.

Each agent owns its randomness: a ``torch.Generator`` (network initialisation) and a numpy
``Generator`` (exploration noise, replay sampling), both seeded from ``seed``; building or
running an agent never touches torch's or numpy's global RNG. Networks are small MLPs and
run on CPU by default (``device``); thread counts are the caller's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn

from fedasync.ranges import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    UNIT_OPEN_LOW,
    Range,
    check,
    check_ranges,
)
from trainers.market.config import AgentSection

FINAL_INIT = 3e-3
"""Final layers' weights and biases are drawn from ``U(-FINAL_INIT, FINAL_INIT)``."""


@dataclass(frozen=True)
class DDPGSettings:
    """One DDPG agent's hyper-parameters (every firm's agent gets the same).

    No defaults of its own: the values, and their defaults, come from the market config's
    ``agent`` section (:class:`trainers.market.config.AgentSection`, see :meth:`from_section`).
    Errors name the keys as that section does (``agent.tau``).
    """

    hidden: int
    """Width of each hidden layer of the actor and the critic."""
    layers: int
    """Hidden layers (ReLU) of the actor and the critic."""
    actor_lr: float
    """Adam learning rate of the actor."""
    critic_lr: float
    """Adam learning rate of the critic."""
    batch_size: int
    """Transitions per update, sampled with replacement."""
    buffer_size: int
    """Replay capacity in transitions; the oldest is overwritten."""
    tau: float
    """Soft target update: target <- tau·online + (1 - tau)·target after each update."""
    warmup: int
    """Transitions in the buffer before learning starts."""
    noise_sd: float
    """Initial sd of the Gaussian exploration noise, as a fraction of the range's half width."""
    noise_min: float
    """Floor of the noise sd (same units as ``noise_sd``)."""
    noise_decay: float
    """Noise sd = max(noise_min, noise_sd·exp(-noise_decay·acted)), acted = exploring acts."""
    critic_grad_clip: float
    """Clip of the critic's gradient norm per update; 0: off. Under Adam this damps a spike
    against the running second moment; it does not bound the step to lr·clip."""
    target_q_clip: bool
    """Clamp TD targets to ±q_bound/2 (module docstring: it can hide a divergence)."""
    action_reg: float
    """Weight of a penalty on the actor's pre-tanh output squared (mean over the batch),
    added to the actor's loss: keeps the tanh out of saturation, where an actor that
    overshot to an end of the range would stay (module docstring); 0: off."""
    q_bound: float
    """Divergence: any |Q| of an update's batch above this."""
    loss_bound: float
    """Divergence: a critic loss above this."""

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "batch_size", "buffer_size", "warmup"):
            value = getattr(self, name)
            check(
                isinstance(value, int) and not isinstance(value, bool),
                f"agent.{name} must be an integer, got {value!r}",
            )
        check_ranges(self, "agent.", RANGES)
        check(
            self.noise_min <= self.noise_sd,
            f"agent.noise_min ({self.noise_min}) must be <= agent.noise_sd ({self.noise_sd})",
        )
        check(
            self.batch_size <= self.buffer_size,
            f"agent.batch_size ({self.batch_size}) must be <= agent.buffer_size ({self.buffer_size})",
        )

    @classmethod
    def from_section(cls, agent: AgentSection | None = None, **changes: Any) -> DDPGSettings:
        """The settings of the market config's ``agent`` section (its defaults when ``None``):
        every key of it that DDPGSettings has (all but ``updates_per_revision``, the run's),
        with ``changes`` (field name: value) on top."""
        section = AgentSection() if agent is None else agent
        values = {f.name: getattr(section, f.name) for f in fields(cls)}
        return cls(**(values | changes))


RANGES: dict[str, Range] = {
    "agent.hidden": AT_LEAST_ONE,
    "agent.layers": AT_LEAST_ONE,
    "agent.actor_lr": POSITIVE,
    "agent.critic_lr": POSITIVE,
    "agent.batch_size": AT_LEAST_ONE,
    "agent.buffer_size": AT_LEAST_ONE,
    "agent.tau": UNIT_OPEN_LOW,
    "agent.warmup": NON_NEGATIVE,
    "agent.noise_sd": NON_NEGATIVE,
    "agent.noise_min": NON_NEGATIVE,
    "agent.noise_decay": NON_NEGATIVE,
    "agent.critic_grad_clip": NON_NEGATIVE,
    "agent.action_reg": NON_NEGATIVE,
    "agent.q_bound": POSITIVE,
    "agent.loss_bound": POSITIVE,
}
"""Allowed values of DDPGSettings' numeric fields (ConfigError, a ValueError, outside)."""


class ReplayBuffer:
    """A fixed-capacity ring of semi-MDP transitions in preallocated float32 numpy arrays.

    ``discount`` is the transition's own factor ``e^{-ρ·elapsed}`` in [0, 1]; once ``capacity``
    transitions are stored each ``add`` overwrites the oldest.
    """

    def __init__(self, capacity: int, state_dim: int, action_dim: int = 1):
        if capacity < 1 or state_dim < 1 or action_dim < 1:
            raise ValueError(
                f"capacity, state_dim and action_dim must be >= 1, got "
                f"{capacity}, {state_dim}, {action_dim}"
            )
        self.capacity = capacity
        self.state = np.zeros((capacity, state_dim), np.float32)
        self.action = np.zeros((capacity, action_dim), np.float32)
        self.reward = np.zeros(capacity, np.float32)
        self.discount = np.zeros(capacity, np.float32)
        self.next_state = np.zeros((capacity, state_dim), np.float32)
        self._next = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(
        self,
        state: np.ndarray,
        action: np.ndarray | float,
        reward: float,
        discount: float,
        next_state: np.ndarray,
    ) -> None:
        """Store one transition (``state``/``next_state`` shape ``(state_dim,)``, ``action``
        shape ``(action_dim,)`` or a float), overwriting the oldest when full."""
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount!r}")
        i = self._next
        self.state[i] = state
        self.action[i] = action
        self.reward[i] = reward
        self.discount[i] = discount
        self.next_state[i] = next_state
        self._next = (i + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def state_dict(self) -> dict[str, Any]:
        """The stored transitions (as tensors) and the ring's position."""
        n = self._size
        return {
            "capacity": self.capacity,
            "next": self._next,
            "size": n,
            **{
                k: torch.from_numpy(getattr(self, k)[:n].copy())
                for k in ("state", "action", "reward", "discount", "next_state")
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` gave (the same capacity and shapes)."""
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"state is of capacity {state['capacity']}, not {self.capacity}")
        n = int(state["size"])
        for k in ("state", "action", "reward", "discount", "next_state"):
            getattr(self, k)[:n] = state[k].numpy()
        self._next, self._size = int(state["next"]), n

    def sample(self, batch_size: int, generator: np.random.Generator) -> dict[str, torch.Tensor]:
        """``batch_size`` stored transitions drawn uniformly with replacement: ``state`` and
        ``next_state`` shape ``(b, state_dim)``, ``action`` ``(b, action_dim)``, ``reward`` and
        ``discount`` ``(b,)``, float32 CPU tensors."""
        if self._size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        idx = generator.integers(0, self._size, size=batch_size)
        return {
            "state": torch.from_numpy(self.state[idx]),
            "action": torch.from_numpy(self.action[idx]),
            "reward": torch.from_numpy(self.reward[idx]),
            "discount": torch.from_numpy(self.discount[idx]),
            "next_state": torch.from_numpy(self.next_state[idx]),
        }


class CriticDiverged(Exception):
    """The critic diverged at update ``step``: the run is corrupted and must not be averaged."""

    def __init__(self, reason: str, step: int):
        super().__init__(f"critic diverged at update {step}: {reason}")
        self.reason = reason
        self.step = step


class DivergenceDetector:
    """Failure mode 2's detector: a non-finite or too large critic loss or Q value."""

    def __init__(self, q_bound: float = 1e4, loss_bound: float = 1e8):
        self.q_bound = q_bound
        self.loss_bound = loss_bound

    def check(self, critic_loss: float, q_values: torch.Tensor, step: int) -> None:
        """Raise CriticDiverged(reason, ``step``) when ``critic_loss`` is NaN/inf or above
        ``loss_bound``, or any of ``q_values`` (any shape) is non-finite or above ``q_bound``
        in absolute value; ``reason`` names the check and the value."""
        if not math.isfinite(critic_loss):
            raise CriticDiverged(f"critic loss {critic_loss}", step)
        if critic_loss > self.loss_bound:
            raise CriticDiverged(
                f"critic loss {critic_loss:.3g} > loss_bound {self.loss_bound:.3g}", step
            )
        q = q_values.detach()
        if not bool(torch.isfinite(q).all()):
            bad = q[~torch.isfinite(q)].flatten()[0]
            raise CriticDiverged(f"Q non-finite ({float(bad)})", step)
        q_abs = float(q.abs().max()) if q.numel() else 0.0
        if q_abs > self.q_bound:
            raise CriticDiverged(f"|Q| {q_abs:.3g} > q_bound {self.q_bound:.3g}", step)


def mlp(
    in_dim: int, hidden: int, layers: int, out_dim: int, generator: torch.Generator
) -> nn.Sequential:
    """``layers`` ReLU hidden layers of width ``hidden``, initialised from ``generator`` only:
    hidden layers as ``nn.Linear``'s default (U(±1/√fan_in)), the last in U(±FINAL_INIT)."""
    dims = [in_dim] + [hidden] * layers
    mods: list[nn.Module] = []
    for i, o in zip(dims[:-1], dims[1:], strict=True):
        mods += [nn.Linear(i, o, device="meta"), nn.ReLU()]
    mods.append(nn.Linear(dims[-1], out_dim, device="meta"))
    net = nn.Sequential(*mods).to_empty(device="cpu")
    linears = [m for m in net if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for k, lin in enumerate(linears):
            bound = FINAL_INIT if k == len(linears) - 1 else 1.0 / math.sqrt(lin.in_features)
            lin.weight.uniform_(-bound, bound, generator=generator)
            lin.bias.uniform_(-bound, bound, generator=generator)
    return net


def soft_update(target: list[torch.Tensor], online: list[torch.Tensor], tau: float) -> None:
    """target <- tau·online + (1 - tau)·target for each pair of tensors, in place."""
    with torch.no_grad():
        torch._foreach_lerp_(target, online, tau)


class DDPGAgent:
    """One firm's DDPG agent: a deterministic pricing policy with its critic and targets.

    The actor maps a normalised state, shape ``(b, state_dim)``, to a normalised action in
    [-1, 1] (tanh), shape ``(b, 1)``; the critic maps the concatenated normalised state and
    action, shape ``(b, state_dim + 1)``, to Q, shape ``(b, 1)``.
    """

    def __init__(
        self,
        state_dim: int,
        action_low: float,
        action_high: float,
        settings: DDPGSettings,
        seed: int,
        device: str = "cpu",
    ):
        if state_dim < 1:
            raise ValueError(f"state_dim must be >= 1, got {state_dim}")
        if not (math.isfinite(action_low) and math.isfinite(action_high)) or not (
            action_low < action_high
        ):
            raise ValueError(
                f"action range must be finite with low < high, got [{action_low}, {action_high}]"
            )
        self.state_dim = state_dim
        self.action_low = float(action_low)
        self.action_high = float(action_high)
        self.mid = (self.action_low + self.action_high) / 2
        self.half_width = (self.action_high - self.action_low) / 2
        self.settings = s = settings
        self.device = torch.device(device)
        self.torch_gen = torch.Generator(device="cpu").manual_seed(seed)
        self.rng = np.random.default_rng(seed)

        self.actor = mlp(state_dim, s.hidden, s.layers, 1, self.torch_gen).to(self.device)
        self.critic = mlp(state_dim + 1, s.hidden, s.layers, 1, self.torch_gen).to(self.device)
        self.actor_target = copy.deepcopy(self.actor).requires_grad_(False)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self._params = {
            name: list(getattr(self, name).parameters())
            for name in ("actor", "critic", "actor_target", "critic_target")
        }
        self.actor_opt = torch.optim.Adam(self._params["actor"], lr=s.actor_lr, foreach=True)
        self.critic_opt = torch.optim.Adam(self._params["critic"], lr=s.critic_lr, foreach=True)
        self.buffer = ReplayBuffer(s.buffer_size, state_dim)
        self.detector = DivergenceDetector(s.q_bound, s.loss_bound)
        self.steps = 0
        """Updates done."""
        self.acted = 0
        """Exploring acts so far (they drive the noise decay)."""
        self.frozen = False

    def normalise(self, x: np.ndarray | float) -> np.ndarray:
        """Prices (states or actions, any shape) mapped to about [-1, 1]: (x - mid) / half."""
        return (np.asarray(x, dtype=np.float64) - self.mid) / self.half_width

    @property
    def noise_sd(self) -> float:
        """The current exploration noise sd, as a fraction of the half width (0 once frozen)."""
        if self.frozen:
            return 0.0
        s = self.settings
        return max(s.noise_min, s.noise_sd * math.exp(-s.noise_decay * self.acted))

    def act(self, state: np.ndarray, explore: bool) -> float:
        """The price for ``state`` (shape ``(state_dim,)``, prices): the actor's, plus Gaussian
        noise of sd ``noise_sd``·half width when ``explore`` (and not frozen), clipped to
        [low, high]. Each exploring act counts towards the noise decay."""
        x = torch.as_tensor(self.normalise(state), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            a = float(self.actor(x[None])[0, 0].tanh())
        if explore and not self.frozen:
            a += self.noise_sd * float(self.rng.standard_normal())
            self.acted += 1
        price = self.mid + self.half_width * a
        return min(max(price, self.action_low), self.action_high)

    def remember(
        self,
        state: np.ndarray,
        action: float,
        reward: float,
        discount: float,
        next_state: np.ndarray,
    ) -> None:
        """Store a transition (prices in action units; ``discount`` = e^{-ρ·elapsed}); once
        frozen, nothing is stored."""
        if self.frozen:
            return
        self.buffer.add(
            self.normalise(state),
            self.normalise(action),
            reward,
            discount,
            self.normalise(next_state),
        )

    def _policy(self, net: nn.Module, state: torch.Tensor) -> torch.Tensor:
        return net(state).tanh()

    def update(self) -> dict[str, float] | None:
        """One critic step on the TD target ``r + discount·Q'(s', μ'(s'))``, one actor step
        (deterministic policy gradient, ascend Q(s, μ(s))), then soft target updates.

        None before warmup or once frozen. Raises CriticDiverged (from the detector, on the
        batch's loss and Q values) before any step is applied, so the networks keep their last
        finite weights. Returns ``critic_loss``, ``actor_loss``, ``q_mean``, ``q_max`` of the
        batch and ``critic_grad_norm`` (before clipping).
        """
        s = self.settings
        if self.frozen or len(self.buffer) < max(s.warmup, 1):
            return None
        b = {k: v.to(self.device) for k, v in self.buffer.sample(s.batch_size, self.rng).items()}
        with torch.no_grad():
            next_a = self._policy(self.actor_target, b["next_state"])
            next_q = self.critic_target(torch.cat([b["next_state"], next_a], 1))[:, 0]
            target = b["reward"] + b["discount"] * next_q
            if s.target_q_clip:
                target = target.clamp(-s.q_bound / 2, s.q_bound / 2)
        q = self.critic(torch.cat([b["state"], b["action"]], 1))[:, 0]
        critic_loss = nn.functional.mse_loss(q, target)
        loss_value = float(critic_loss.detach())
        self.detector.check(loss_value, q.detach(), self.steps)

        self.critic_opt.zero_grad(set_to_none=True)
        critic_loss.backward()
        max_norm = s.critic_grad_clip if s.critic_grad_clip > 0 else math.inf
        grad_norm = nn.utils.clip_grad_norm_(self._params["critic"], max_norm, foreach=True)
        self.critic_opt.step()

        self.critic.requires_grad_(False)
        u = self.actor(b["state"])  # pre-tanh
        actor_loss = -self.critic(torch.cat([b["state"], u.tanh()], 1)).mean()
        if s.action_reg > 0:
            actor_loss = actor_loss + s.action_reg * u.pow(2).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_opt.step()
        self.critic.requires_grad_(True)

        p = self._params
        soft_update(p["critic_target"] + p["actor_target"], p["critic"] + p["actor"], s.tau)
        self.steps += 1
        q_det = q.detach()
        return {
            "critic_loss": loss_value,
            "actor_loss": float(actor_loss.detach()),
            "q_mean": float(q_det.mean()),
            "q_max": float(q_det.max()),
            "critic_grad_norm": float(grad_norm),
        }

    def freeze(self) -> None:
        """No more exploration, storing or updates (post-training diagnostics)."""
        self.frozen = True

    def state_dict(self) -> dict[str, Any]:
        """Networks, targets, optimisers, counters and both generators (not the buffer)."""
        return {
            "action_range": (self.action_low, self.action_high),
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "actor_target": self.actor_target.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "actor_opt": self.actor_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "steps": self.steps,
            "acted": self.acted,
            "frozen": self.frozen,
            "torch_gen": self.torch_gen.get_state(),
            "rng": copy.deepcopy(self.rng.bit_generator.state),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved; the action range must be this agent's."""
        if tuple(state["action_range"]) != (self.action_low, self.action_high):
            raise ValueError(
                f"state is for action range {tuple(state['action_range'])}, "
                f"this agent's is {(self.action_low, self.action_high)}"
            )
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.actor_target.load_state_dict(state["actor_target"])
        self.critic_target.load_state_dict(state["critic_target"])
        # copies: Optimizer.load_state_dict would share the saved state's tensors
        self.actor_opt.load_state_dict(copy.deepcopy(state["actor_opt"]))
        self.critic_opt.load_state_dict(copy.deepcopy(state["critic_opt"]))
        self.steps = int(state["steps"])
        self.acted = int(state["acted"])
        self.frozen = bool(state["frozen"])
        self.torch_gen.set_state(state["torch_gen"])
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])
