"""Synthetic systems with a prescribed spectrum.

    F = Q D Q^T               kind="symmetric"   (real spectrum only)
    F = Q blockdiag(D) Q^T    kind="normal"      complex pairs a +- bj as [[a, b], [-b, a]]
    F = S blockdiag(D) S^-1   kind="nonnormal"   S = I + s G / sqrt(d), G Gaussian

Q is Haar-random orthogonal (:func:`powerlens.dynamics.linalg.haar`). ``F`` is split into H
heads of size e, F = sum_h O_h V_h, by drawing V_cat (H e, d) Gaussian and setting
W_o = F V_cat^+ (the head-split rule, design.md §1: H e >= d, so that a Gaussian V_cat has
full column rank and V_cat^+ V_cat = I; with H e = d, V_cat^+ = V_cat^-1). Queries and keys
are Gaussian with scale beta / sqrt(e): beta is the inverse temperature.

Two entry points build such a system:

* :func:`synthetic` -- pure ``jnp``, from a seed and the grid values alone (jit and vmap it):
  the builder of every synthetic sweep row, which returns the system with its spectral facts
  (the spectrum in both orderings, the eigen-groups, the oriented principal plane, the
  initial tokens);
* :func:`synthetic_system` -- host NumPy from a ``numpy`` seed, for a given spectrum list or F.

Initial tokens (:func:`sphere`, :func:`cone`, :func:`bipartite`) are one formula each on
given normal draws, NumPy or ``jnp``; ``sphere_tokens`` and friends draw them with a
``numpy`` generator.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .linalg import array_module, gram_schmidt, group_size, haar, haar_q, orient_plane, solve
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
    """A Haar-random orthogonal (d, d) matrix drawn with ``rng``."""
    return haar(rng.standard_normal((d, d)))


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

def _unit_rows(x):
    return x / array_module(x).linalg.norm(x, axis=-1, keepdims=True)


def sphere(g):
    """Tokens uniform on the unit sphere from Gaussian draws g "float[n d]"."""
    return _unit_rows(g)


def cone(g, axis, angle):
    """Unit tokens at angle ``angle`` (a scalar or "float[n 1]") from the unit ``axis``
    "float[d]" (normalised here), in the directions of the Gaussian draws g "float[n d]"
    projected off it."""
    xp = array_module(g)
    a = axis / xp.linalg.norm(axis)
    g = _unit_rows(g - xp.outer(g @ a, a))
    return xp.cos(angle) * a + xp.sin(angle) * g


def bipartite(g, v, noise, n_plus):
    """(tokens, exact start) "float[n d]" x2: the first ``n_plus`` near +v, the others near -v
    (v unit), Gaussian draws g "float[n d]" of size ``noise`` added and each token normalised;
    the exact start is +-v itself."""
    xp = array_module(g)
    s = xp.where(xp.arange(g.shape[0]) < n_plus, 1.0, -1.0).astype(g.dtype)[:, None]
    exact = s * v[None]
    return _unit_rows(exact + noise * g), exact


def sphere_tokens(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """n tokens uniform on the unit sphere of R^d: (n, d)."""
    return sphere(rng.standard_normal((n, d)))


def cone_tokens(rng: np.random.Generator, n: int, v: np.ndarray, angle: float) -> np.ndarray:
    """n unit tokens at angle ``angle`` (radians; a scalar, or (n, 1) for tokens inside a cone) from unit v."""
    v = np.asarray(v, float)
    return cone(rng.standard_normal((n, v.size)), v, angle)


def bipartite_tokens(rng: np.random.Generator, n: int, v: np.ndarray, *, noise: float = 0.0,
                     n_plus: Optional[int] = None) -> np.ndarray:
    """n_plus tokens near +v and n - n_plus near -v (unit, Gaussian noise of size ``noise``)."""
    v = np.asarray(v, float)
    v = v / np.linalg.norm(v)
    n_plus = n // 2 if n_plus is None else int(n_plus)
    return bipartite(rng.standard_normal((n, v.size)), v, noise, n_plus)[0]


# --------------------------------------------------------------------- one system from its seed

@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """The static shape of a synthetic system (hashable: jit treats it as static).

    d, tokens, heads: width, number of tokens, heads (head size e = d // heads, H e = d);
    kind: one of :data:`KINDS`; spectrum: a spectrum text (:func:`parse_spectrum`, zeros fill up
    to d) or ``"random"`` (drawn from the ranges ``top``, ``rest``, ``imag`` and the chance
    ``pair``); init: ``"sphere"``, ``"cone"`` or ``"bipartite"``; steps: T, the shared layer's
    repeats; order: ``"shifted"`` or ``"plain"``, the ordering of ``facts["principal"]``.
    """

    d: int
    tokens: int
    heads: int
    kind: str = "symmetric"
    spectrum: str = "random"
    init: str = "sphere"
    steps: int = 1
    order: str = "shifted"
    x64: bool = False

    @property
    def dtype(self):
        return jnp.float64 if self.x64 else jnp.float32


def _draws(key, shapes: Dict[str, Tuple[int, ...]], dt, sampler):
    """One call of ``sampler`` for all the named shapes (a single PRNG kernel to compile), split."""
    sizes = [int(np.prod(s)) for s in shapes.values()]
    flat = sampler(key, (sum(sizes),), dt)
    out, i = {}, 0
    for (name, shape), size in zip(shapes.items(), sizes):
        out[name] = flat[i:i + size].reshape(shape)
        i += size
    return out


def _slots(u, p, cfg: SyntheticConfig, dt):
    """The eigenvalue of every slot of D: (re, im, pair_start) "float[d]" x2, "bool[d]";
    ``u`` "float[d+3]" uniform draws for a random spectrum."""
    d = cfg.d
    if cfg.spectrum != "random":
        re, im, start = [], [], []
        for z in parse_spectrum(cfg.spectrum):
            if z.imag:
                re += [z.real, z.real]
                im += [abs(z.imag), -abs(z.imag)]
                start += [True, False]
            else:
                re.append(z.real)
                im.append(0.0)
                start.append(False)
        pad = d - len(re)
        return (jnp.asarray(re + [0.0] * pad, dt), jnp.asarray(im + [0.0] * pad, dt),
                jnp.asarray(start + [False] * pad))
    lo_hi = lambda r, x: r[0] + (r[1] - r[0]) * x
    top = lo_hi(p["top"], u[0])
    rest = lo_hi(p["rest"], u[3:])
    real_re = jnp.concatenate([top[None], rest[: d - 1]])
    if cfg.kind == "symmetric" or d < 2:          # a symmetric F has no complex pair, whatever ``pair`` says
        return real_re, jnp.zeros(d, dt), jnp.zeros(d, bool)
    is_pair = u[1] < p["pair"]
    b = lo_hi(p["imag"], u[2])
    pair_re = jnp.concatenate([top[None], top[None], rest[: d - 2]])
    pair_im = jnp.zeros(d, dt).at[0].set(b).at[1].set(-b)
    first = jnp.zeros(d, bool).at[0].set(True)
    return (jnp.where(is_pair, pair_re, real_re), jnp.where(is_pair, pair_im, 0.0), first & is_pair)


def eigen_groups(lam_re, lam_im, keys):
    """The slots sorted by decreasing key, the principal group and the next one.

    Returns (order "int[d]", dim1, dim2, lam "float[3 2]") for slot eigenvalues
    lam_re + i lam_im with keys "float[d]" (groups: :func:`~powerlens.dynamics.linalg.group_size`):
    lambda_1, lambda_2 (the first eigenvalue after the principal group), lambda_3 (the first
    after lambda_2's group), each (re, |im|), NaN when absent."""
    d = keys.shape[0]
    order = jnp.argsort(-keys, stable=True)
    ks = keys[order]
    dim1 = group_size(ks, 0)
    dim2 = group_size(ks, dim1)

    def pick(pos):
        i = order[jnp.minimum(pos, d - 1)]
        ok = pos < d
        return jnp.where(ok, jnp.stack([lam_re[i], jnp.abs(lam_im[i])]), jnp.nan)

    lam = jnp.stack([pick(0), pick(dim1), pick(dim1 + dim2)])
    return order, dim1, dim2, lam


def head_split(F, V):
    """W_o "float[d H e]" with W_o V = F for V "float[H e d]" of full column rank (H e >= d):
    W_o = F V^+, the least-squares split; V^-1 when H e = d (LAPACK-free: :func:`solve`).
    A numerically rank-deficient V (solve's pivot guard) gives a NaN W_o: no such split exists,
    and a run of the system is non-finite (a sweep row reads ``finite`` False, measures null)."""
    if V.shape[0] == V.shape[1]:
        X, singular = solve(V.T, F.T)
        W_o = X.T                                                   # F V^-1
    else:
        X, singular = solve(V.T @ V, V.T)
        W_o = F @ X                                                 # F (V^T V)^-1 V^T
    return jnp.where(singular, jnp.nan, W_o)


def _basis(E, cols, keep, orthogonal: bool):
    """Orthonormal basis "float[d k]" of the columns ``cols`` of E that ``keep`` (a prefix
    mask); the others are zero. ``orthogonal``: E's columns already are."""
    A = E[:, cols]
    return A * keep if orthogonal else gram_schmidt(A, keep)


def synthetic(seed, values: Dict[str, Any], cfg: SyntheticConfig):
    """One synthetic system from its seed "int[]" and grid values alone. Pure ``jnp``: jit and
    vmap it (the sweep engine vmaps it over a chunk's systems; :func:`powerlens.sweeps.api.sweep_system`
    calls it for one row).

    Args:
      seed: the system's seed (a sweep row's ``seed``).
      values: the dynamic values ``beta``, ``nonnormality``, ``cone``, ``noise`` (scalars) and,
        for ``spectrum = "random"``, ``top``, ``rest``, ``imag`` ("float[2]" ranges) and ``pair``.
      cfg: the static shape (:class:`SyntheticConfig`).

    Returns:
      ``(layers, facts)``: a one-layer :class:`Layers` repeated ``cfg.steps`` times, and a dict

        eigenvalues    "float[d 2]"  (re, im) of every eigenvalue of F (the slots of D)
        shifted, plain "int[d]"      the slots by decreasing |1 + lambda|, by decreasing |lambda|
        lam            "float[3 2]"  lambda_1, lambda_2, lambda_3 in the shifted order (NaN if absent)
        lam_plain      "float[3 2]"  the same in the plain order
        dim, dim_plain "int[]"       size of the principal group in each order
        direction      "float[d k1]" orthonormal basis of the shifted principal group (k1 = min(d, 2),
                                     zero-padded); a complex pair's plane oriented by
                                     :func:`~powerlens.dynamics.linalg.orient_plane`
        principal      "float[d k1]" the principal basis in ``cfg.order`` (its size: principal_dim)
        top2           "float[d k2]" basis of the shifted principal and next groups (k2 = min(d, 4))
        random         "float[d k1]" a random control basis of principal_dim columns
        v1             "float[d]"    the principal direction where it is one real direction, else 0
        x0             "float[n d]"  the initial tokens (``cfg.init``)
        x0_exact       "float[n d]"  the exact bipartite start +-v1 (None unless init is bipartite)

      The spectrum is known by construction: no ``eig`` is taken.
    """
    dt = cfg.dtype
    d, H, n = cfg.d, cfg.heads, cfg.tokens
    e = d // H
    k1, k2 = min(d, 2), min(d, 4)
    k_normal, k_uniform = jax.random.split(jax.random.key(seed))
    z = _draws(k_normal, {"basis": (d, d), "value": (H * e, d), "qk": (2, H, e, d), "random": (d, k1),
                          "axis": (d,), "tokens": (n, d)}, dt, jax.random.normal)
    u = _draws(k_uniform, {"spectrum": (d + 3,), "angle": (n, 1)}, dt, jax.random.uniform)
    re, im, start = _slots(u["spectrum"], values, cfg, dt)
    sup = jnp.where(start[:-1], jnp.abs(im[:-1]), 0.0)
    D = jnp.diag(re) + jnp.diag(sup, 1) - jnp.diag(sup, -1)
    if cfg.kind == "nonnormal":
        E = jnp.eye(d, dtype=dt) + values["nonnormality"] * z["basis"] / np.sqrt(d)
        X, singular = solve(E.T, (E @ D).T)
        F = jnp.where(singular, jnp.nan, X.T)                       # S D S^-1 (NaN: E singular)
    else:
        E = haar_q(z["basis"])
        F = E @ D @ E.T
    V = z["value"] / np.sqrt(d)
    W_o = head_split(F, V)
    W_q, W_k = z["qk"]
    config = LayerConfig(d_model=d, n_heads=H, d_head=e, norm="l2", schedule=Schedule.repeat(0, cfg.steps))
    layers = Layers(W_q=W_q[None], W_k=W_k[None], W_v=V.reshape(H, e, d)[None], W_o=W_o[None],
                    scale=jnp.full((1,), values["beta"] / np.sqrt(e), dt), window=jnp.zeros((1,), jnp.int32),
                    config=config)

    order, dim1, dim2, lam = eigen_groups(re, im, jnp.hypot(1.0 + re, im))
    porder, dim_plain, _, lam_plain = eigen_groups(re, im, jnp.hypot(re, im))
    orth = cfg.kind != "nonnormal"
    B = _basis(E, order[:k1], jnp.arange(k1) < dim1, orth)
    if k1 == 2:                                 # orient a complex-pair plane: I + F turns it counter-clockwise
        B = orient_plane(B, F, (dim1 == 2) & (lam[0, 1] > 0))
    top2 = _basis(E, order[:k2], jnp.arange(k2) < dim1 + dim2, orth)
    if cfg.order == "shifted":
        P, pdim = B, dim1
    else:
        P, pdim = _basis(E, porder[:k1], jnp.arange(k1) < dim_plain, orth), dim_plain
    rand = gram_schmidt(z["random"], jnp.arange(k1) < pdim)
    x0, exact = _tokens(z, u, values, cfg, B[:, 0])
    facts = {"eigenvalues": jnp.stack([re, im], axis=1), "shifted": order, "plain": porder, "lam": lam,
             "lam_plain": lam_plain, "dim": dim1.astype(jnp.int32), "dim_plain": dim_plain.astype(jnp.int32),
             "direction": B, "principal": P, "principal_dim": pdim.astype(jnp.int32), "top2": top2,
             "random": rand, "v1": B[:, 0] * (dim1 == 1), "x0": x0, "x0_exact": exact}
    return layers, facts


def _tokens(z, u, values, cfg: SyntheticConfig, v):
    """Initial tokens "float[n d]" (and the exact bipartite start, or None) from the normal
    draws ``z["axis"]``, ``z["tokens"]`` and the uniform ``u["angle"]``: sphere, cone of
    half-angle ``values["cone"]`` around a random axis, or +-v + noise."""
    g = z["tokens"]
    if cfg.init == "sphere":
        return sphere(g), None
    if cfg.init == "cone":
        return cone(g, z["axis"], u["angle"] * values["cone"]), None
    return bipartite(g, v, values["noise"], cfg.tokens // 2)
