"""Per-state measures of the tokens (design.md §3), one copy of each formula.

Pure ``jnp`` functions of one prompt's tokens X "float[n d]" and its mask valid "bool[n]"
(padding rows count nowhere); they run inside the scan of :func:`powerlens.dynamics.run`
through its observers. Host-side statistics (chance levels, p-values) live in
:mod:`powerlens.analysis.measures`.

    gamma_i      = ||B^T x_i|| / ||x_i||            B "float[d k]" orthonormal (zero-padded
                                                    columns add nothing)
    mu(X)        = ||R||_F / ||X||_F,               R = X - 1 xbar^T  (consensus distance)
    res(X)       = sqrt(||R||_1 ||R||_inf / (||X||_1 ||X||_inf))
                   (Dong et al. 2021 rank-collapse residual, relative; ||M||_1 the largest
                   column sum of |M|, ||M||_inf the largest row sum)
    pairwise cos = mean over ordered pairs i != j of cos(x_i, x_j)
                 = (||sum_i x_i/||x_i||||^2 - n) / (n (n - 1))

xbar is the mean of the valid tokens; every sum runs over valid tokens only.

Every measure is scale-free, as design.md §3 asks: a token is divided by a power of two
near its largest entry before its norm is taken (exact in binary floating point, so the
unit tokens are those of X / ||x_i|| bit for bit), and the consensus measures divide the
whole matrix by a power of two near its largest entry. A finite state whose norms are
near the largest float (1e36 in float32, whose squares overflow) is measured as the
same state divided by 1e36; a non-finite state gives NaN measures, never a number.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def _weights(valid, dtype):
    w = valid.astype(dtype)
    return w, jnp.maximum(w.sum(), 1.0)


def _safe(norms):
    """Norms with zeros replaced by 1, so that a zero padding row gives 0, never NaN."""
    return jnp.where(norms > 0, norms, 1.0)


def _pow2_scale(a):
    """2^e with a / 2^e in [1/2, 1) for a > 0 (1 for a = 0; inf and NaN pass through as
    themselves, so that they poison what they scale): dividing by it is exact."""
    _, e = jnp.frexp(a)
    return jnp.where(jnp.isfinite(a), jnp.where(a > 0, jnp.ldexp(jnp.ones_like(a), e), 1.0), a)


def unit_rows(X):
    """x_i / ||x_i|| for every row of X "float[n d]" (a zero row stays 0), without squaring a
    large entry: each row is first divided by a power of two near its largest entry."""
    Y = X / _pow2_scale(jnp.max(jnp.abs(X), axis=-1, keepdims=True))
    return Y / _safe(jnp.linalg.norm(Y, axis=-1, keepdims=True))


def masked_mean(values, valid):
    """Mean over the valid tokens of values "float[... n]" -> "float[...]"."""
    w, n = _weights(valid, values.dtype)
    return jnp.sum(values * w, axis=-1) / n


def token_mean(X, valid):
    """xbar "float[d]": the mean of the valid rows of X "float[n d]"."""
    w, n = _weights(valid, X.dtype)
    return (w @ X) / n


def alignment(X, basis):
    """gamma_i = ||B^T x_i|| / ||x_i|| of every token: X "float[n d]", B "float[d k]" -> "float[n]"."""
    return jnp.linalg.norm(unit_rows(X) @ basis, axis=-1)


def wrap_angle(a):
    """Wrap angles to [-pi, pi)."""
    return (a + jnp.pi) % (2 * jnp.pi) - jnp.pi


# ------------------------------------------------------------------------ consensus

@struct.dataclass
class Consensus:
    """The consensus measures of one state (scalars), or of every state "float[T+1]"
    when returned by the ``consensus()`` observer (index 0: the initial state)."""

    consensus: jax.Array        # mu(X), 0 at consensus
    rank_collapse: jax.Array    # res(X), 0 at consensus
    pairwise_cos: jax.Array     # mean pairwise cosine, 1 at consensus


def _masked(X, valid):
    """(Xw, R): the valid rows of X and of its residual R = X - 1 xbar^T (others zeroed),
    both divided by a power of two near the largest valid entry (the ratios are scale-free)."""
    v = valid[:, None]
    Xw = jnp.where(v, X, 0)
    Xw = Xw / _pow2_scale(jnp.max(jnp.abs(Xw)))
    return Xw, jnp.where(v, Xw - token_mean(Xw, valid), 0)


def _frobenius_ratio(R, Xw):
    return jnp.sqrt(jnp.sum(R * R) / jnp.sum(Xw * Xw))


def _ratio_1inf(R, Xw):
    n1inf = lambda A: jnp.max(jnp.sum(A, axis=0)) * jnp.max(jnp.sum(A, axis=1))
    return jnp.sqrt(n1inf(jnp.abs(R)) / n1inf(jnp.abs(Xw)))


def mean_pairwise_cosine(X, valid):
    """Mean of cos(x_i, x_j) over ordered pairs of distinct valid tokens (1 at consensus)."""
    w, n = _weights(valid, X.dtype)
    s = w @ jnp.where(valid[:, None], unit_rows(X), 0)
    return (jnp.dot(s, s) - jnp.sum(w)) / jnp.maximum(n * (n - 1), 1.0)


def consensus_distance(X, valid):
    """mu(X) = ||X - 1 xbar^T||_F / ||X||_F over the valid tokens (0 at consensus)."""
    return _frobenius_ratio(*_masked(X, valid)[::-1])


def rank_collapse_residual(X, valid):
    """Relative residual sqrt(||R||_1 ||R||_inf / (||X||_1 ||X||_inf)), R = X - 1 xbar^T."""
    return _ratio_1inf(*_masked(X, valid)[::-1])


def consensus_measures(X, valid) -> Consensus:
    """All three consensus measures of one state, sharing the masked, scaled residual."""
    Xw, R = _masked(X, valid)
    return Consensus(consensus=_frobenius_ratio(R, Xw), rank_collapse=_ratio_1inf(R, Xw),
                     pairwise_cos=mean_pairwise_cosine(X, valid))
