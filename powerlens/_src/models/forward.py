"""The model's own forward pass (rule ``full``), its hidden states and its logits.

One convention for every state powerlens hands out: a state is the residual stream, the
output of a block, *before* the model's final norm. :func:`logits` applies the final norm
and the LM head to such a state, so the obvious calls give the model's logits::

    hs = hidden_states(model, x0, valid)          # HiddenStates, hs[k] "float[B n d]"
    logits(model, hs[-1])                         # = transformers' logits
    logits(model, run_states(model, x0, valid)[-1])   # the same numbers
    logits(model, hs)                             # the same, from the normed state hs kept

Hugging Face's ``hidden_states`` tuple records the last state *after* the final norm in
some families (GPT-2, GPT-Neo, Llama, Mistral, Qwen, Gemma: ``info.final_norm_in_hidden_states``);
:attr:`HiddenStates.hf` is that tuple as one array, for comparisons with transformers.

    hidden_states(model, x0, valid) -> HiddenStates: states "float[K+1 B n d]", x0 first, then
        the state after the k-th recorded block (``info.hidden_state_steps``), and the final-normed
        last state "float[B n d]".
    logits(model, h) -> "float[... V]": final norm, then the LM head (tied to the word embeddings
        when ``lm_head`` is None), plus ``lm_head_bias`` if any, then Gemma 2's final
        soft-capping z -> c tanh(z / c) when ``info.final_logit_softcap`` = c.
"""
from __future__ import annotations

import functools
from typing import Iterator, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from ..dynamics import struct

from ..dynamics.norms import apply_norm
from ..dynamics.options import Dynamics, as_dynamics
from ..dynamics.run import run_batch
from .base import Model
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Real


def final_norm(model: Model, h):
    """The model's final norm of h "float[... d]" (h itself when the model has none)."""
    cfg = model.layers.config
    if model.final_norm_scale is None:
        return h
    return _norm(h, model.final_norm_scale, model.final_norm_bias, kind=cfg.norm, eps=cfg.norm_eps)


@functools.partial(jax.jit, static_argnames=("kind", "eps"))
def _norm(h, scale, bias, *, kind, eps):
    return apply_norm(kind, h, scale, bias, eps)


def run_states(model: Model, x0: Real[ArrayLike, "*batch n d"],
               valid: Bool[ArrayLike, "*batch n"] | Int[ArrayLike, "*batch n"] | None, *,
               dynamics: Optional[Dynamics] = None, rule: Optional[str] = None, attention: Optional[str] = None,
               keep_bias: Optional[bool] = None) -> Float[Array, "T1 B n d"]:
    """All states of the model's schedule under ``dynamics``, x_0 first: "float[T+1 B n d]"
    (the residual stream: no final norm, so ``logits(model, run_states(...)[-1])`` are the
    model's logits under the default, ``Dynamics.full()``: the model's own forward pass).
    ``rule``, ``attention``, ``keep_bias``: deprecated, ``dynamics``' fields as loose keywords.

    States only (the ``states()`` observer of :func:`powerlens._src.dynamics.run`, no measures),
    so it compiles and runs fast; x0 "float[B n d]" or "float[n d]", valid "bool[B n]" or "bool[n]".
    """
    dyn = as_dynamics(dynamics, rule, attention, keep_bias, default=Dynamics.full(), where="run_states")
    return run_batch(model.layers, x0, valid, dynamics=dyn, observe=("states",), steps_first=True)["states"]


@struct.dataclass
class HiddenStates:
    """A model's hidden states at Hugging Face's recording points, the last one marked.

    Indexing reads the residual stream: ``hs[k]`` is ``hs.states[k]``, so
    ``logits(model, hs[-1])`` are the model's logits. ``len(hs)`` is K+1, ``np.asarray(hs)``
    is ``hs.states`` and iterating yields its K+1 states.

    Attributes:
      states: "float[K+1 B n d]" hs[0] = x0 (the embedding output), hs[k] the state after the
        k-th recorded block; never the final norm.
      normed: "float[B n d]" the final norm of the last state, what the LM head reads (the last
        state itself when the model has no final norm).
      final_norm_in_hf: static: whether transformers' ``hidden_states[-1]`` is ``normed``
        (``info.final_norm_in_hidden_states``) rather than ``states[-1]``.
    """

    states: jax.Array
    normed: jax.Array
    final_norm_in_hf: bool = struct.field(pytree_node=False, default=False)

    def __getitem__(self, k):
        return self.states[k]

    def __len__(self) -> int:
        return self.states.shape[0]

    def __iter__(self) -> Iterator[jax.Array]:
        return (self.states[k] for k in range(len(self)))

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.states, dtype)

    @property
    def hf(self) -> jax.Array:
        """transformers' ``hidden_states`` tuple as one array "float[K+1 B n d]": ``states`` with
        the last entry replaced by ``normed`` where transformers records it normed."""
        return self.states.at[-1].set(self.normed) if self.final_norm_in_hf else self.states


def hidden_states(model: Model, x0: Real[ArrayLike, "*batch n d"],
                  valid: Bool[ArrayLike, "*batch n"] | Int[ArrayLike, "*batch n"] | None) -> HiddenStates:
    """The states of rule ``full`` at Hugging Face's recording points, as a :class:`HiddenStates`
    (``hs[k]``: the residual stream after the k-th recorded block, "float[B n d]"; ``hs.hf``:
    transformers' own tuple as one array)."""
    states = run_states(model, x0, valid)
    steps = model.info.hidden_state_steps if model.info and model.info.hidden_state_steps else None
    if steps is not None:
        states = states[jnp.asarray((0,) + tuple(steps))]
    in_hf = bool(model.info is not None and model.info.final_norm_in_hidden_states)
    return HiddenStates(states=states, normed=final_norm(model, states[-1]), final_norm_in_hf=in_hf)


def logits(model: Model, h: Union[Real[ArrayLike, "*batch d"], HiddenStates]) -> Float[Array, "*batch V"]:
    """Next-token logits "float[... V]" of a state h "float[... d]" of the residual stream (a
    block's output, before the final norm: ``hidden_states(...)[-1]``, ``run_states(...)[-1]``,
    any token or slice of them), or of a :class:`HiddenStates` (its ``normed`` last state):
    the final norm, then the LM head."""
    if model.lm_head is None and getattr(model.info, "unread_head", None):
        raise ValueError(f"logits: the model was loaded without its LM head (parts={model.info.parts!r}); "
                         f"load it with parts='all'")
    W = model.lm_head if model.lm_head is not None else model.embeddings["word"]
    normed = isinstance(h, HiddenStates)
    h = h.normed if normed else jnp.asarray(h)
    if h.ndim == 0 or h.shape[-1] != W.shape[-1]:
        raise ValueError(f"logits: the state has shape {tuple(h.shape)}, width {h.shape[-1] if h.ndim else 0}; the "
                         f"model's LM head reads width {W.shape[-1]}: pass a state of the residual stream, e.g. "
                         f"hidden_states(...)[-1]")
    if not normed:
        h = final_norm(model, h)
    cap = model.info.final_logit_softcap if model.info is not None else None
    return _head(h, W, model.lm_head_bias, cap=cap)


def _head_in_blocks(h: Float[ArrayLike, "*batch d"], W: Float[ArrayLike, "V d"], k: int) -> Float[Array, "*batch V"]:
    """h W^T for a head W stored in another dtype than h (bf16 weights, float32 states): the
    rows cast to h's dtype in k strided blocks (block b: rows b, b + k, b + 2k, ...), one block
    per step of a scan, each behind an optimization barrier, so that XLA holds one block in h's
    dtype instead of hoisting the cast of the whole head (Llama-3-8B's: 2 GB as float32).
    Strided, so that a head split over devices along V stays split. k divides V."""
    V, d = W.shape
    Wk = W.reshape(V // k, k, d)

    def step(carry, b):
        h, Wk = jax.lax.optimization_barrier(carry)
        block = jax.lax.dynamic_index_in_dim(Wk, b, axis=1, keepdims=False)          # "[V/k d]"
        return (h, Wk), jnp.einsum("...d,vd->...v", h, block.astype(h.dtype))
    _, z = jax.lax.scan(step, (h, Wk), jnp.arange(k))                                # "[k ... V/k]"
    return jnp.moveaxis(z, 0, -1).reshape(*h.shape[:-1], V)                          # row a k + b


HEAD_BLOCKS = 8
"""The most blocks a head stored in another dtype than the states is cast in (:func:`_head`:
the largest divisor of V up to this; one block, the plain contraction, when V has none)."""


@functools.partial(jax.jit, static_argnames=("cap",))
def _head(h, W, bias, *, cap):
    """h W^T (+ bias), soft-capped: one compiled contraction over d, so the (V, d) head is
    never transposed into a copy (Gemma 3's is 262,144 x 640); a head stored in another dtype
    than h is cast a block of rows at a time (:func:`_head_in_blocks`)."""
    k = max(j for j in range(1, HEAD_BLOCKS + 1) if W.shape[0] % j == 0)
    if W.dtype == h.dtype or k == 1:
        out = jnp.einsum("...d,vd->...v", h, W)
    else:
        out = _head_in_blocks(h, W, k)
    out = out if bias is None else out + bias
    return out if cap is None else cap * jnp.tanh(out / cap)
