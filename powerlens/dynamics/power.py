"""The power method itself, as ``lax.scan`` loops (runs on any accelerator).

    power_iteration      v <- (F + shift I) v / ||(F + shift I) v||   (shift = 1: the
                         shifted ordering, i.e. what the residual token dynamics does)
    subspace_iteration   Q <- qr((F + shift I) Q), Q (d, k); with k = 2 a dominant complex
                         pair comes back as a real orthonormal basis of its plane.

``top_pair_eigenvalues`` reads the pair's eigenvalues off the 2x2 block Q^T F Q in
closed form, so nothing here needs ``jnp.linalg.eig`` (CPU-only).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def power_iteration(F, v0, steps: int, *, shift: float = 0.0):
    """Return (v_T, history) with history (T, d) of the iterates v_1..v_T.

    Plain power method for ``shift = 0`` (ordering by |lambda|), shifted for
    ``shift = 1`` (ordering by |1 + lambda|).
    """
    A = F + shift * jnp.eye(F.shape[0], dtype=F.dtype)

    def body(v, _):
        w = A @ v
        w = w / jnp.linalg.norm(w)
        return w, w

    v0 = v0 / jnp.linalg.norm(v0)
    return jax.lax.scan(body, v0, None, length=steps)


def rayleigh_quotient(F, v):
    """v^T F v / v^T v (the eigenvalue estimate for a real dominant eigenvector)."""
    return jnp.vdot(v, F @ v) / jnp.vdot(v, v)


def _qr_pos(Y):
    Q, R = jnp.linalg.qr(Y)
    s = jnp.sign(jnp.diagonal(R))
    s = jnp.where(s == 0, 1.0, s)
    return Q * s


def subspace_iteration(F, Q0, steps: int, *, shift: float = 0.0):
    """Block power iteration: returns the orthonormal basis Q (d, k) after ``steps``."""
    A = F + shift * jnp.eye(F.shape[0], dtype=F.dtype)

    def body(Q, _):
        return _qr_pos(A @ Q), None

    Q, _ = jax.lax.scan(body, _qr_pos(Q0), None, length=steps)
    return Q


def top_pair_eigenvalues(F, Q):
    """Eigenvalues of the 2x2 restriction T = Q^T F Q (complex (2,), larger Im first)."""
    T = Q.T @ F @ Q
    tr = T[0, 0] + T[1, 1]
    det = T[0, 0] * T[1, 1] - T[0, 1] * T[1, 0]
    disc = (tr * tr / 4 - det).astype(jnp.complex64 if F.dtype == jnp.float32 else jnp.complex128)
    r = jnp.sqrt(disc)
    lam = jnp.stack([tr / 2 + r, tr / 2 - r])
    return lam[jnp.argsort(-lam.imag)]


def dominant_plane(F, key, steps: int = 500, *, shift: float = 1.0):
    """Real orthonormal basis (d, 2) of the dominant 2-D invariant subspace and its eigenvalues."""
    Q0 = jax.random.normal(key, (F.shape[0], 2), F.dtype)
    Q = subspace_iteration(F, Q0, steps, shift=shift)
    return Q, top_pair_eigenvalues(F, Q)
