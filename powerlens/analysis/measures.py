"""Alignment and consensus measures (design.md §3).

Per-state measures are pure ``jnp`` functions of one prompt's tokens X (n, d) and its
``valid`` mask (n,); they run inside the simulation scan. Statistics (chance levels,
p-values) are NumPy/SciPy and run on the results.

    gamma_i      = ||P_S x_i|| / ||x_i||          P_S = B B^T, B (d, k) orthonormal
                                                  (zero-padded columns are ignored)
    mu(X)        = ||X - 1 xbar^T||_F / ||X||_F   consensus distance
    res(X)       = ||X - 1 xbar^T||_{1,inf} / ||X||_{1,inf},  ||M||_{1,inf} = sqrt(||M||_1 ||M||_inf)
                   (Dong et al. 2021 rank-collapse residual, relative; xbar the token mean)
    pairwise cos = mean_{i != j} cos(x_i, x_j)
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from scipy import special, stats


def _weights(valid, dtype):
    w = valid.astype(dtype)
    return w, jnp.maximum(w.sum(), 1.0)


def alignment(X, basis):
    """gamma_i = ||B^T x_i|| / ||x_i|| for every token: X (n, d), B (d, k) -> (n,)."""
    proj = X @ basis
    return jnp.linalg.norm(proj, axis=-1) / jnp.linalg.norm(X, axis=-1)


def masked_mean(values, valid):
    w, n = _weights(valid, values.dtype)
    return jnp.sum(values * w, axis=-1) / n


def token_mean(X, valid):
    w, n = _weights(valid, X.dtype)
    return (w @ X) / n


def consensus_distance(X, valid):
    """mu(X) = ||X - 1 xbar^T||_F / ||X||_F over the valid tokens (0 at consensus)."""
    w, _ = _weights(valid, X.dtype)
    R = (X - token_mean(X, valid)) * w[:, None]
    return jnp.sqrt(jnp.sum(R * R) / jnp.sum((X * w[:, None]) ** 2))


def _norm_1inf(M):
    return jnp.sqrt(jnp.max(jnp.sum(jnp.abs(M), axis=0)) * jnp.max(jnp.sum(jnp.abs(M), axis=1)))


def rank_collapse_residual(X, valid):
    """Relative ||res(X)||_{1,inf} of Dong et al. (2021), res(X) = X - 1 xbar^T."""
    w, _ = _weights(valid, X.dtype)
    R = (X - token_mean(X, valid)) * w[:, None]
    return _norm_1inf(R) / _norm_1inf(X * w[:, None])


def mean_pairwise_cosine(X, valid):
    """Mean of cos(x_i, x_j) over ordered pairs of distinct valid tokens (1 at consensus)."""
    w, n = _weights(valid, X.dtype)
    U = X / jnp.linalg.norm(X, axis=-1, keepdims=True)
    s = w @ U
    total = jnp.dot(s, s) - jnp.sum(w)          # sum over i != j of cos
    return total / jnp.maximum(n * (n - 1), 1.0)


def plane_angles(X, basis):
    """Angle of each token in the plane of the first two basis columns: (n,)."""
    c = X @ basis[:, :2]
    return jnp.arctan2(c[:, 1], c[:, 0])


def wrap_angle(a):
    """Wrap to (-pi, pi]."""
    return (a + jnp.pi) % (2 * jnp.pi) - jnp.pi


# ---------------------------------------------------------------- statistics (NumPy)

def chance_gamma(d: int, k: int = 1) -> float:
    """E ||P x|| for x uniform on the unit sphere of R^d and P a rank-k projector.

    ||P x||^2 ~ Beta(k/2, (d-k)/2), so E||P x|| = B((k+1)/2, (d-k)/2) / B(k/2, (d-k)/2).
    For k = 1 this is Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2)) ~ sqrt(2/(pi d)).
    """
    if not (0 < k <= d):
        raise ValueError(f"need 0 < k <= d, got k={k}, d={d}")
    if k == d:
        return 1.0
    return float(math.exp(special.betaln((k + 1) / 2, (d - k) / 2) - special.betaln(k / 2, (d - k) / 2)))


def chance_gamma_std(d: int, k: int = 1) -> float:
    """Standard deviation of ||P x|| for a random unit x (E||Px||^2 = k/d)."""
    m = chance_gamma(d, k)
    return float(math.sqrt(max(k / d - m * m, 0.0)))


def binomial_pvalue(successes: int, trials: int, p: float = 0.5) -> float:
    """One-sided P(Bin(trials, p) >= successes): evidence that rho exceeds p."""
    if trials <= 0:
        return float("nan")
    return float(stats.binom.sf(int(successes) - 1, int(trials), p))


def random_subspace(rng: np.random.Generator, d: int, k: int) -> np.ndarray:
    """A uniformly random k-dimensional subspace of R^d as an orthonormal basis (d, k)."""
    Q, R = np.linalg.qr(rng.standard_normal((d, k)))
    return Q * np.sign(np.diag(R))
