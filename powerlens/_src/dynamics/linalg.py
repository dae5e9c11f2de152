"""Small dense linear algebra shared by the synthetic systems, the sweeps and the spectra.

One definition of each of these, usable from NumPy (host) and ``jnp`` (inside a compiled
program; the array module follows the argument, as in
:func:`powerlens._src.dynamics.measures.mean_angle`):

    haar(G "float[d k]")                    -> Q "float[d k]", the Q of G = Q R with diag R > 0:
                                               for a Gaussian G, k Haar-random orthonormal columns
    pow2_scale(a)                           2^e with a / 2^e in [1/2, 1): dividing by it is exact
    scaled_norm(v "float[... d]")           ||v|| along the last axis, never squaring a large entry
    GROUP_RTOL                              the relative tolerance of an eigenvalue group
    group_size(keys, start)                 how many of the decreasing keys from ``start`` on are
                                            in the group of keys[start]
    orient_plane(B "float[d 2]", F)         the plane's basis oriented so that F turns it
                                            counter-clockwise

The ``jnp`` Householder QR and the other two routines below avoid LAPACK. On CPUs
``jnp.linalg.qr`` / ``solve`` lower to LAPACK custom calls that split a batch over XLA's
intra-op thread pool and wait for it from a thread of that same pool: two such calls running
at once (two independent ops of one program, or two devices) can take every pool thread and
wait for each other forever (seen with 2 cores: a sweep hung at 0 % CPU). These are plain
``jnp`` loops (``lax.fori_loop``), one matrix at a time; vmap them. O(d^3) each, like LAPACK,
and the same everywhere (CPU, GPU, TPU).

    haar_q(G "float[d k]")                  -> Q "float[d k]" (thin QR with diag R > 0: Haar for Gaussian G)
    solve(A "float[d d]", B "float[d m]")   -> (A^-1 B, singular) (Gauss-Jordan, partial pivoting,
                                               a guard against a numerically zero pivot)
    gram_schmidt(A "float[d k]", keep)      -> orthonormal columns (k small and static)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP_RTOL = 1e-4
"""Eigenvalues whose ordering keys (|1 + lambda| shifted, |lambda| plain) lie within this
relative tolerance (and 1e-12 absolute) of a group's first key belong to that group: a
complex pair, a repeated or a near-repeated eigenvalue is one group, never one arbitrary
eigenvector."""


def array_module(a):
    """``jnp`` for a JAX array (a tracer included), else NumPy."""
    return jnp if isinstance(a, jax.Array) else np


def haar(G):
    """The Q "float[d k]" of G "float[d k]" = Q R with a positive diagonal of R (k <= d): for a
    Gaussian G, k orthonormal columns of a Haar-random orthogonal matrix (a uniformly random
    k-dimensional subspace). NumPy: ``qr`` (reduced) and the sign fix; ``jnp``: :func:`haar_q`.
    Both give the same Q (the thin QR with diag R > 0 is unique for G of rank k)."""
    _check_thin(G, "haar")
    if array_module(G) is jnp:
        return haar_q(G)
    Q, R = np.linalg.qr(G)
    return Q * np.sign(np.diag(R))


def _check_thin(G, what: str) -> None:
    if G.ndim != 2 or G.shape[1] > G.shape[0] or G.shape[1] == 0:
        raise ValueError(f"{what}: G must be \"float[d k]\" with 1 <= k <= d, got shape {tuple(G.shape)}")


def pow2_scale(a):
    """2^e with a / 2^e in [1/2, 1) for a > 0 (1 for a = 0; inf and NaN pass through as
    themselves, so that they poison what they scale): dividing by it is exact. NumPy or ``jnp``."""
    xp = array_module(a)
    _, e = xp.frexp(a)
    return xp.where(xp.isfinite(a), xp.where(a > 0, xp.ldexp(xp.ones_like(a), e), 1.0), a)


def scaled_norm(v, axis: int = -1, small: bool = True):
    """||v|| along ``axis`` "float[...]" for any finite v. The plain sqrt(sum v_i^2) wherever
    that is accurate (no square overflowed: the sum is finite; and with ``small``, none that
    matters underflowed: the norm is at least sqrt(m tiny / eps), m entries), so there the
    result is the plain norm bit for bit; elsewhere (past ~1.8e19 in float32 the squares
    overflow, below ~1e-19 they flush to 0) v is first divided by c, the power of two near its
    largest |entry| (:func:`pow2_scale`, exact): ||v|| = c ||v / c||, whose squares are at
    most 1. ``small=False`` rescales only an overflowing norm. A non-finite entry gives inf or
    NaN. NumPy or ``jnp``."""
    xp = array_module(v)
    info = xp.finfo(v.dtype)
    floor = float(np.sqrt(v.shape[axis] * float(info.tiny) / float(info.eps))) if small else 0.0
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        n = xp.sqrt(xp.sum(v * v, axis=axis))
        c = pow2_scale(xp.max(xp.abs(v), axis=axis, keepdims=True))
        u = v / c
        scaled = xp.sqrt(xp.sum(u * u, axis=axis)) * xp.squeeze(c, axis)
    return xp.where(xp.isfinite(n) & (n >= floor), n, scaled)


def group_size(keys, start=0, rtol: float = GROUP_RTOL):
    """How many of the keys "float[m]" (sorted decreasing) from position ``start`` on lie in
    the group of keys[start]: key >= keys[start] (1 - rtol) - 1e-12. 0 when start >= m.
    ``start`` may be traced (``jnp``)."""
    xp = array_module(keys)
    m = keys.shape[-1]
    head = keys[xp.minimum(start, m - 1)]
    pos = xp.arange(m)
    return xp.sum((pos >= start) & (keys >= head * (1.0 - rtol) - 1e-12))


def orient_plane(B, F, flip=True):
    """B "float[d k]" (k >= 2) with its second column negated where ``flip`` holds and F turns
    the plane of its first two columns clockwise (T = B^T F B has T[1,0] - T[0,1] < 0), so
    that I + F rotates coordinates counter-clockwise, by arg(1 + lambda_1) with Im lambda_1 > 0."""
    xp = array_module(B)
    T = B[:, :2].T @ F @ B[:, :2]
    sign = xp.where(flip & (T[1, 0] - T[0, 1] < 0), -1.0, 1.0)
    if xp is np:
        out = B.copy()
        out[:, 1] *= sign
        return out
    return B.at[:, 1].multiply(sign)


def haar_q(G):
    """Q "float[d k]" of the thin QR factorisation G "float[d k]" = Q R (k <= d) with a positive
    diagonal of R (Householder: k reflections H_j, Q = H_1 ... H_k [I_k; 0]): for a Gaussian G,
    Q is Haar-distributed (the same Q as ``qr`` followed by the sign fix; k = d: a Haar-random
    orthogonal matrix)."""
    _check_thin(G, "haar_q")
    d, k = G.shape
    rows = jnp.arange(d)

    def step(j, carry):
        R, Q = carry
        x = jnp.where(rows >= j, R[:, j], 0.0)
        alpha = -jnp.where(x[j] >= 0, 1.0, -1.0) * scaled_norm(x)
        v = x - alpha * (rows == j)
        nv = scaled_norm(v)
        v = jnp.where(nv > 0, v / jnp.where(nv > 0, nv, 1.0), 0.0)
        R = R - 2.0 * jnp.outer(v, v @ R)
        Q = Q - 2.0 * jnp.outer(Q @ v, v)
        return R, Q

    eye = jnp.eye(d, dtype=G.dtype) + jnp.zeros_like(G[:, :1])     # varies like G (inside shard_map)
    R, Q = jax.lax.fori_loop(0, k, step, (G, eye))
    return Q[:, :k] * jnp.where(jnp.diag(R) < 0, -1.0, 1.0)


def solve(A, B):
    """(X, singular): X = A^-1 B for A "float[d d]", B "float[d m]" by Gauss-Jordan elimination
    with partial pivoting, and ``singular`` "bool[]".

    Pivot guard: A is numerically singular when a pivot (the largest remaining entry of its
    column) is at most ``d * eps * max|A|`` in magnitude (an exactly zero one
    included). Such a pivot is not divided by: its column is skipped, so X stays finite (it is
    then not a solution), and ``singular`` is True; the caller must mark what it builds from X
    (a sweep row: its run is made non-finite, so the row reads ``finite`` False, measures null).
    A nonsingular but ill-conditioned A is solved as before (error about cond(A) * eps)."""
    d = A.shape[0]
    rows = jnp.arange(d)
    tol = d * jnp.finfo(A.dtype).eps * jnp.max(jnp.abs(A))

    def step(j, carry):
        M, singular = carry
        col = jnp.where(rows >= j, jnp.abs(M[:, j]), -1.0)
        p = jnp.argmax(col)
        swap = jnp.where(rows == j, p, jnp.where(rows == p, j, rows))
        M = M[swap]
        small = jnp.abs(M[j, j]) <= tol
        pivot = M[j] / jnp.where(small, 1.0, M[j, j])
        M = M - jnp.outer(jnp.where(rows == j, 0.0, M[:, j]), pivot)
        return M.at[j].set(pivot), singular | small

    none = jnp.zeros_like(A[0, 0], dtype=bool)                 # varies like A (inside shard_map)
    M, singular = jax.lax.fori_loop(0, d, step, (jnp.concatenate([A, B], axis=1), none))
    return M[:, d:], singular


def gram_schmidt(A, keep):
    """Orthonormal basis "float[d k]" of the leading columns of A "float[d k]" that ``keep``
    (a prefix mask), twice-orthogonalised; the other columns are zero. Each column is divided by
    its norm taken scaled (:func:`scaled_norm`), so any finite A gives unit columns (the columns
    of S = I + s G / sqrt(d) with s past 1e19 overflow float32 when squared)."""
    cols = []
    tiny = jnp.finfo(A.dtype).tiny
    for j in range(A.shape[1]):
        v = A[:, j]
        for _ in range(2):
            for q in cols:
                v = v - jnp.dot(q, v) * q
        n = scaled_norm(v)
        cols.append(jnp.where(keep[j] & (n > 0), v / jnp.maximum(n, tiny), 0.0))
    return jnp.stack(cols, axis=1)
