"""Synthetic systems with a prescribed spectrum: one builder.

    F = Q D Q^T               kind="symmetric"   (real spectrum only)
    F = Q blockdiag(D) Q^T    kind="normal"      complex pairs a +- bj as [[a, b], [-b, a]]
    F = S blockdiag(D) S^-1   kind="nonnormal"   S = I + s G / sqrt(d), G Gaussian

Q is Haar-random orthogonal (:func:`powerlens._src.dynamics.linalg.haar_q`). ``F`` is split into H
heads of size e, F = sum_h O_h V_h, by drawing V_cat (H e, d) Gaussian and setting
W_o = F V_cat^+ (the head-split rule, :func:`head_split`: H e >= d, so that a Gaussian V_cat
has full column rank and V_cat^+ V_cat = I; with H e = d, V_cat^+ = V_cat^-1; fewer head
dimensions than d are refused). The head size defaults to e = ceil(d / H) (H e = d when H
divides d). Queries and keys are Gaussian with scale beta / sqrt(e): beta is the inverse
temperature.

One builder, :func:`synthetic`, pure ``jnp`` from a seed and the grid values alone (jit and
vmap it): the builder of every synthetic sweep row, which returns the system with its
spectral facts (the spectrum in both orderings, the eigen-groups, the oriented principal
plane, the initial tokens). :func:`synthetic_system` is that function jitted, for a given
spectrum list or F, its facts fetched to the host; :func:`spectrum_matrix` is its F.

Initial tokens (:func:`sphere`, :func:`cone`, :func:`bipartite`) are one formula each on
given normal draws, NumPy or ``jnp``; ``sphere_tokens`` and friends draw them with a
``numpy`` generator.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .linalg import array_module, gram_schmidt, group_size, haar_q, orient_plane, solve
from .params import LayerConfig, Layers, check_steps
from .parts import Attention, Norms
from .schedule import Schedule
from jaxtyping import ArrayLike, Float, Float64, Real

KINDS = ("symmetric", "normal", "nonnormal")
INITS = ("sphere", "cone", "bipartite")
NORMAL_MAX = {np.dtype(np.float32): 5.4199834, np.dtype(np.float64): 8.2923611}
"""The largest |draw| of ``jax.random.normal`` in each dtype, rounded up: sqrt(2) erfinv(u) at
its most extreme uniform u = nextafter(-1, 0) = -(1 - 2^-24) in float32, -(1 - 2^-53) in float64."""


def nonnormality_limit(d: int, scale: float, dtype) -> float:
    """The largest nonnormality s for which the nonnormal builder's S = I + s G / sqrt(d) and
    S D are finite in ``dtype`` for every draw G of ``jax.random.normal``: |G_ij| <= z_max
    (:data:`NORMAL_MAX`), so |S_ij| <= 1 + s z_max / sqrt(d), and a column of D holds at most
    an eigenvalue's real part and its |imaginary part|, so |(S D)_ij| <= max|S| ``scale`` with
    ``scale`` the largest |Re lambda| + |Im lambda| of the spectrum. Both below the largest
    float: s <= (fmax / max(scale, 1) - 1) sqrt(d) / z_max. (The basis of S's columns is
    normalised scaled, :func:`~powerlens._src.dynamics.linalg.gram_schmidt`, so it adds no bound;
    an elimination that still overflows makes F, and so the run, non-finite.)"""
    dt = np.dtype(dtype)
    fmax = float(np.finfo(dt).max)
    return (fmax / max(float(scale), 1.0) - 1.0) * float(np.sqrt(d)) / NORMAL_MAX[dt]


def noise_limit(d: int, dtype) -> float:
    """The largest ``noise`` of a bipartite start (+-v + noise G, v unit, each row then
    normalised) whose squared row norms stay finite in ``dtype`` for every normal draw G:
    |entry| <= 1 + noise z_max, so the row's sum of squares is at most d (1 + noise z_max)^2 <= fmax."""
    dt = np.dtype(dtype)
    return (float(np.sqrt(float(np.finfo(dt).max) / d)) - 1.0) / NORMAL_MAX[dt]


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


def check_spectrum(eigs: Sequence[complex], kind: str, d: Optional[int] = None) -> int:
    """The width d (default: the spectrum's size; complex entries count twice) after checking
    that ``kind`` is known, the spectrum is non-empty and finite, fits d, and is real for
    ``kind="symmetric"``: each a one-line ValueError."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    if not eigs:
        raise ValueError("spectrum is empty")
    if not all(np.isfinite(z.real) and np.isfinite(z.imag) for z in eigs):
        raise ValueError(f"spectrum {list(eigs)} is not finite")
    need = _size(eigs)
    d = need if d is None else int(d)
    if d < need:
        raise ValueError(f"spectrum needs dimension >= {need} (complex entries count twice), got d={d}")
    if kind == "symmetric" and any(abs(z.imag) > 0 for z in eigs):
        raise ValueError("kind 'symmetric' needs a real spectrum; use 'normal' or 'nonnormal' for complex pairs")
    return d


def spectrum_slots(eigs: Sequence[complex], d: int) -> np.ndarray:
    """The eigenvalue of every slot of D, "float64[d 2]" (re, im): a real entry one slot, a
    complex entry a +- bj two consecutive slots (a, |b|), (a, -|b|), zeros fill up to d (the
    layout of ``facts["eigenvalues"]`` of :func:`synthetic`)."""
    out = []
    for z in eigs:
        out += [(z.real, abs(z.imag)), (z.real, -abs(z.imag))] if z.imag else [(z.real, 0.0)]
    return np.array(out + [(0.0, 0.0)] * (d - len(out)), np.float64).reshape(d, 2)


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


def sphere_tokens(rng: np.random.Generator, n: int, d: int) -> Float[np.ndarray, "n d"]:
    """n tokens uniform on the unit sphere of R^d: (n, d)."""
    return sphere(rng.standard_normal((n, d)))


def cone_tokens(rng: np.random.Generator, n: int, v: Real[ArrayLike, "d"],
                angle: float | Real[ArrayLike, "n 1"]) -> Float[np.ndarray, "n d"]:
    """n unit tokens at angle ``angle`` (radians; a scalar, or (n, 1) for tokens inside a cone) from unit v."""
    v = np.asarray(v, float)
    return cone(rng.standard_normal((n, v.size)), v, angle)


def bipartite_tokens(rng: np.random.Generator, n: int, v: Real[ArrayLike, "d"], *, noise: float = 0.0,
                     n_plus: Optional[int] = None) -> Float[np.ndarray, "n d"]:
    """n_plus tokens near +v and n - n_plus near -v (unit, Gaussian noise of size ``noise``)."""
    v = np.asarray(v, float)
    v = v / np.linalg.norm(v)
    n_plus = n // 2 if n_plus is None else int(n_plus)
    return bipartite(rng.standard_normal((n, v.size)), v, noise, n_plus)[0]


# --------------------------------------------------------------------- one system from its seed

@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """The static shape of a synthetic system (hashable: jit treats it as static).

    d, tokens, heads: width, number of tokens, heads; d_head: the head size e (default
    ceil(d / heads), so H e = d when heads divide d; H e >= d is required, the head-split rule
    of :func:`head_split`); kind: one of :data:`KINDS`; spectrum: where the eigenvalues come from,

        a spectrum text  (:func:`parse_spectrum`, zeros fill up to d): static, compiled in
        "random"         drawn from the ranges ``values["top"]``, ``rest``, ``imag`` and the chance ``pair``
        "eigenvalues"    ``values["eigenvalues"]`` "float[d 2]", the slots of :func:`spectrum_slots`
                         (dynamic: one compiled program serves every spectrum of a shape)
        "given"          F itself, ``values["F"]`` "float[d d]" (no Q or S: the spectral facts are NaN)

    init: one of :data:`INITS`; steps: T, the shared layer's repeats; order: ``"shifted"`` or
    ``"plain"``, the ordering of ``facts["principal"]``; x64: float64 arrays.
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
    d_head: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; expected one of {KINDS}")
        if not isinstance(self.heads, (int, np.integer)) or self.heads <= 0:
            raise ValueError(f"heads must be positive, got {self.heads}")
        if self.d <= 0 or self.tokens <= 0:
            raise ValueError(f"d and tokens must be positive, got d={self.d}, tokens={self.tokens}")
        if self.d_head is not None and self.d_head <= 0:
            raise ValueError(f"d_head must be positive, got {self.d_head}")
        if self.heads * self.e < self.d:
            raise ValueError(f"{self.heads} heads of size {self.e} cannot carry a rank-{self.d} F "
                             f"(need H*d_head >= d)")
        if self.init not in INITS:
            raise ValueError(f"unknown init {self.init!r}; expected one of {INITS}")
        if self.spectrum == "given" and self.init == "bipartite":
            raise ValueError("init 'bipartite' needs the principal direction, unknown for a given F")
        if self.spectrum not in ("random", "eigenvalues", "given"):
            check_spectrum(parse_spectrum(self.spectrum), self.kind, self.d)

    @property
    def e(self) -> int:
        """The head size: ``d_head``, or ceil(d / heads)."""
        return int(self.d_head) if self.d_head is not None else -(-self.d // self.heads)

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
    ``u`` "float[d+3]" uniform draws for a random spectrum. A pair a +- bj fills two
    consecutive slots (a, |b|), (a, -|b|) and starts at the first (:func:`spectrum_slots`)."""
    d = cfg.d
    if cfg.spectrum == "given":
        nan = jnp.full(d, jnp.nan, dt)
        return nan, nan, jnp.zeros(d, bool)
    if cfg.spectrum != "random":
        slots = (jnp.asarray(spectrum_slots(parse_spectrum(cfg.spectrum), d), dt) if cfg.spectrum != "eigenvalues"
                 else jnp.asarray(p["eigenvalues"], dt))
        return slots[:, 0], slots[:, 1], slots[:, 1] > 0
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
    lam_re + i lam_im with keys "float[d]" (groups: :func:`~powerlens._src.dynamics.linalg.group_size`):
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


def _degenerate(basis, keep):
    """"bool[]": a basis "float[d k]" with a non-finite entry or a kept column that is zero
    (its columns overflowed, or were dependent): no subspace to measure against."""
    alive = jnp.max(jnp.abs(basis), axis=0) > 0
    return ~jnp.all(jnp.isfinite(basis)) | jnp.any(keep & ~alive)


def synthetic(seed, values: Dict[str, Any], cfg: SyntheticConfig):
    """One synthetic system from its seed "int[]" and grid values alone. Pure ``jnp``: jit and
    vmap it (the sweep engine vmaps it over a chunk's systems; :func:`powerlens._src.sweeps.api.sweep_system`
    calls it for one row).

    Args:
      seed: the system's seed (a sweep row's ``seed``).
      values: the dynamic values ``beta``, ``nonnormality``, ``cone``, ``noise`` (scalars) and,
        for ``spectrum = "random"``, ``top``, ``rest``, ``imag`` ("float[2]" ranges) and ``pair``;
        for ``"eigenvalues"``, ``eigenvalues`` "float[d 2]"; for ``"given"``, ``F`` "float[d d]".
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
                                     :func:`~powerlens._src.dynamics.linalg.orient_plane`
        principal      "float[d k1]" the principal basis in ``cfg.order`` (its size: principal_dim)
        top2           "float[d k2]" basis of the shifted principal and next groups (k2 = min(d, 4))
        random         "float[d k1]" a random control basis of principal_dim columns
        v1             "float[d]"    the principal direction where it is one real direction, else 0
        x0             "float[n d]"  the initial tokens (``cfg.init``)
        x0_exact       "float[n d]"  the exact bipartite start +-v1 (None unless init is bipartite)
        F              "float[d d]"  the layer matrix the heads carry (W_o V_cat = F to rounding)

      The spectrum is known by construction: no ``eig`` is taken. For ``spectrum = "given"`` it
      is not known: eigenvalues, lam, lam_plain, direction, principal, top2 and v1 are NaN, the
      dims 0 (take F's spectrum on the host, e.g. with
      :func:`powerlens._src.analysis.spectra.spectra_of` of the layers).
    """
    dt = cfg.dtype
    d, H, n = cfg.d, cfg.heads, cfg.tokens
    e = cfg.e
    k1, k2 = min(d, 2), min(d, 4)
    k_normal, k_uniform = jax.random.split(jax.random.key(seed))
    z = _draws(k_normal, {"basis": (d, d), "value": (H * e, d), "qk": (2, H, e, d), "random": (d, k1),
                          "axis": (d,), "tokens": (n, d)}, dt, jax.random.normal)
    u = _draws(k_uniform, {"spectrum": (d + 3,), "angle": (n, 1)}, dt, jax.random.uniform)
    re, im, start = _slots(u["spectrum"], values, cfg, dt)
    sup = jnp.where(start[:-1], jnp.abs(im[:-1]), 0.0)
    D = jnp.diag(re) + jnp.diag(sup, 1) - jnp.diag(sup, -1)
    if cfg.spectrum == "given":
        F = jnp.asarray(values["F"], dt)
        E = jnp.full((d, d), jnp.nan, dt)                           # no Q or S: the spectral facts are NaN
    elif cfg.kind == "nonnormal":
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
    layers = Layers(attn=Attention(W_q=W_q[None], W_k=W_k[None], W_v=V.reshape(H, e, d)[None], W_o=W_o[None],
                                   scale=jnp.full((1,), values["beta"] / np.sqrt(e), dt),
                                   window=jnp.zeros((1,), jnp.int32)),
                    norms=Norms(), ffn=None, config=config)      # the paper's system: no norms, no FFN

    order, dim1, dim2, lam = eigen_groups(re, im, jnp.hypot(1.0 + re, im))
    porder, dim_plain, _, lam_plain = eigen_groups(re, im, jnp.hypot(re, im))
    orth = cfg.kind != "nonnormal" or cfg.spectrum == "given"
    B = _basis(E, order[:k1], jnp.arange(k1) < dim1, orth)
    if k1 == 2:                                 # orient a complex-pair plane: I + F turns it counter-clockwise
        B = orient_plane(B, F, (dim1 == 2) & (lam[0, 1] > 0))
    top2 = _basis(E, order[:k2], jnp.arange(k2) < dim1 + dim2, orth)
    if cfg.order == "shifted":
        P, pdim = B, dim1
    else:
        P, pdim = _basis(E, porder[:k1], jnp.arange(k1) < dim_plain, orth), dim_plain
    rand = gram_schmidt(z["random"], jnp.arange(k1) < pdim)
    if cfg.spectrum != "given":             # a degenerate basis: the run is made non-finite (W_o NaN),
        bad = (_degenerate(B, jnp.arange(k1) < dim1) | _degenerate(P, jnp.arange(k1) < pdim)   # so a
               | _degenerate(top2, jnp.arange(k2) < dim1 + dim2))     # sweep row reads finite False, measures null
        layers = layers.replace(W_o=jnp.where(bad, jnp.nan, layers.W_o))
    x0, exact = _tokens(z, u, values, cfg, B[:, 0])
    facts = {"eigenvalues": jnp.stack([re, im], axis=1), "shifted": order, "plain": porder, "lam": lam,
             "lam_plain": lam_plain, "dim": dim1.astype(jnp.int32), "dim_plain": dim_plain.astype(jnp.int32),
             "direction": B, "principal": P, "principal_dim": pdim.astype(jnp.int32), "top2": top2,
             "random": rand, "v1": B[:, 0] * (dim1 == 1), "x0": x0, "x0_exact": exact,
             "F": F}
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


# --------------------------------------------------------------------- the builder on the host

build = jax.jit(synthetic, static_argnames="cfg")
""":func:`synthetic` compiled (``cfg`` static): one program per shape, whatever the spectrum."""

_PRECISIONS = {np.dtype(np.float32): False, np.dtype(np.float64): True}
SEED_LIMIT = 2 ** 31
"""Seeds of :func:`synthetic_system` lie in 0 .. SEED_LIMIT - 1 (a sweep row's ``int32`` seed)."""


def synthetic_inputs(eigenvalues=None, *, kind: str = "symmetric", heads: int = 1, beta: float = 1.0,
                     d: Optional[int] = None, seed: int = 0, d_head: Optional[int] = None,
                     F: Optional[np.ndarray] = None, dtype=np.float32, nonnormality: float = 1.0,
                     tokens: int = 1):
    """``(seed, values, cfg)`` for :func:`synthetic` from the arguments of
    :func:`synthetic_system` (checked: each bad one a one-line ValueError): a spectrum list
    becomes ``spectrum = "eigenvalues"`` (its slots, :func:`spectrum_slots`, a dynamic value),
    an F ``spectrum = "given"``. ``cfg.steps`` is 1 (the wrapper sets the schedule)."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in 0 .. {SEED_LIMIT - 1}, got {seed!r}")
    if not np.isfinite(beta):
        raise ValueError(f"beta must be finite, got {beta}")
    if not np.isfinite(nonnormality):
        raise ValueError(f"nonnormality must be finite, got {nonnormality}")
    dt = np.dtype(dtype)
    if dt not in _PRECISIONS:
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    if not isinstance(heads, (int, np.integer)) or heads <= 0:
        raise ValueError(f"heads must be positive, got {heads}")
    values = {"beta": beta, "nonnormality": nonnormality, "cone": 0.0, "noise": 0.0}
    if F is not None:
        F = np.asarray(F)
        if F.ndim != 2 or F.shape[0] != F.shape[1] or F.shape[0] == 0:
            raise ValueError(f"F must be a square (d, d) matrix, got shape {F.shape}")
        if not np.issubdtype(F.dtype, np.floating) and not np.issubdtype(F.dtype, np.integer):
            raise ValueError(f"F must be real, got dtype {F.dtype}")
        if not np.all(np.isfinite(F)):
            raise ValueError("F contains non-finite values (NaN or inf)")
        if d is not None and int(d) != F.shape[0]:
            raise ValueError(f"d={d} but F is {F.shape[0]}x{F.shape[0]}")
        d, spectrum, values["F"] = F.shape[0], "given", F.astype(dt)
    elif eigenvalues is None:
        raise ValueError("give a spectrum (a list of eigenvalues) or F")
    else:
        eigs = [complex(z) for z in eigenvalues]
        d = check_spectrum(eigs, kind, d)
        spectrum, values["eigenvalues"] = "eigenvalues", spectrum_slots(eigs, d).astype(dt)
        if kind == "nonnormal":
            limit = nonnormality_limit(d, max(abs(z.real) + abs(z.imag) for z in eigs), dt)
            if not abs(nonnormality) <= limit:
                raise ValueError(f"nonnormality {nonnormality:g} overflows {dt.name}: S = I + s G / sqrt(d) and S D "
                                 f"stay finite for s <= {limit:.4g} (d={d}); use a smaller value"
                                 + (" or dtype=np.float64" if dt == np.float32 else ""))
    cfg = SyntheticConfig(d=int(d), tokens=int(tokens), heads=int(heads), kind=kind, spectrum=spectrum,
                          x64=_PRECISIONS[dt], d_head=None if d_head is None else int(d_head))
    return np.int32(seed), values, cfg


def synthetic_system(eigenvalues, *, kind: str = "symmetric", heads: int = 1, beta: float = 1.0,
                     d: Optional[int] = None, seed: int = 0, steps: Optional[int] = None,
                     d_head: Optional[int] = None, F: Optional[np.ndarray] = None, dtype=np.float32,
                     nonnormality: float = 1.0, tokens: int = 1, facts: bool = False):
    """A one-layer (shared-weight) system with F of the given spectrum (or F itself): the one
    builder :func:`synthetic`, compiled (:data:`build`) and brought to the host.

    Args:
      eigenvalues: the spectrum, e.g. ``[2.0, 0.5 + 1.0j, 0.3]`` (a complex entry stands for
        its conjugate pair; zeros fill up to d), or None with ``F``.
      kind: one of :data:`KINDS`; heads: H; d_head: e (default ceil(d / H); H e >= d);
      beta: the inverse temperature; seed: 0 .. 2^31 - 1; nonnormality: s of the nonnormal S;
      F: "float[d d]" the layer matrix itself (the heads carry it; spectral facts are NaN).
      steps: the schedule is that layer repeated ``steps`` times (``Schedule.repeat``); None
        leaves it unset (one step of the one layer).
      dtype: ``np.float32`` or ``np.float64``: the system is built in that precision (float64
        enabled for the build only); the layers are ``jnp`` arrays, so where the caller has not
        enabled float64 they are rounded to float32 (as ``jnp.asarray`` does); the facts keep it.
      tokens: n, the rows of ``facts["x0"]`` (tokens on the sphere).
      facts: also return the facts dict of :func:`synthetic` (NumPy arrays).

    Returns:
      :class:`Layers`, or ``(layers, facts)`` with the facts as NumPy arrays. A system its head split
      cannot carry (a numerically singular V_cat or S) is a ValueError.
    """
    sched = None if steps is None else Schedule.repeat(0, check_steps(steps))
    seed, values, cfg = synthetic_inputs(eigenvalues, kind=kind, heads=heads, beta=beta, d=d, seed=seed,
                                         d_head=d_head, F=F, dtype=dtype, nonnormality=nonnormality,
                                         tokens=tokens)
    with jax.enable_x64(cfg.x64):
        layers, out = jax.device_get(build(seed, values, cfg))
    if not (np.all(np.isfinite(layers.W_o)) and np.all(np.isfinite(out["F"]))):
        k1 = out["principal"].shape[1]
        basis = cfg.spectrum != "given" and np.all(np.isfinite(out["F"])) and bool(
            _degenerate(out["direction"], np.arange(k1) < out["dim"])
            | _degenerate(out["principal"], np.arange(k1) < out["principal_dim"])
            | ~np.isfinite(out["top2"]).all())
        why = ("has a degenerate eigenbasis (a non-finite or zero column)" if basis
               else "is singular: its S or V_cat has no inverse")
        raise ValueError(f"synthetic system (kind {kind!r}, d={cfg.d}, heads={cfg.heads}, seed={int(seed)}) {why}")
    layers = jax.tree_util.tree_map(jnp.asarray, layers)        # in the caller's precision, as make_layers
    layers = layers.replace(config=dataclasses.replace(layers.config, schedule=sched))
    return (layers, out) if facts else layers


def spectrum_matrix(eigenvalues, *, kind: str = "symmetric", d: Optional[int] = None, seed: int = 0,
                    nonnormality: float = 1.0) -> Float64[np.ndarray, "d d"]:
    """A real "float64[d d]" matrix with the given eigenvalues (zeros fill up to d): the F of
    :func:`synthetic_system` with these arguments (one head), built in float64."""
    return synthetic_system(eigenvalues, kind=kind, d=d, seed=seed, nonnormality=nonnormality,
                            dtype=np.float64, facts=True)[1]["F"]
