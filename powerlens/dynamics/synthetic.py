"""Synthetic systems with a prescribed spectrum (host-side NumPy, seedable).

    F = Q D Q^T               kind="symmetric"   (real spectrum only)
    F = Q blockdiag(D) Q^T    kind="normal"      complex pairs a +- bj as [[a, b], [-b, a]]
    F = S blockdiag(D) S^-1   kind="nonnormal"   S = I + s G / sqrt(d), G Gaussian

Q is Haar-random orthogonal. ``F`` is split into H heads, F = sum_h O_h V_h, by
drawing V_cat (H e, d) of full column rank and setting W_o = F V_cat^+. Queries and
keys are Gaussian with scale beta / sqrt(e): beta is the inverse temperature.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import numpy as np

from .params import LayerConfig, Layers, check_steps, make_layers
from .schedule import Schedule

KINDS = ("symmetric", "normal", "nonnormal")


def parse_spectrum(text: str) -> List[complex]:
    """Parse ``"3,1.5+0.5j,-2"``; a complex entry stands for its conjugate pair."""
    out = []
    for tok in text.split(","):
        tok = tok.strip().replace(" ", "")
        if not tok:
            raise ValueError(f"empty entry in spectrum {text!r}")
        try:
            z = complex(tok)
        except ValueError:
            raise ValueError(f"cannot parse eigenvalue {tok!r} in spectrum {text!r} (use e.g. 0.5+1.2j)") from None
        if not np.isfinite(z.real) or not np.isfinite(z.imag):
            raise ValueError(f"eigenvalue {tok!r} is not finite")
        out.append(z)
    return out


def _size(eigs: Sequence[complex]) -> int:
    return sum(2 if abs(z.imag) > 0 else 1 for z in eigs)


def _blocks(eigs: Sequence[complex], d: int) -> np.ndarray:
    D = np.zeros((d, d))
    i = 0
    for z in eigs:
        if abs(z.imag) > 0:
            D[i:i + 2, i:i + 2] = [[z.real, abs(z.imag)], [-abs(z.imag), z.real]]
            i += 2
        else:
            D[i, i] = z.real
            i += 1
    return D


def haar_orthogonal(rng: np.random.Generator, d: int) -> np.ndarray:
    Q, R = np.linalg.qr(rng.standard_normal((d, d)))
    return Q * np.sign(np.diag(R))


def spectrum_matrix(eigenvalues: Iterable[complex], *, kind: str = "symmetric", d: Optional[int] = None,
                    rng: Optional[np.random.Generator] = None, nonnormality: float = 1.0) -> np.ndarray:
    """A real (d, d) matrix with the given eigenvalues (zeros fill up to d)."""
    eigs = [complex(z) for z in eigenvalues]
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    if not eigs:
        raise ValueError("spectrum is empty")
    need = _size(eigs)
    d = need if d is None else int(d)
    if d < need:
        raise ValueError(f"spectrum needs dimension >= {need} (complex entries count twice), got d={d}")
    if kind == "symmetric" and any(abs(z.imag) > 0 for z in eigs):
        raise ValueError("kind 'symmetric' needs a real spectrum; use 'normal' or 'nonnormal' for complex pairs")
    rng = np.random.default_rng(0) if rng is None else rng
    D = _blocks(eigs, d)
    if kind in ("symmetric", "normal"):
        Q = haar_orthogonal(rng, d)
        return Q @ D @ Q.T
    S = np.eye(d) + nonnormality * rng.standard_normal((d, d)) / np.sqrt(d)
    return S @ D @ np.linalg.inv(S)


def split_heads(F: np.ndarray, n_heads: int, rng: np.random.Generator, d_head: Optional[int] = None):
    """W_v (H, e, d) and W_o (d, H e) with W_o @ concat_h(W_vh) = F exactly (to rounding)."""
    d = F.shape[0]
    e = int(d_head) if d_head is not None else -(-d // n_heads)
    if n_heads * e < d:
        raise ValueError(f"{n_heads} heads of size {e} cannot carry a rank-{d} F (need H*d_head >= d)")
    V = rng.standard_normal((n_heads * e, d)) / np.sqrt(d)
    W_o = F @ np.linalg.pinv(V)
    return V.reshape(n_heads, e, d), W_o


def random_queries_keys(rng: np.random.Generator, d: int, n_heads: int, d_head: int):
    """Gaussian W_q, W_k (H, e, d): for unit tokens q.k has unit variance per coordinate."""
    return rng.standard_normal((2, n_heads, d_head, d))


def synthetic_system(eigenvalues, *, kind: str = "symmetric", heads: int = 1, beta: float = 1.0,
                     d: Optional[int] = None, seed: int = 0, steps: Optional[int] = None,
                     d_head: Optional[int] = None, F: Optional[np.ndarray] = None,
                     dtype=np.float32) -> Layers:
    """A one-layer (shared-weight) system with F of the given spectrum.

    ``steps`` sets the schedule to that layer repeated ``steps`` times (``Schedule.repeat``).
    """
    if heads <= 0:
        raise ValueError(f"heads must be positive, got {heads}")
    if not np.isfinite(beta):
        raise ValueError(f"beta must be finite, got {beta}")
    rng = np.random.default_rng(seed)
    if F is None:
        F = spectrum_matrix(eigenvalues, kind=kind, d=d, rng=rng)
    d = F.shape[0]
    W_v, W_o = split_heads(F, heads, rng, d_head)
    e = W_v.shape[1]
    W_q, W_k = random_queries_keys(rng, d, heads, e)
    cfg = LayerConfig(d_model=d, n_heads=heads, d_head=e, norm="l2",
                      schedule=None if steps is None else Schedule.repeat(0, check_steps(steps)))
    return make_layers(W_v[None].astype(dtype), W_o[None].astype(dtype), W_q=W_q[None].astype(dtype),
                       W_k=W_k[None].astype(dtype), scale=beta / np.sqrt(e), config=cfg)


# --------------------------------------------------------------------- initial tokens

def sphere_tokens(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """n tokens uniform on the unit sphere of R^d: (n, d)."""
    x = rng.standard_normal((n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def cone_tokens(rng: np.random.Generator, n: int, v: np.ndarray, angle: float) -> np.ndarray:
    """n unit tokens at angle ``angle`` (radians; a scalar, or (n, 1) for tokens inside a cone) from unit v."""
    v = np.asarray(v, float)
    v = v / np.linalg.norm(v)
    g = rng.standard_normal((n, v.size))
    g -= np.outer(g @ v, v)
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    return np.cos(angle) * v[None] + np.sin(angle) * g


def bipartite_tokens(rng: np.random.Generator, n: int, v: np.ndarray, *, noise: float = 0.0,
                     n_plus: Optional[int] = None) -> np.ndarray:
    """n_plus tokens near +v and n - n_plus near -v (unit, Gaussian noise of size ``noise``)."""
    v = np.asarray(v, float)
    v = v / np.linalg.norm(v)
    n_plus = n // 2 if n_plus is None else int(n_plus)
    s = np.where(np.arange(n) < n_plus, 1.0, -1.0)
    x = s[:, None] * v[None] + noise * rng.standard_normal((n, v.size))
    return x / np.linalg.norm(x, axis=1, keepdims=True)
