"""The model's own forward pass (rule ``full``) and what Hugging Face calls hidden states.

    hidden_states(model, x0, valid) -> "float[K+1 B n d]": hs[0] = x0, hs[k] = the state after
        the k-th recorded block (``info.hidden_state_steps``), with the final norm applied
        to the last one where Hugging Face does (GPT-2, GPT-Neo, Llama).
    logits(model, h) -> "float[B n V]" for decoders: final norm (unless already applied) then the
        LM head (tied to the word embeddings when ``lm_head`` is None), plus ``lm_head_bias`` if any,
        then Gemma 2's final soft-capping z -> c tanh(z / c) when ``info.final_logit_softcap`` = c.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..dynamics.norms import apply_norm
from ..dynamics.run import run_batch
from .base import Model


def final_norm(model: Model, h):
    """The model's final norm of h "float[... d]" (h itself when the model has none)."""
    cfg = model.layers.config
    if model.final_norm_scale is None:
        return h
    return _norm(h, model.final_norm_scale, model.final_norm_bias, kind=cfg.norm, eps=cfg.norm_eps)


@functools.partial(jax.jit, static_argnames=("kind", "eps"))
def _norm(h, scale, bias, *, kind, eps):
    return apply_norm(kind, h, scale, bias, eps)


def run_states(model: Model, x0: "float[B n d]", valid: "bool[B n]", *, rule: str = "full",
               attention: str = "softmax", keep_bias=None) -> "float[T+1 B n d]":
    """All states of the model's schedule under ``rule``, x_0 first: "float[T+1 B n d]".

    States only (the ``states()`` observer of :func:`powerlens.dynamics.run`, no measures),
    so it compiles and runs fast; x0 "float[B n d]" or "float[n d]", valid "bool[B n]" or "bool[n]".
    """
    return run_batch(model.layers, x0, valid, rule=rule, attention=attention, keep_bias=keep_bias,
                     observe=("states",), steps_first=True)["states"]


def hidden_states(model: Model, x0: "float[B n d]", valid: "bool[B n]") -> "float[K+1 B n d]":
    """Hugging Face's ``hidden_states`` tuple as one array "float[K+1 B n d]"."""
    states = run_states(model, x0, valid)
    steps = model.info.hidden_state_steps if model.info and model.info.hidden_state_steps else None
    if steps is not None:
        states = states[jnp.asarray((0,) + tuple(steps))]
    if model.info is not None and model.info.final_norm_in_hidden_states:
        states = states.at[-1].set(final_norm(model, states[-1]))
    return states


def logits(model: Model, h: "float[B n d]", *, normed: bool = False) -> "float[B n V]":
    """Next-token logits "float[B n V]" from the last hidden state h "float[B n d]"."""
    if not normed:
        h = final_norm(model, h)
    W = model.lm_head if model.lm_head is not None else model.embeddings["word"]
    cap = model.info.final_logit_softcap if model.info is not None else None
    return _head(h, W, model.lm_head_bias, cap=cap)


@functools.partial(jax.jit, static_argnames=("cap",))
def _head(h, W, bias, *, cap):
    """h W^T (+ bias), soft-capped: one compiled contraction over d, so the (V, d) head is
    never transposed into a copy (Gemma 3's is 262,144 x 640)."""
    out = jnp.einsum("...d,vd->...v", h, W)
    out = out if bias is None else out + bias
    return out if cap is None else cap * jnp.tanh(out / cap)
