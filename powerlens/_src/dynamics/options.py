"""``Dynamics``: how a run steps its tokens, as one frozen, hashable value.

    Dynamics(rule="paper", attention="softmax", keep_bias=None, attention_block=None)
                          the package's one default
    Dynamics.full()       the model's own blocks, FFN included (``trace``, ``run_states``)
    Dynamics.faithful()   the model's attention-only sub-layer as trained (post_ln or pre_ln)

Every entry point that runs the dynamics (``run``, ``run_batch``, ``simulate``,
``simulate_batch``, ``simulate_sweep``, ``run_system``, ``align``, ``trace``, ``run_states``)
takes it as ``dynamics=``. Being hashable, it is a ``jit`` static argument as it is.
The loose keywords ``rule=``, ``attention=`` and ``keep_bias=`` are still accepted for one
release, with a ``DeprecationWarning`` (:func:`as_dynamics`).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Union

import numpy as np

from .attention import ATTENTION_MODES, check_attention_block
from .layer import RULES, faithful_rule

RULE_CHOICES = RULES + ("faithful",)
"""The rules a :class:`Dynamics` may name: :data:`~powerlens._src.dynamics.layer.RULES`, and
``faithful`` (resolved against a model's norm placement by :meth:`Dynamics.resolved`)."""


@dataclasses.dataclass(frozen=True)
class Dynamics:
    """How each step of a run maps the tokens X "float[n d]" to the next state.

    Attributes:
      rule: the layer rule (design.md §1): ``paper`` X <- N2(X + attn X) (the default),
        ``post_ln`` X <- LN(X + attn X), ``pre_ln`` X <- X + attn(LN X), ``full`` the model's own
        block with its FFN, or ``faithful``: ``post_ln`` for a post-norm model and ``pre_ln``
        for a pre-norm one (:meth:`resolved`).
      attention: how A is formed: ``softmax`` (the model's own attention), ``uniform``
        (A_ij = 1/#keys) or ``identity`` (A = I).
      keep_bias: add the constant c = O b_v + b_o to attn(X). None (default): the rule's
        own choice, dropped by ``paper`` (so that at consensus a step is a power step) and
        kept by every other rule (:attr:`keeps_bias`).
      attention_block: how softmax attention is computed, an execution choice (the states are
        the same to float rounding): ``None`` (default) dense for prompts of at most
        :attr:`~powerlens._src.dynamics.execution.Tuning.blocked_above` tokens and by query blocks of
        :attr:`~powerlens._src.dynamics.execution.Tuning.query_block` above ("float[H 128 n]" at a
        time; a causal block reads only the keys up to its last query); ``0`` always dense (the
        whole "float[H n n]" score tensor); ``k > 0`` always by blocks of k keys (online
        softmax, "float[H n k]" at a time: :mod:`powerlens._src.dynamics.blocked`); ``"cudnn"``
        cuDNN's fused flash attention through ``jax.nn.dot_product_attention``, for float16 or
        bfloat16 systems on an NVIDIA GPU
        (:func:`~powerlens._src.dynamics.attention.check_fused_attention` says what else it needs).
        Computations that take no Dynamics (generation's KV cache, the steering objectives)
        use the default.

    One default for the whole package, ``Dynamics()`` (the paper's system). ``trace`` and
    ``run_states`` run a model's own forward pass, so their default is :meth:`full`.
    Frozen and hashable: use it as a ``jit`` static argument, a dict key or a cache key;
    ``dataclasses.replace(d, rule="full")`` gives a changed copy.
    """

    rule: str = "paper"
    attention: str = "softmax"
    keep_bias: Optional[bool] = None
    attention_block: Optional[Union[int, str]] = None

    def __post_init__(self):
        if not isinstance(self.rule, str) or self.rule not in RULE_CHOICES:
            raise ValueError(f"Dynamics.rule: unknown rule {self.rule!r}; expected one of {RULE_CHOICES}")
        if not isinstance(self.attention, str) or self.attention not in ATTENTION_MODES:
            raise ValueError(f"Dynamics.attention: unknown attention mode {self.attention!r}; expected one of "
                             f"{ATTENTION_MODES}")
        kb = self.keep_bias
        if kb is not None and not isinstance(kb, (bool, np.bool_)):      # a NumPy bool too, never 0/1
            raise ValueError(f"Dynamics.keep_bias: must be True, False or None (the rule's default), got {kb!r}")
        if kb is not None:
            object.__setattr__(self, "keep_bias", bool(kb))
        block = check_attention_block(self.attention_block, "Dynamics.attention_block")
        if block is not None and not isinstance(block, str):
            object.__setattr__(self, "attention_block", int(block))     # a NumPy int too: one hash

    @classmethod
    def paper(cls, attention: str = "softmax", keep_bias: Optional[bool] = None, *,
              attention_block: Optional[Union[int, str]] = None) -> "Dynamics":
        """The paper's system X <- N2(X + attn X), c dropped: the package default."""
        return cls("paper", attention, keep_bias, attention_block)

    @classmethod
    def full(cls, attention: str = "softmax", keep_bias: Optional[bool] = None, *,
             attention_block: Optional[Union[int, str]] = None) -> "Dynamics":
        """The model's own blocks, FFN and c included: its forward pass (the default of
        ``trace`` and ``run_states``)."""
        return cls("full", attention, keep_bias, attention_block)

    @classmethod
    def faithful(cls, attention: str = "softmax", keep_bias: Optional[bool] = None, *,
                 attention_block: Optional[Union[int, str]] = None) -> "Dynamics":
        """The model's attention sub-layer as trained, FFN dropped: ``post_ln`` or ``pre_ln``
        by its norm placement (:meth:`resolved`)."""
        return cls("faithful", attention, keep_bias, attention_block)

    @property
    def keeps_bias(self) -> bool:
        """Whether c = O b_v + b_o is added: ``keep_bias``, or when None the rule's default
        (dropped by ``paper`` only)."""
        return self.rule != "paper" if self.keep_bias is None else self.keep_bias

    def resolved(self, config) -> "Dynamics":
        """This value with ``faithful`` replaced by the rule of ``config``'s norm placement
        (a :class:`~powerlens._src.dynamics.params.LayerConfig`); any other rule as it is."""
        if self.rule != "faithful":
            return self
        return dataclasses.replace(self, rule=faithful_rule(config))


def as_dynamics(dynamics: Optional[Dynamics], rule: Optional[str] = None, attention: Optional[str] = None,
                keep_bias: Optional[bool] = None, *, default: Dynamics = Dynamics(), where: str = "run",
                stacklevel: int = 3) -> Dynamics:
    """The :class:`Dynamics` of an entry point called with ``dynamics=`` or with the deprecated
    loose keywords (one shim for every entry point).

    ``dynamics`` given: it, checked to be a Dynamics. Loose keywords given (any not None):
    ``default`` with those fields replaced (``keep_bias`` back to the new rule's default
    when only ``rule`` is given), and a ``DeprecationWarning`` naming ``where`` and the
    equivalent ``dynamics=`` value. Neither: ``default``. Both: a ValueError.
    ``stacklevel``: the warning's, 3 = the caller of the entry point that calls this.
    """
    loose = {k: v for k, v in (("rule", rule), ("attention", attention), ("keep_bias", keep_bias)) if v is not None}
    if dynamics is not None:
        if not isinstance(dynamics, Dynamics):
            raise ValueError(f"{where}: dynamics must be a powerlens.Dynamics, e.g. Dynamics(rule='paper'), "
                             f"got {dynamics!r}")
        if loose:
            raise ValueError(f"{where}: pass dynamics= or the deprecated {'=, '.join(loose)}=, not both")
        return dynamics
    if not loose:
        return default
    value = Dynamics(rule=loose.get("rule", default.rule), attention=loose.get("attention", default.attention),
                     keep_bias=loose.get("keep_bias", None if "rule" in loose else default.keep_bias),
                     attention_block=default.attention_block)
    names = " and ".join(", ".join(f"{k}=" for k in loose).rsplit(", ", 1))
    warnings.warn(f"{where}: {names} {'is' if len(loose) == 1 else 'are'} deprecated; pass dynamics={value!r}",
                  DeprecationWarning, stacklevel=stacklevel)
    return value
