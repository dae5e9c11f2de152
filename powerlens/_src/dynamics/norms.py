"""Token norms, applied row-wise to a token matrix X (n, d).

    l2         x / ||x||_2                                   (the paper's N2)
    layernorm  (x - mean(x)) / sqrt(var(x) + eps) * scale + bias
    rmsnorm    x / sqrt(mean(x^2) + eps) * scale             (Llama; also the per-head q/k norms of
               Qwen3 / Gemma 3 over the last axis e; Gemma's x / rms(x) * (1 + w) is this with
               scale = 1 + w, folded at conversion)

A row whose variance (mean square, squared L2 norm) overflows the dtype (finite entries beyond about 1.8e19
in float32) is normed to NaN, not to the 0 that x / inf would give: the state it feeds is then
non-finite, which the ``finite`` observer reports, instead of a run that silently stops
moving (a pre-LN step x + attn(LN x) with LN x = 0 adds only the constant term).
"""
from __future__ import annotations

import jax.numpy as jnp

from .params import NORMS


def l2_normalize(X):
    """Divide each row by its L2 norm (NaN where the norm overflowed to inf, as in the module
    docstring). Rows must be non-zero (checked at the API boundary)."""
    norm = jnp.linalg.norm(X, axis=-1, keepdims=True)
    return X / jnp.where(norm < jnp.inf, norm, jnp.nan)


def _inverse_rms(ms, eps):
    """1 / sqrt(ms + eps) of a variance or mean square "float[... 1]"; NaN where ms overflowed to inf."""
    return jnp.where(ms < jnp.inf, jnp.reciprocal(jnp.sqrt(ms + eps)), jnp.nan)


def layer_norm(X, scale=None, bias=None, eps=1e-5):
    mu = jnp.mean(X, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(X - mu), axis=-1, keepdims=True)
    Y = (X - mu) * _inverse_rms(var, eps)
    if scale is not None:
        Y = Y * scale
    if bias is not None:
        Y = Y + bias
    return Y


def rms_norm(X, scale=None, eps=1e-6):
    Y = X * _inverse_rms(jnp.mean(jnp.square(X), axis=-1, keepdims=True), eps)
    if scale is not None:
        Y = Y * scale
    return Y


def apply_norm(kind: str, X, scale=None, bias=None, eps=1e-5):
    """Apply the norm named ``kind`` (one of ``l2``, ``layernorm``, ``rmsnorm``)."""
    if kind == "l2":
        return l2_normalize(X)
    if kind == "layernorm":
        return layer_norm(X, scale, bias, eps)
    if kind == "rmsnorm":
        return rms_norm(X, scale, eps)
    raise ValueError(f"unknown norm {kind!r}; expected one of {NORMS}")
