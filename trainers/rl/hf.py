"""A Hugging Face ``transformers`` causal LM as the RL policy (``policy.kind=hf``).

Idea: the trainers users bring their models to (TRL, verl, OpenRLHF, AReaL) take any
``transformers`` causal LM; here one fits behind :class:`HFPolicy`, which gives it the
interface of :class:`trainers.rl.policy.TinyLM` (the ``Policy`` protocol): ``policy(ids)``
returns next-token logits, causally, so that right padding leaves earlier logits unchanged;
``state_dict``/``load_state_dict`` carry a version's weights (to the workers, the Ray object
store, the snapshots and the checkpoint); ``parameters`` are what the learner steps. Sampling,
log-probs, the warm start and the learner are the tiny policy's own code
(:mod:`trainers.rl.policy`), so the RNG discipline (every token drawn on the CPU with the
group's generator) and S = 0 parity with sync hold unchanged.

Token ids: the task's ids (PAD 0, BOS 1, EOS 2, then the characters) are the model's first
``VOCAB_SIZE`` ids, and the logits are cut to them, so the model never samples an id the task
cannot decode; a config built here has exactly that vocabulary unless it asks for more. The
model's own tokenizer is not used.

Departures from ``transformers``' defaults: dropout is always off (the wrapped model stays in
eval mode whatever :meth:`HFPolicy.train` says), because behaviour log-probs must be exact; no
KV cache (``use_cache=False``: the trainer decodes by full forwards, as with TinyLM); the
weights are float32. Nothing is downloaded: a model is built from ``policy.hf_config`` or
loaded from the local directory ``policy.hf_path`` with ``local_files_only=True``.
``transformers`` is imported only here, and only when a policy of this kind is built.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fedasync.errors import ConfigError, UserError
from trainers.rl.tasks import BOS, EOS, PAD, VOCAB_SIZE, Task

if TYPE_CHECKING:
    from trainers.rl.config import PolicySection

log = logging.getLogger("fedasync.rl")

EXPORT_DIR = "hf_policy"
"""The run folder's sub-folder the trained policy is saved to (``save_pretrained``)."""
INSTALL_HINT = "pip install 'fedasync[hf]'"
DEFAULT_MODEL_TYPE = "gpt2"
"""``policy.hf_config``'s architecture when it names no ``model_type``."""
_GENERIC_FIELDS = frozenset({"attn_implementation", "torch_dtype", "dtype", "num_labels"})
"""Config arguments any model type takes that its ``to_dict`` may not show."""


class MissingExtra(UserError, ImportError):
    """``policy.kind=hf`` without ``transformers`` installed (one line, exit 2)."""


def import_transformers() -> Any:
    """The ``transformers`` module; :class:`MissingExtra` saying how to install it if absent."""
    try:
        import transformers
    except ImportError as e:
        raise MissingExtra(
            f"policy.kind=hf needs the transformers package ({type(e).__name__}: "
            f"{str(e)[:100]}); install it with: {INSTALL_HINT}"
        ) from None
    return transformers


@contextlib.contextmanager
def _quiet(tf: Any) -> Iterator[None]:
    """``transformers``' progress bars off while it loads or saves (ours are on stderr)."""
    bars = tf.utils.logging
    was = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            bars.enable_progress_bar()


class HFPolicy(nn.Module):
    """A ``transformers`` causal LM behind the ``Policy`` interface: ids ``(b, t)`` -> logits
    ``(b, t, vocab_size)`` over the task's ``vocab_size`` first ids."""

    def __init__(self, model: nn.Module, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.model = model
        self.vocab_size = vocab_size
        self.train(False)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits ``(b, t, vocab_size)`` for ids ``(b, t)``, causal. The attention mask is all
        ones: rows are right-padded, so a row's real positions never see its padding."""
        mask = torch.ones_like(ids)
        logits: Tensor = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return logits[..., : self.vocab_size]

    def train(self, mode: bool = True) -> HFPolicy:
        """Set ``training`` (the trainer's bookkeeping); the wrapped model stays in eval
        mode, so dropout never acts and sampling and learning see the same function."""
        super().train(mode)
        self.model.train(False)
        return self

    def num_parameters(self) -> int:
        """Trainable parameters, a tied embedding counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def save_pretrained(self, path: str | Path) -> None:
        """The wrapped model's ``save_pretrained`` (config.json and the weights)."""
        tf = import_transformers()
        with _quiet(tf):
            self.model.save_pretrained(str(path))  # type: ignore[operator]


def build_hf_policy(section: PolicySection, task: Task) -> HFPolicy:
    """The ``policy.kind=hf`` policy: built from ``section.hf_config`` (initialised from
    torch's global RNG, seeded by the caller) or loaded from ``section.hf_path``.

    ConfigError (one line, naming the key) when the model type is unknown, a field is not one
    of its config's, the model does not build or load, its vocabulary cannot hold the task's
    ids, or its positions cannot hold the task's longest prompt + answer.
    """
    tf = import_transformers()
    with _quiet(tf):
        if section.hf_config is not None:
            model, where = _from_config(tf, dict(section.hf_config)), "policy.hf_config"
        else:
            assert section.hf_path is not None
            model, where = (
                _from_path(tf, section.hf_path),
                f"policy.hf_path {section.hf_path!r:.200}",
            )
    model = model.float()
    out = model.get_output_embeddings()
    vocab = int(out.weight.shape[0]) if out is not None else getattr(model.config, "vocab_size", 0)
    if vocab < VOCAB_SIZE:
        raise ConfigError(
            f"{where}: the model's vocabulary ({vocab} ids) cannot hold the task's "
            f"{VOCAB_SIZE} (its ids are the model's first {VOCAB_SIZE})"
        )
    need = task.max_prompt_tokens + task.max_new_tokens
    limit = getattr(model.config, "n_positions", None) or getattr(
        model.config, "max_position_embeddings", None
    )
    if isinstance(limit, int) and limit < need:
        raise ConfigError(
            f"{where}: the model's {limit} positions cannot hold task {task.name}'s longest "
            f"prompt + answer ({need} tokens): give it more positions or lower task.max_len"
        )
    policy = HFPolicy(model)
    log.info(
        "policy.kind=hf: %s, %d parameters, vocabulary %d (the task uses the first %d)",
        type(model).__name__,
        policy.num_parameters(),
        vocab,
        VOCAB_SIZE,
    )
    return policy


def _from_config(tf: Any, fields: dict[str, Any]) -> Any:
    """A fresh causal LM of ``fields`` (``model_type`` plus its config's fields)."""
    model_type = str(fields.pop("model_type", DEFAULT_MODEL_TYPE))
    if model_type not in tf.CONFIG_MAPPING:
        raise ConfigError(
            f"policy.hf_config.model_type {model_type!r:.40} is not a model type of "
            f"transformers {tf.__version__} (e.g. gpt2, llama, qwen2)"
        )
    config_cls = tf.CONFIG_MAPPING[model_type]
    try:
        known = set(config_cls().to_dict()) | set(config_cls.attribute_map) | _GENERIC_FIELDS
    except Exception:  # a config that needs arguments to build: leave the fields to it
        known = set(fields)
    for key in fields:
        if key not in known:
            raise ConfigError(
                f"policy.hf_config.{key:.100} is not a field of {config_cls.__name__} "
                f"(model_type {model_type})"
            )
    fields.setdefault("vocab_size", VOCAB_SIZE)
    for key, value in (("pad_token_id", PAD), ("bos_token_id", BOS), ("eos_token_id", EOS)):
        fields.setdefault(key, value)
    try:
        config = tf.AutoConfig.for_model(model_type, **fields)
        model = tf.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise ConfigError(
            f"policy.hf_config does not build a {model_type} causal LM: {type(e).__name__}: {first}"
        ) from None
    return model


def _from_path(tf: Any, path: str) -> Any:
    """The causal LM saved in the local directory ``path`` (nothing is downloaded)."""
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise ConfigError(
            f"policy.hf_path {path!r:.200} does not load as a causal LM: {type(e).__name__}: "
            f"{first}"
        ) from None
    return model


def export_policy(policy: nn.Module, run_dir: Path) -> Path | None:
    """Save an :class:`HFPolicy` to ``run_dir``/hf_policy with ``save_pretrained`` (written
    beside it, then moved into place, replacing an earlier export); its path. None for any
    other policy (nothing written)."""
    if not isinstance(policy, HFPolicy):
        return None
    dest = run_dir / EXPORT_DIR
    tmp = run_dir / f"{EXPORT_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
