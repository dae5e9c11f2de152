"""The LAPACK-free dense linear algebra a sweep builds its systems with, defined once in
:mod:`powerlens._src.dynamics.linalg` (where the synthetic systems are built) and named here for
the sweep modules:

    haar_q(G "float[d d]")                  -> Q "float[d d]" (QR with diag R > 0: Haar for Gaussian G)
    solve(A "float[d d]", B "float[d m]")   -> (A^-1 B, singular) (Gauss-Jordan, partial pivoting,
                                               a guard against a numerically zero pivot)
    gram_schmidt(A "float[d k]", keep)      -> orthonormal columns (k small and static)
"""
from __future__ import annotations

from ..dynamics.linalg import gram_schmidt, haar_q, solve

__all__ = ["gram_schmidt", "haar_q", "solve"]
