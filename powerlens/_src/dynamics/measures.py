"""Per-state measures of the tokens (design.md §3), one copy of each formula.

Pure ``jnp`` functions of one prompt's tokens X "float[n d]" and its mask valid "bool[n]"
(padding rows count nowhere); they run inside the scan of :func:`powerlens._src.dynamics.run`
through its observers. Host-side statistics (chance levels, p-values) live in
:mod:`powerlens._src.analysis.measures`.

    gamma_i      = ||B^T x_i|| / ||x_i||            B "float[d k]" orthonormal (zero-padded
                                                    columns add nothing)
    mu(X)        = ||R||_F / ||X||_F,               R = X - 1 xbar^T  (consensus distance)
    res(X)       = sqrt(||R||_1 ||R||_inf / (||X||_1 ||X||_inf))
                   (Dong et al. 2021 rank-collapse residual, relative; ||M||_1 the largest
                   column sum of |M|, ||M||_inf the largest row sum)
    pairwise cos = mean over ordered pairs i != j of cos(x_i, x_j)
                 = (||sum_i x_i/||x_i||||^2 - n) / (n (n - 1))
    mean angle   = wrap(c + mean_i wrap(a_i - c)),  c = arg sum_i e^{i a_i}
                   (angles averaged on one branch of the circle: the rotation per step)

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
import numpy as np
from . import struct
from .linalg import pow2_scale


def _weights(valid, dtype):
    w = valid.astype(dtype)
    return w, jnp.maximum(w.sum(), 1.0)


def _safe(norms):
    """Norms with zeros replaced by 1, so that a zero padding row gives 0, never NaN."""
    return jnp.where(norms > 0, norms, 1.0)


def row_scaled(X):
    """(Xp, p, r2) of X "float[n d]": p_i "float[n]" the power of two near the largest |entry|
    of row i, Xp = x_i / p_i (exact; entries in (-1, 1)) and r2_i = ||x_i / p_i||^2 "float[n]",
    so ||x_i|| = p_i sqrt(r2_i) without squaring a large entry."""
    p = pow2_scale(jnp.max(jnp.abs(X), axis=-1))
    Xp = X / p[:, None]
    return Xp, p, jnp.sum(Xp * Xp, axis=-1)


def unit_rows(X):
    """x_i / ||x_i|| for every row of X "float[n d]" (a zero row stays 0), without squaring a
    large entry: each row is first divided by a power of two near its largest entry."""
    Xp, _, r2 = row_scaled(X)
    return Xp / _safe(jnp.sqrt(r2))[:, None]


def masked_mean(values, valid):
    """Mean over the valid tokens of values "float[... n]" -> "float[...]"."""
    w, n = _weights(valid, values.dtype)
    return jnp.sum(values * w, axis=-1) / n


def token_alignment(X, basis):
    """gamma_i = ||B^T x_i|| / ||x_i|| of every token: X "float[n d]", B "float[d k]" -> "float[n]"."""
    return jnp.linalg.norm(unit_rows(X) @ basis, axis=-1)


def wrap_angle(a):
    """Wrap angles to [-pi, pi)."""
    return (a + jnp.pi) % (2 * jnp.pi) - jnp.pi


def mean_angle(angles, valid):
    """Mean of angles "float[... n]" over the valid entries "bool[... n]" -> "float[...]",
    in [-pi, pi), whatever side of the cut at +-pi each angle was wrapped to.

        c    = arg sum_i w_i exp(i a_i)                  (the circular mean)
        mean = wrap(c + sum_i w_i wrap(a_i - c) / sum_i w_i)

    Each angle is read on the branch within pi of c, so the mean is the arithmetic mean of
    the angles taken on one branch: equal to the plain mean of a_i wherever no angle is
    more than pi from c, and equivariant under a common shift (the angles plus delta give
    the mean plus delta, mod 2 pi). The plain mean of wrapped angles is neither: angle
    steps of about pi (arg(1 + lambda1) near +-pi) wrap to +pi or -pi by rounding, and
    average to anything in between. JAX or NumPy arrays (NumPy in, NumPy out).
    """
    xp = jnp if isinstance(angles, jax.Array) else np
    w = xp.asarray(valid).astype(angles.dtype)
    n = xp.maximum(xp.sum(w, axis=-1), 1.0)
    c = xp.arctan2(xp.sum(w * xp.sin(angles), axis=-1), xp.sum(w * xp.cos(angles), axis=-1))
    return wrap_angle(c + xp.sum(w * wrap_angle(angles - c[..., None]), axis=-1) / n)


# ------------------------------------------------------------------------ consensus

@struct.dataclass
class Consensus:
    """The consensus measures of one state (scalars), or of every state "float[T+1]"
    when returned by the ``consensus()`` observer (index 0: the initial state)."""

    consensus: jax.Array        # mu(X), 0 at consensus
    rank_collapse: jax.Array    # res(X), 0 at consensus
    pairwise_cos: jax.Array     # mean pairwise cosine, 1 at consensus


def consensus_measures(X, valid) -> Consensus:
    """mu, the rank-collapse residual and the mean pairwise cosine of one state X "float[n d]"
    over its valid rows, in few passes over X (each measure is scale-free, so X is measured as
    X / c, c the power of two near its largest valid entry)::

        row pass      p_i, Xp_i = x_i / p_i, r2_i = ||Xp_i||^2          (:func:`row_scaled`,
                      the pass :func:`unit_rows` of the same state makes: XLA shares it)
        one matmul    [xbar; s] = [w_i (p_i / c) / n ; w_i / sqrt(r2_i)] @ Xp
                      xbar: the mean of the valid rows of X / c,  s = sum_i w_i x_i / ||x_i||
        R pass        R = w (X / c - xbar): sum R^2, its row and column sums of |R|
        X / c pass    its row and column sums of |X / c|; ||X / c||_F^2 = sum_i w_i (p_i / c)^2 r2_i

    mu = ||R||_F / ||X||_F, res = sqrt(||R||_1 ||R||_inf / (||X||_1 ||X||_inf)) and
    pairwise cos = (||s||^2 - n) / (n (n - 1)) (module docstring). A non-finite valid entry makes
    every measure NaN; padding rows are selected away (never multiplied by 0), so they count
    nowhere whatever they hold.
    """
    w, n = _weights(valid, X.dtype)
    v = valid[:, None]
    Xp, p, r2 = row_scaled(X)
    c = pow2_scale(jnp.max(jnp.where(valid, jnp.max(jnp.abs(X), axis=-1), 0)))
    ratio = jnp.where(valid, p / c, 0)               # exact powers of two, <= 1; 0 for padding
    inv_norm = jnp.where(valid, 1 / _safe(jnp.sqrt(r2)), 0)
    xbar, s = jnp.stack([ratio / n, inv_norm]) @ jnp.where(v, Xp, 0)
    Xs = jnp.where(v, X / c, 0)
    R = jnp.where(v, Xs - xbar, 0)
    mu = jnp.sqrt(jnp.sum(R * R) / jnp.sum(ratio * ratio * jnp.where(valid, r2, 0)))
    n1inf = lambda A: jnp.max(jnp.sum(A, axis=0)) * jnp.max(jnp.sum(A, axis=1))
    res = jnp.sqrt(n1inf(jnp.abs(R)) / n1inf(jnp.abs(Xs)))
    pc = (jnp.dot(s, s) - jnp.sum(w)) / jnp.maximum(n * (n - 1), 1.0)
    return Consensus(consensus=mu, rank_collapse=res, pairwise_cos=pc)


def mean_pairwise_cosine(X, valid):
    """Mean of cos(x_i, x_j) over ordered pairs of distinct valid tokens (1 at consensus)."""
    return consensus_measures(X, valid).pairwise_cos


def consensus_distance(X, valid):
    """mu(X) = ||X - 1 xbar^T||_F / ||X||_F over the valid tokens (0 at consensus)."""
    return consensus_measures(X, valid).consensus


def rank_collapse_residual(X, valid):
    """Relative residual sqrt(||R||_1 ||R||_inf / (||X||_1 ||X||_inf)), R = X - 1 xbar^T."""
    return consensus_measures(X, valid).rank_collapse
