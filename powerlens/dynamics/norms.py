"""Token norms, applied row-wise to a token matrix X (n, d).

    l2         x / ||x||_2                                   (the paper's N2)
    layernorm  (x - mean(x)) / sqrt(var(x) + eps) * scale + bias
    rmsnorm    x / sqrt(mean(x^2) + eps) * scale             (Llama; also the per-head q/k norms of
               Qwen3 / Gemma 3 over the last axis e; Gemma's x / rms(x) * (1 + w) is this with
               scale = 1 + w, folded at conversion)
"""
from __future__ import annotations

import jax.numpy as jnp

from .params import NORMS


def l2_normalize(X):
    """Divide each row by its L2 norm. Rows must be non-zero (checked at the API boundary)."""
    return X / jnp.linalg.norm(X, axis=-1, keepdims=True)


def layer_norm(X, scale=None, bias=None, eps=1e-5):
    mu = jnp.mean(X, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(X - mu), axis=-1, keepdims=True)
    Y = (X - mu) * jnp.reciprocal(jnp.sqrt(var + eps))
    if scale is not None:
        Y = Y * scale
    if bias is not None:
        Y = Y + bias
    return Y


def rms_norm(X, scale=None, eps=1e-6):
    Y = X * jnp.reciprocal(jnp.sqrt(jnp.mean(jnp.square(X), axis=-1, keepdims=True) + eps))
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
