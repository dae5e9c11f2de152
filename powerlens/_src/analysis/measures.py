"""Host-side statistics of the measures (design.md §3): chance levels, p-values, controls.

NumPy/SciPy, run on the results. The per-state measures themselves (gamma_i, consensus,
rank collapse, pairwise cosine) run inside the scan: :mod:`powerlens._src.dynamics.measures`.

    chance_gamma(d, k)     E ||P x|| for a random unit x in R^d and a rank-k projector P
    chance_gamma_std(d, k) its standard deviation (for the chance band)
    binomial_pvalue        one-sided P(Bin(N, p) >= k): evidence that rho exceeds 1/2 (vectorised)
    binomial_interval      Wilson score interval of a proportion k / N (vectorised; error bars)
    random_subspace        a uniformly random k-dim subspace (the control reference)
    group_difference       difference of means between two groups of layers, with an exact
                           permutation p-value (local against global attention layers)
"""
from __future__ import annotations

import itertools
import math

import numpy as np
from scipy import special

from ..dynamics.linalg import haar


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


def binomial_pvalue(successes, trials: int, p: float = 0.5):
    """One-sided P(Bin(trials, p) >= successes): evidence that rho exceeds p. ``successes``
    an int (a float is returned) or "int[...]" (then "float[...]", one p-value each)."""
    k = np.asarray(successes, np.int64)
    n = int(trials)
    if n > 0:   # P(X >= k) = I_p(k, n - k + 1), what scipy.stats.binom.sf computes (the same bits)
        kk = np.clip(k, 1, n)
        out = np.where(k <= 0, 1.0, np.where(k > n, 0.0, special.betainc(kk, n - kk + 1, p)))
    else:
        out = np.full(k.shape, np.nan)
    return float(out) if np.ndim(out) == 0 else np.asarray(out, float)


def binomial_interval(successes, trials, z: float = 1.959963984540054):
    """(low, high): the Wilson score interval of the proportion p = k / N, for k
    ``successes`` out of N ``trials`` (numbers or arrays, broadcast), at ``z`` standard
    normal deviates (default: 95 %):

        (p + z^2 / 2N  -/+  z sqrt(p (1 - p) / N + z^2 / 4N^2)) / (1 + z^2 / N).

    It stays inside [0, 1] and has a nonzero width at k = 0 and k = N (unlike p -/+ z sqrt(p(1-p)/N)).
    NaN where N = 0."""
    k = np.asarray(successes, np.float64)
    n = np.asarray(trials, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = k / n
        c = z * z / n
        mid = (p + c / 2) / (1 + c)
        half = z * np.sqrt(p * (1 - p) / n + c / (4 * n)) / (1 + c)
        lo, hi = np.clip(mid - half, 0.0, 1.0), np.clip(mid + half, 0.0, 1.0)
    bad = ~(n > 0)
    return np.where(bad, np.nan, lo), np.where(bad, np.nan, hi)


def random_subspace(rng: np.random.Generator, d: int, k: int) -> np.ndarray:
    """A uniformly random k-dimensional subspace of R^d as an orthonormal basis (d, k): the
    Haar draw (:func:`~powerlens._src.dynamics.linalg.haar`) of a Gaussian (d, k) from ``rng``."""
    return haar(rng.standard_normal((d, k)))


def group_difference(values, in_group, *, max_exact: int = 200_000, samples: int = 100_000, seed: int = 0):
    """Mean of ``values`` "float[L]" over the layers ``in_group`` "bool[L]" minus the mean over
    the others, and its two-sided permutation p-value: the share of the C(L, k) ways of
    choosing k = sum(in_group) layers whose |difference of means| is at least the observed
    one (exact when C(L, k) <= ``max_exact``, else ``samples`` random choices with ``seed``,
    counted with the observed split: p >= 1/(samples + 1)). NaN values are dropped first.

    Returns ``(difference, p_value)``; both NaN when either group is empty after dropping.
    Under the null (the group labels carry no information) every split is equally likely, so
    p is the exact probability of a difference this large: with L = 18 layers and k = 3 of
    them holding the three largest values, p = 2/816 when no other split ties.
    """
    v = np.asarray(values, float)
    g = np.asarray(in_group, bool)
    if v.shape != g.shape or v.ndim != 1:
        raise ValueError(f"values {v.shape} and in_group {g.shape} must be the same 1-D shape")
    keep = np.isfinite(v)
    v, g = v[keep], g[keep]
    L, k = v.size, int(g.sum())
    if k == 0 or k == L:
        return float("nan"), float("nan")
    total = v.sum()
    diff = lambda s: s / k - (total - s) / (L - k)       # from the group's sum s
    observed = diff(v[g].sum())
    tol = 1e-12 * max(1.0, np.abs(v).max())
    if math.comb(L, k) <= max_exact:
        sums = np.fromiter((v[list(c)].sum() for c in itertools.combinations(range(L), k)), float,
                           count=math.comb(L, k))
        return float(observed), float(np.mean(np.abs(diff(sums)) >= abs(observed) - tol))
    rng = np.random.default_rng(seed)
    sums = np.array([v[rng.choice(L, k, replace=False)].sum() for _ in range(samples)])
    hits = np.sum(np.abs(diff(sums)) >= abs(observed) - tol) + 1
    return float(observed), float(hits / (samples + 1))
