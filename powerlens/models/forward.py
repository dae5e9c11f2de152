"""The model's own forward pass (rule ``full``) and what Hugging Face calls hidden states.

    hidden_states(model, x0, valid) -> (K+1, B, n, d): hs[0] = x0, hs[k] = the state after
        the k-th recorded block (``info.hidden_state_steps``), with the final norm applied
        to the last one where Hugging Face does (GPT-2, GPT-Neo, Llama).
    logits(model, h) -> (B, n, V) for decoders: final norm (unless already applied) then the
        LM head (tied to the word embeddings when ``lm_head`` is None).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..analysis.spectra import null_subspaces  # noqa: F401  (re-exported)
from ..dynamics.attention import check_attention
from ..dynamics.layer import check_rule, layer_step
from ..dynamics.norms import apply_norm
from ..dynamics.simulate import check_batch
from .base import Model


def final_norm(model: Model, h):
    cfg = model.layers.config
    if model.final_norm_scale is None:
        return h
    return apply_norm(cfg.norm, h, model.final_norm_scale, model.final_norm_bias, cfg.norm_eps)


@functools.partial(jax.jit, static_argnames=("rule", "attention", "keep_bias"))
def _states(layers, X0, valid, *, rule, attention, keep_bias):
    """(T+1, B, n, d): ``lax.scan`` over the schedule, the batch as a leading axis (vmap)."""
    sched = jnp.asarray(layers.schedule, jnp.int32)
    step_one = jax.vmap(lambda lp, X, v: layer_step(lp, X, v, rule=rule, attention=attention,
                                                    keep_bias=keep_bias), (None, 0, 0))

    def step(X, u):
        Y = step_one(layers.layer(u), X, valid)
        return Y, Y

    _, ys = jax.lax.scan(step, X0, sched)
    return jnp.concatenate([X0[None], ys])


def run_states(model: Model, x0, valid, *, rule: str = "full", attention: str = "softmax", keep_bias=None):
    """All states (T+1, B, n, d) of the model's schedule under ``rule``.

    States only (no measures, unlike :func:`powerlens.dynamics.simulate.simulate_batch`),
    so it compiles and runs fast; x0 (B, n, d) or (n, d), valid (B, n) or (n,).
    """
    check_rule(rule)
    check_attention(attention)
    layers = model.layers
    X0, valid = check_batch(x0, valid, layers.config.d_model)
    return _states(layers, jnp.asarray(X0, layers.W_v.dtype), jnp.asarray(valid),
                   rule=rule, attention=attention, keep_bias=keep_bias)


def hidden_states(model: Model, x0, valid):
    """Hugging Face's ``hidden_states`` tuple as one array (K+1, B, n, d)."""
    states = run_states(model, x0, valid)
    steps = model.info.hidden_state_steps if model.info and model.info.hidden_state_steps else None
    if steps is not None:
        states = states[jnp.asarray((0,) + tuple(steps))]
    if model.info is not None and model.info.final_norm_in_hidden_states:
        states = states.at[-1].set(final_norm(model, states[-1]))
    return states


def logits(model: Model, h, *, normed: bool = False):
    """Next-token logits (B, n, V) from the last hidden state h (B, n, d)."""
    if not normed:
        h = final_norm(model, h)
    W = model.lm_head if model.lm_head is not None else model.embeddings["word"]
    return h @ jnp.asarray(W).T
