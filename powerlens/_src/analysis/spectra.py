"""Spectra of every layer's F_t and their principal subspaces (design.md §2, §3).

Two orderings of the eigenvalues lambda of F:

    shifted   by |1 + lambda|  (what x <- N2(x + F x) converges to; the default)
    plain     by |lambda|      (the paper's wording)

The *principal group* of an ordering is every eigenvalue whose key is within
``group_rtol`` (relative; default :data:`~powerlens._src.dynamics.linalg.GROUP_RTOL`) of the
largest key (:func:`~powerlens._src.dynamics.linalg.group_size`, the one rule the sweeps use too): a complex pair, a repeated or a
near-repeated top eigenvalue is always a group, never one arbitrary eigenvector.
Its invariant subspace is the real span of the group's eigenvectors (one ``eig``
per layer serves both orderings; ``eigh`` for a numerically symmetric F, whose spectrum
is real), or, when those are numerically dependent (a
defective eigenvalue), an ordered real Schur form: always an orthonormal real basis; for a complex pair the
basis (e1, e2) is oriented so that I + F rotates coordinates counter-clockwise, by
arg(1 + lambda1) with Im lambda1 > 0.

Runs on the host (NumPy/SciPy): ``jnp.linalg.eig`` is CPU-only. :func:`spectra_of` computes
them once per set of weights (JAX arrays W_o, W_v) and keeps them while those live, so that a
second ``trace`` or ``align_model`` of a model costs only its forward pass; an edited model has
new arrays and gets its own (:func:`kept_spectra`).

In spectrum.json (:meth:`LayerSpectrum.to_json`, :data:`LAYER_FIELDS`) every eigenvalue is listed
with the sizes of its eigen-groups, and ``gap`` is measured between the first two groups, so a
dominant complex pair (one group) never reads as a gap of 0.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.cache import per_arrays
from ..dynamics.linalg import GROUP_RTOL, group_size, orient_plane
from ..dynamics.params import Layers, layer_factors, layer_matrices
from ..dynamics.subspaces import REFERENCES, Subspaces, stack_subspaces  # noqa: F401  (Subspaces re-exported)
from .measures import random_subspace

ORDERS = ("shifted", "plain")


def check_order(order: str) -> str:
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; expected one of {ORDERS}")
    return order


def order_key(eigenvalues, order: str):
    check_order(order)
    return np.abs(1.0 + eigenvalues) if order == "shifted" else np.abs(eigenvalues)


@dataclasses.dataclass
class OrderedSpectrum:
    """One layer's spectrum in one ordering."""

    eigenvalues: np.ndarray      # (d,) complex, sorted by decreasing key
    top: complex                 # lambda_1 (Im >= 0 for a complex pair)
    dim: int                     # dimension of the principal invariant subspace
    basis: np.ndarray            # (d, dim) orthonormal real basis
    mu1: float                   # key of the top group
    mu2: float                   # key of the first eigenvalue outside it (0 if none)
    is_complex: bool
    plane: np.ndarray = None     # (d, 2) orthonormal: principal direction(s) + the next one, for plots
    order: str = "shifted"       # the ordering: keys |1 + lambda| (shifted) or |lambda| (plain)

    @property
    def ratio(self) -> float:
        """|mu2 / mu1|: the power-method rate toward the principal subspace."""
        return float(self.mu2 / self.mu1) if self.mu1 > 0 else float("nan")

    @property
    def gap(self) -> float:
        """mu1 - mu2: the key of the principal eigen-group less the key of the next group (the
        first eigenvalue outside the principal group; 0 if none). Never the gap inside a complex
        pair or a repeated eigenvalue, which are one group (:func:`~powerlens._src.dynamics.linalg.group_size`)."""
        return float(self.mu1 - self.mu2)

    def groups(self, top_k: Optional[int] = None, rtol: float = GROUP_RTOL) -> List[int]:
        """The sizes of the consecutive eigen-groups of ``eigenvalues`` (sum: d, or the first
        groups covering at least ``top_k`` eigenvalues), by the one group rule
        (:func:`~powerlens._src.dynamics.linalg.group_size` on this ordering's keys): a complex pair
        is one group of 2. The gap between groups g and g+1 is key(first of g) - key(first of g+1)."""
        key = order_key(self.eigenvalues, self.order)
        n = len(key) if top_k is None else min(len(key), top_k)
        out, start = [], 0
        while start < n:
            size = max(int(group_size(key, start, rtol)), 1)
            out.append(size)
            start += size
        return out


@dataclasses.dataclass
class LayerSpectrum:
    layer: int
    shifted: OrderedSpectrum
    plain: OrderedSpectrum

    @property
    def orderings_differ(self) -> bool:
        """True when the shifted principal eigenvalue is not in the plain principal group."""
        g = self.plain.eigenvalues[: self.plain.dim]
        t = self.shifted.top
        tol = 1e-6 * (1.0 + abs(t))
        return bool(np.min(np.abs(g - t)) > tol and np.min(np.abs(g - np.conj(t))) > tol)

    def get(self, order: str) -> OrderedSpectrum:
        return getattr(self, check_order(order))

    def to_json(self, top_k: Optional[int] = None) -> dict:
        """One entry of spectrum.json's ``layers`` (the fields: :data:`LAYER_FIELDS`): every
        eigenvalue (the first ``top_k`` of each ordering with ``top_k``), the sizes of its
        eigen-groups, and the gap, ratio, dimension and rotation of the principal group."""
        pair = lambda ev: [[float(z.real), float(z.imag)] for z in ev[:top_k]]
        return {
            "layer": self.layer,
            "eigenvalues_shifted": pair(self.shifted.eigenvalues),
            "eigenvalues_plain": pair(self.plain.eigenvalues),
            "groups_shifted": self.shifted.groups(top_k),
            "groups_plain": self.plain.groups(top_k),
            "orderings_differ": self.orderings_differ,
            "ratio": self.shifted.ratio,
            "ratio_plain": self.plain.ratio,
            "gap": self.shifted.gap,
            "gap_plain": self.plain.gap,
            "complex": self.shifted.is_complex,
            "complex_plain": self.plain.is_complex,
            "dim": self.shifted.dim,
            "dim_plain": self.plain.dim,
            "rotation_per_step": float(abs(np.angle(1.0 + self.shifted.top))),
        }


def _real_span(cols: np.ndarray, tol: float = 1e-7):
    """Orthonormal basis of span(Re c, Im c for c in cols) and its numerical rank."""
    M = np.concatenate([cols.real, cols.imag], axis=1)
    if M.shape[1] == 0:
        return M, 0
    U, sv, _ = np.linalg.svd(M, full_matrices=False)
    rank = int(np.sum(sv > tol * max(sv[0], 1e-300)))
    return U[:, :rank], rank


def _schur_basis(F: np.ndarray, order: str, threshold: float):
    """Fallback for defective groups: the ordered real Schur vectors above ``threshold``."""
    if order == "shifted":
        select = lambda re, im: np.hypot(1.0 + re, im) > threshold
    else:
        select = lambda re, im: np.hypot(re, im) > threshold
    import scipy.linalg                 # only here and for a null space: not on the usual path
    _, Z, sdim = scipy.linalg.schur(F, output="real", sort=select)
    return np.array(Z[:, :sdim]), int(sdim)


def _ordered(F: np.ndarray, w: np.ndarray, vectors, order: str, group_rtol: float) -> OrderedSpectrum:
    """One ordering of a layer's eigen-decomposition: eigenvalues w "complex[d]" and
    ``vectors(cols)``, the eigenvectors "[d len(cols)]" of the eigenvalues w[cols] (from a
    single ``eig``; only the principal group's and the next group's are asked for).

    The principal basis is the real span of the group's eigenvectors; when they are
    (numerically) dependent -- a defective eigenvalue -- it falls back to an ordered
    real Schur form, which always gives the invariant subspace.
    """
    key = order_key(w, order)
    idx = np.argsort(-key, kind="stable")
    w, key = w[idx], key[idx]
    mu1 = float(key[0])
    dim = int(group_size(key, 0, group_rtol))
    mu2 = float(key[dim]) if dim < len(key) else 0.0
    top = w[0] if w[0].imag >= 0 else np.conj(w[0])      # canonical: Im >= 0
    basis, rank = _real_span(vectors(idx[:dim]))
    if rank != dim:
        threshold = 0.5 * (float(key[dim - 1]) + mu2) if dim < len(key) else -1.0
        basis, dim = _schur_basis(F, order, threshold)
    is_complex = bool(abs(top.imag) > 1e-9 * (1 + abs(top)))
    if dim == 2 and is_complex:
        basis = orient_plane(basis, F)
    if dim >= 2 or len(key) < 2:
        plane = basis[:, :2] if dim >= 2 else np.eye(len(key), 2)
    else:  # principal direction plus the leading direction of the next eigen-group
        j = dim + int(group_size(key, dim, group_rtol))
        cand, _ = _real_span(vectors(idx[dim:j]))
        cand = cand - basis @ (basis.T @ cand)
        k = int(np.argmax(np.linalg.norm(cand, axis=0)))
        plane = np.concatenate([basis, cand[:, k:k + 1] / np.linalg.norm(cand[:, k])], axis=1)
    return OrderedSpectrum(eigenvalues=w, top=complex(top), dim=dim, basis=basis,
                           mu1=mu1, mu2=mu2, is_complex=is_complex, plane=plane, order=order)


SYMMETRY_RTOL = 1e-5
"""F is treated as symmetric when max |F - F^T| <= SYMMETRY_RTOL * max |F|: float32 rounding of
a symmetric F = O V leaves an asymmetry near 1e-7 of its scale, a genuine rotation far more."""


def _symmetric(f: np.ndarray) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.max(np.abs(0.5 * f - 0.5 * f.T)) <= 0.5 * SYMMETRY_RTOL * np.max(np.abs(f)))


def _eig(f: np.ndarray, symmetric: bool):
    """Eigenvalues "complex[d]" and eigenvectors "[d d]" of F. A numerically symmetric F (see
    :data:`SYMMETRY_RTOL`, :func:`_symmetric`) goes through ``eigh`` of its symmetric part: its
    spectrum is real, so the many zero eigenvalues of a padded symmetric system never come out
    as tiny complex pairs, as they do from ``eig``."""
    with np.errstate(all="ignore"):           # an F near the largest float overflows here: reported below
        if symmetric:
            w, V = np.linalg.eigh(0.5 * f + 0.5 * f.T)
            return w.astype(complex), V
        return np.linalg.eig(f)


FACTOR_RTOL = 1e-10
"""The low-rank eig (:func:`_eig_factored`) needs every eigenvector A y of F = A B nonzero:
||A y|| above this fraction of ||A||_F (y a unit vector); otherwise the full eig runs."""


def _eig_factored(A: np.ndarray, B: np.ndarray):
    """Eigenvalues "complex[d]" and ``vectors(cols)`` (see :func:`_ordered`) of F = A B,
    A "[d r]", B "[r d]", r < d, from the r x r matrix M = B A.

    det(lambda I_d - A B) = lambda^(d-r) det(lambda I_r - B A), so the eigenvalues of F are those
    of M and d - r zeros. F (A y) = A (B A) y = lambda A y: every eigenpair (lambda, y) of M
    gives the eigenpair (lambda, A y) of F. The zeros get an orthonormal basis of a
    (d - r)-dimensional subspace of null(B), inside null(F): the last d - r columns of Q in a
    QR of B^T, which are orthogonal to range(B^T) whatever the rank of B. O(r^3) instead of
    O(d^3); the null-space basis (O(d^2 r)) is computed only when a caller asks for one of
    its vectors. None when some A y vanishes (the caller runs the full eig)."""
    r, d = B.shape
    w, Y = np.linalg.eig(B @ A)
    X = A @ Y
    norms = np.linalg.norm(X, axis=0)
    if not np.all(norms > FACTOR_RTOL * np.linalg.norm(A)):
        return None
    X = X / norms
    null = []

    def vectors(cols):
        cols = np.asarray(cols, int)
        if np.all(cols < r):
            return X[:, cols]
        if not null:
            import scipy.linalg
            null.append(scipy.linalg.qr(B.T, mode="full")[0][:, r:])
        return np.concatenate([X, null[0]], axis=1)[:, cols]

    return np.concatenate([w, np.zeros(d - r, complex)]), vectors


def eigen_decomposition(f: np.ndarray, factors=None):
    """(w "complex[d]", vectors): the eigenvalues of F "[d d]" and ``vectors(cols)``, their
    eigenvectors "[d len(cols)]" (see :func:`_ordered`). With ``factors`` (A "[d r]",
    B "[r d]", F = A B, r < d) and a non-symmetric F, through :func:`_eig_factored`; else one
    full :func:`_eig`. A non-finite eigenvector of the full eig makes every w NaN."""
    symmetric = _symmetric(f)
    if factors is not None and factors[0].shape[-1] < f.shape[0] and not symmetric:
        with np.errstate(all="ignore"):
            eig = _eig_factored(*(np.asarray(m, np.float64) for m in factors))
        if eig is not None:
            return eig
    w, V = _eig(f, symmetric)
    if not np.all(np.isfinite(V)):
        w = np.full_like(w, np.nan)            # the caller reports a non-finite decomposition
    return w, lambda cols: V[:, cols]


def _layer(i: int, f: np.ndarray, group_rtol: float, factors=None) -> LayerSpectrum:
    w, vectors = eigen_decomposition(f, factors)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"F of layer {i} has non-finite eigenvalues or eigenvectors (max |F| = "
                         f"{np.max(np.abs(f)):.3g}: are the weights too large?)")
    return LayerSpectrum(layer=i, shifted=_ordered(f, w, vectors, "shifted", group_rtol),
                         plain=_ordered(f, w, vectors, "plain", group_rtol))


def layer_spectra(F, *, group_rtol: float = GROUP_RTOL, factors=None) -> List[LayerSpectrum]:
    """Spectra of a stack F (U, d, d) in both orderings, one :class:`LayerSpectrum` each.

    ``factors``: optionally (A "[U d r]", B "[U r d]") with F = A B and r < d, e.g.
    :func:`~powerlens._src.dynamics.params.layer_factors` (grouped-query attention); the
    eigen-decomposition then comes from the r x r matrices B A (:func:`_eig_factored`).
    """
    precision = np.dtype(getattr(F, "dtype", np.float64)).name
    F = np.asarray(F, dtype=np.float64)
    if F.ndim == 2:
        F = F[None]
    if F.ndim != 3 or F.shape[1] != F.shape[2]:
        raise ValueError(f"F must have shape (L, d, d), got {F.shape}")
    if factors is not None:
        A, B = (np.asarray(m, np.float64).reshape((-1,) + np.shape(m)[-2:]) for m in factors)
        r = A.shape[-1]
        if A.shape != F.shape[:2] + (r,) or B.shape != (F.shape[0], r, F.shape[2]):
            raise ValueError(f"factors of F {F.shape} must have shapes (L, d, r) and (L, r, d), got "
                             f"{A.shape} and {B.shape}")
        factors = list(zip(A, B))
    if not np.all(np.isfinite(F)):
        bad = sorted({int(i) for i in np.argwhere(~np.isfinite(F))[:, 0]})
        raise ValueError(f"F contains non-finite values at layer(s) {bad[:8]}: F = W_o V_cat overflowed "
                         f"(are the weights too large for {precision}?)")
    return [_layer(i, f, group_rtol, None if factors is None else factors[i]) for i, f in enumerate(F)]


def host_layer_matrices(layers: Layers):
    """(F, factors) of every unique layer on the host, what :func:`layer_spectra` takes: the
    NumPy arrays of F "float[U d d]" (:func:`~powerlens._src.dynamics.params.layer_matrices`) and of
    its factors A "float[U d r]", B "float[U r d]" (:func:`~powerlens._src.dynamics.params.layer_factors`).
    After this, computing the spectra runs no JAX (so it may run in another thread). One
    compiled program (:func:`_layer_arrays`): one cache read, where the eager ops cost one each."""
    F, factors = _layer_arrays(layers)
    return np.asarray(F), tuple(np.asarray(m) for m in factors)


@jax.jit
def _layer_arrays(layers: Layers):
    """(F, (A, B)) of :func:`host_layer_matrices`, jitted (the same bits as the eager ops)."""
    return layer_matrices(layers), layer_factors(layers)


def spectra_of(layers: Layers, *, group_rtol: float = GROUP_RTOL) -> List[LayerSpectrum]:
    """:func:`layer_spectra` of every unique layer of ``layers`` (float64 on the host), through
    the r x r factors of :func:`~powerlens._src.dynamics.params.layer_factors` where r < d.

    Computed once per set of weights: F_t = W_o V_cat depends on ``W_o``, ``W_v`` and the head
    layout alone, so the result is kept (:func:`~powerlens._src.dynamics.cache.per_arrays`) while
    those two JAX arrays live, keyed by their identity (JAX arrays are immutable), the head
    layout (H, G, e), the compute dtype F is formed in and ``group_rtol``. A second
    ``trace``/``align_model`` of the same model reuses it; an edit makes new arrays
    (``steered_model``: W_o' = W_o + ΔO is a new array), so the edited model's spectra are
    computed afresh, and the old entry goes with the old arrays.
    NumPy weights (mutable) and traced ones are never cached. The list returned is a new list
    of the shared :class:`LayerSpectrum` objects: treat them as read-only."""
    def build():
        F, factors = host_layer_matrices(layers)
        return layer_spectra(F, group_rtol=group_rtol, factors=factors)

    return kept_spectra(layers, build, group_rtol=group_rtol)


def kept_spectra(layers: Layers, build, *, group_rtol: float = GROUP_RTOL) -> List[LayerSpectrum]:
    """``build()``, the spectra of every unique layer of ``layers`` however computed (the whole
    stack, or one layer at a time), kept as :func:`spectra_of` keeps them: one entry per
    (W_o, W_v, head layout, compute dtype, ``group_rtol``), dropped with the arrays; built
    afresh every call for NumPy or traced weights."""
    cfg = layers.config
    dtype = np.dtype(getattr(layers, "dtype", layers.W_v.dtype)).name        # F is formed in the compute dtype
    tag = f"spectra/H{cfg.n_heads}/G{cfg.n_kv_heads}/e{cfg.d_head}/{dtype}/rtol{group_rtol!r}"
    kept = per_arrays(tag, (layers.W_o, layers.W_v), build)
    return build() if kept is None else list(kept)


LAYER_FIELDS = {
    "layer": "the unique layer, numbered from 0",
    "eigenvalues_shifted": "every eigenvalue lambda of F_t = O_t V_t (all d of them, zeros included), as [Re, Im], "
                           "sorted by decreasing |1 + lambda| (the key of the shifted ordering)",
    "eigenvalues_plain": "the same eigenvalues sorted by decreasing |lambda| (the plain ordering)",
    "groups_shifted": "sizes of the consecutive eigen-groups of eigenvalues_shifted: eigenvalues whose keys lie within "
                      "a relative 1e-4 of the group's first key form one group (a complex pair is one group of 2)",
    "groups_plain": "the same for eigenvalues_plain",
    "orderings_differ": "the shifted principal eigenvalue is not in the plain principal group",
    "gap": "mu1 - mu2 with mu = |1 + lambda|: the key of the principal group less the key of the next group "
           "(the eigenvalue after the first groups_shifted[0] entries); never 0 from a complex pair, "
           "which is one group",
    "gap_plain": "the same with mu = |lambda|, between the first two groups of eigenvalues_plain",
    "ratio": "mu2 / mu1 (shifted keys): the power-method rate toward the principal subspace",
    "ratio_plain": "mu2 / mu1 with mu = |lambda|",
    "complex": "the shifted principal group is a complex pair", "complex_plain": "the same, plain ordering",
    "dim": "dimension of the shifted principal invariant subspace (groups_shifted[0], unless defective)",
    "dim_plain": "the same, plain ordering",
    "rotation_per_step": "|arg(1 + lambda_1)|, radians: the turn per step of a dominant complex pair",
    "group": "(ALBERT) the layer group of this unique layer",
}
"""What each field of a layer entry of spectrum.json (and of align.json's ``layers``) means:
both files carry it as ``layer_fields``."""


def spectra_json(spectra: List[LayerSpectrum], top_k: Optional[int] = None) -> list:
    """:meth:`LayerSpectrum.to_json` of every layer: all eigenvalues unless ``top_k``."""
    return [s.to_json(top_k) for s in spectra]


# ------------------------------------------------------------------ reference subspaces

def reference_subspaces(spectra: List[LayerSpectrum], *, order: str = "shifted", seed: int = 0,
                        dtype=jnp.float32) -> Subspaces:
    """The named references of every layer (:data:`~powerlens._src.dynamics.subspaces.REFERENCES`):
    its principal subspace, a random subspace of equal dimension and another layer's
    principal subspace, as :class:`~powerlens._src.dynamics.subspaces.Subspaces`.

    The other-layer control of layer u is the principal subspace of layer (u + U//2) mod U
    (undefined, dim 0, when there is a single layer).
    """
    check_order(order)
    rng = np.random.default_rng(seed)
    U = len(spectra)
    d = spectra[0].shifted.basis.shape[0]
    prin = [s.get(order).basis for s in spectra]
    refs = {"principal": prin,
            "random": [random_subspace(rng, d, b.shape[1]) for b in prin],
            "other_layer": [prin[(u + max(U // 2, 1)) % U] if U > 1 else np.zeros((d, 0)) for u in range(U)]}
    k = max(max(b.shape[1] for b in prin), 1)
    basis = np.zeros((U, len(REFERENCES), d, k))
    dim = np.zeros((U, len(REFERENCES)), np.int32)
    for r, name in enumerate(REFERENCES):
        for u, b in enumerate(refs[name]):
            basis[u, r, :, : b.shape[1]] = b
            dim[u, r] = b.shape[1]
    # device_put of host arrays: jnp.asarray would compile (or read from the cache) a copy program
    basis = jax.device_put(basis.astype(np.float32)) if np.dtype(dtype) == np.float32 else jnp.asarray(basis, dtype)
    return Subspaces(basis=basis, dim=jax.device_put(dim), names=REFERENCES)


def sweep_subspaces(systems: Sequence[Layers], *, order: str = "shifted", seed: int = 0):
    """Spectra of every system (a list of lists of :class:`LayerSpectrum`) and their stacked
    reference subspaces (leading system axis S), for
    :func:`powerlens._src.dynamics.sweep.simulate_sweep`; system i uses seed ``seed + i``."""
    spectra = [spectra_of(s) for s in systems]
    subs = [reference_subspaces(sp, order=order, seed=seed + i, dtype=systems[0].W_v.dtype)
            for i, sp in enumerate(spectra)]
    return spectra, stack_subspaces(subs)
