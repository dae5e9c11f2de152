"""Dense linear algebra for building systems inside a compiled program, without LAPACK.

On CPUs ``jnp.linalg.qr`` / ``solve`` lower to LAPACK custom calls that split a batch over
XLA's intra-op thread pool and wait for it from a thread of that same pool: two such calls
running at once (two independent ops of one program, or two devices) can take every pool
thread and wait for each other forever (seen with 2 cores: a sweep hung at 0 % CPU). These
are plain ``jnp`` loops (``lax.fori_loop``), one matrix at a time; vmap them. O(d^3) each,
like LAPACK, and the same everywhere (CPU, GPU, TPU).

    haar_q(G "float[d d]")                  -> Q "float[d d]" (QR with diag R > 0: Haar for Gaussian G)
    solve(A "float[d d]", B "float[d m]")   -> A^-1 B (Gauss-Jordan, partial pivoting)
    gram_schmidt(A "float[d k]", keep)      -> orthonormal columns (k small and static)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def haar_q(G):
    """Q of the QR factorisation of G with a positive diagonal of R (Householder): for a
    Gaussian G, Q is Haar-distributed (the same Q as ``qr`` followed by the sign fix)."""
    d = G.shape[0]
    rows = jnp.arange(d)

    def step(j, carry):
        R, Q = carry
        x = jnp.where(rows >= j, R[:, j], 0.0)
        alpha = -jnp.where(x[j] >= 0, 1.0, -1.0) * jnp.linalg.norm(x)
        v = x - alpha * (rows == j)
        nv = jnp.linalg.norm(v)
        v = jnp.where(nv > 0, v / jnp.where(nv > 0, nv, 1.0), 0.0)
        R = R - 2.0 * jnp.outer(v, v @ R)
        Q = Q - 2.0 * jnp.outer(Q @ v, v)
        return R, Q

    eye = jnp.eye(d, dtype=G.dtype) + jnp.zeros_like(G)       # varies like G (inside shard_map)
    R, Q = jax.lax.fori_loop(0, d, step, (G, eye))
    return Q * jnp.where(jnp.diag(R) < 0, -1.0, 1.0)


def solve(A, B):
    """A^-1 B for A "float[d d]", B "float[d m]" by Gauss-Jordan elimination with partial pivoting."""
    d = A.shape[0]
    rows = jnp.arange(d)

    def step(j, M):
        col = jnp.where(rows >= j, jnp.abs(M[:, j]), -1.0)
        p = jnp.argmax(col)
        swap = jnp.where(rows == j, p, jnp.where(rows == p, j, rows))
        M = M[swap]
        pivot = M[j] / M[j, j]
        M = M - jnp.outer(jnp.where(rows == j, 0.0, M[:, j]), pivot)
        return M.at[j].set(pivot)

    M = jax.lax.fori_loop(0, d, step, jnp.concatenate([A, B], axis=1))
    return M[:, d:]


def gram_schmidt(A, keep):
    """Orthonormal basis "float[d k]" of the leading columns of A "float[d k]" that ``keep``
    (a prefix mask), twice-orthogonalised; the other columns are zero."""
    cols = []
    tiny = jnp.finfo(A.dtype).tiny
    for j in range(A.shape[1]):
        v = A[:, j]
        for _ in range(2):
            for q in cols:
                v = v - jnp.dot(q, v) * q
        n = jnp.linalg.norm(v)
        cols.append(jnp.where(keep[j] & (n > 0), v / jnp.maximum(n, tiny), 0.0))
    return jnp.stack(cols, axis=1)
