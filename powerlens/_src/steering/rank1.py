"""Closed-form rank-1 steering of one layer's output matrix (design.md §4).

Column-vector maths. The unique layer ``l`` has W_o (d, H e) and the value matrix
V_cat (H e, d) (grouped-query heads expanded), so F = W_o V_cat. The perturbation

    O' = O + alpha u w^T          u (d,) unit, w (H e,), alpha > 0
    F' = F + alpha u z^T          z = V_cat^T w  (d,)

Choices of w:

    "inverse"  w = pinv(V_cat^T) u (= V_cat (V_cat^T V_cat)^{-1} u), the minimum-norm w with
               z = u exactly (needs V_cat of full column rank d, i.e. H e >= d); solved by
               least squares, never through V_cat^T V_cat, whose condition number is cond(V_cat)^2;
    "value"    w = V_cat u / ||V_cat u||, the unit w with the largest z.u = ||V_cat u||;
    "auto"     (the default) "inverse" where V_cat has full column rank d, "value" otherwise
               (:func:`resolve_w`). Grouped-query attention repeats each key/value head over
               its group of query heads, so rank V_cat <= (number of KV heads) e < d and
               "inverse" is impossible there;
    an array   any (H e,) vector.

Asymptotics. An eigenpair of F' off the spectrum of F satisfies (lambda I - F) x =
alpha u (z.x), so x ∝ (lambda I - F)^{-1} u and 1 = alpha z^T (lambda I - F)^{-1} u.
Expanding (lambda I - F)^{-1} = lambda^{-1} (I + F/lambda + ...) gives

    lambda' = alpha (z.u) + z^T F u / (z.u) + O(1/alpha),    x' ∝ (lambda' I - F)^{-1} u,

(defined when z.u != 0). When u is an eigenvector of F (F u = lambda_k u) and z = u,
det(lambda I - F') = det(lambda I - F) (1 - alpha/(lambda - lambda_k)): lambda_k moves to
lambda_k + alpha and every other eigenvalue stays put.

Shared weights: for an ALBERT-like system (one unique layer applied at every step)
perturbing unique layer ``l`` perturbs *every* step that applies it, not just the last.

Storage: the change of the checkpoint's own weight is the models package's business
(:func:`powerlens._src.models.layout.checkpoint_delta`, re-exported here): each family declares
how it stores W_o (GPT-2's Conv1D as (H e, d), so its delta is delta_O^T = alpha w u^T;
``nn.Linear`` and GGUF as (d, H e) = delta_O).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np

from ..analysis.spectra import LayerSpectrum, eigen_decomposition, layer_spectra
from ..dynamics.params import Layers, layer_factors, value_matrix
from ..models.layout import checkpoint_delta
from .directions import as_direction

W_CHOICES = ("auto", "inverse", "value")


def layer_index(layers: Layers, layer: int) -> int:
    """Normalise a (possibly negative) unique-layer index, with a clear error."""
    U = layers.n_unique
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise ValueError(f"layer must be an integer unique-layer index, got {layer!r}")
    if not -U <= layer < U:
        raise ValueError(f"layer {layer} is out of range for {U} unique layer(s)")
    return int(layer) % U


def check_alpha(alpha) -> float:
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"alpha must be a positive number, got {alpha!r}") from None
    if not np.isfinite(a) or a <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    return a


def host_matrices(layers: Layers, layer: int):
    """W_o (d, H e), V_cat (H e, d) and F = W_o V_cat of unique layer ``layer`` in float64."""
    from ..dynamics.execution import host_array       # weights split over other hosts' devices: gathered
    l = layer_index(layers, layer)
    one = layers.layer(l)
    W_o = np.asarray(host_array(one.W_o), np.float64)
    V = np.asarray(host_array(value_matrix(one)), np.float64)
    return W_o, V, W_o @ V


def host_factors(layers: Layers, layer: int, W_o: np.ndarray):
    """(A "[d r]", B "[r d]") of :func:`~powerlens._src.dynamics.params.layer_factors` for unique layer
    ``layer`` in float64, with its output matrix replaced by ``W_o`` "[d H e]" (the layer's
    own from :func:`host_matrices`, or a steered one): F = W_o V_cat = A B."""
    from ..dynamics.execution import host_array
    one = layers.layer(layer_index(layers, layer))
    return layer_factors(one.replace(W_o=np.asarray(W_o, np.float64), W_v=np.asarray(host_array(one.W_v), np.float64)))


def rank_tolerance(sv: np.ndarray, shape, dtype=np.float64) -> float:
    """Singular values at or below this are zero: the rounding of ``dtype`` (the precision the
    matrix was computed in) in an SVD of a ``shape`` matrix whose largest singular value is
    sv[0] (sv sorted in decreasing order)."""
    return float(sv[0]) * max(shape) * float(np.finfo(dtype).eps) * 10


def factor_rank(P, Q) -> int:
    """Numerical rank of P Q^T for factors P "float[d r]", Q "float[m r]" (0 when either is
    not finite or the product is zero): with P = Q_P R_P and Q = Q_Q R_Q (thin QR), the singular
    values of P Q^T are those of the r x r matrix R_P R_Q^T, counted above the rounding of the
    factors' own precision (:func:`rank_tolerance`: a float32 optimiser's rounding is not a
    direction)."""
    dtype = np.result_type(P, Q)
    P, Q = np.asarray(P, np.float64), np.asarray(Q, np.float64)
    if not (np.all(np.isfinite(P)) and np.all(np.isfinite(Q))):
        return 0
    sv = np.linalg.svd(np.linalg.qr(P)[1] @ np.linalg.qr(Q)[1].T, compute_uv=False)
    tol = rank_tolerance(sv, (P.shape[0], Q.shape[0]), dtype)
    return int(np.sum(sv > tol)) if sv[0] > 0 else 0


@dataclasses.dataclass(frozen=True)
class WChoice:
    """The closed-form w actually used for a layer, and why (see :func:`resolve_w`)."""

    requested: str     # "auto", "inverse" or "value"
    kind: str          # the one used: "inverse" or "value"
    rank: int          # numerical column rank of V_cat (H e, d)
    d: int
    layer: int

    @property
    def full_rank(self) -> bool:
        return self.rank == self.d

    def describe(self) -> str:
        """One line, e.g. ``w=value (auto: layer 29's V_cat has rank 192 < d=576)``."""
        why = (f"layer {self.layer}'s V_cat has full column rank {self.d}" if self.full_rank else
               f"layer {self.layer}'s V_cat has rank {self.rank} < d={self.d}")
        return f"w={self.kind} ({self.requested}: {why})" if self.requested == "auto" else f"w={self.kind}"

    def to_json(self) -> dict:
        return {"requested": self.requested, "used": self.kind, "value_rank": self.rank, "d": self.d,
                "layer": self.layer}


def _inverse_refusal(shape, sv: np.ndarray, layer: int) -> Optional[str]:
    """Why w='inverse' is impossible for a value matrix V_cat of ``shape`` (H e, d) with singular
    values ``sv`` (decreasing), or None when V_cat has full column rank d."""
    He, d = shape
    if He < d:
        return (f"w='inverse' needs H*d_head >= d, but layer {layer} has H*d_head={He} < d={d}; "
                f"use w='value' or an explicit w")
    if sv[-1] <= rank_tolerance(sv, shape):
        return (f"w='inverse' needs V_cat^T V_cat invertible, but layer {layer}'s value matrix is "
                f"rank-deficient (smallest singular value {sv[-1]:.3g}, largest {sv[0]:.3g}); "
                f"use w='value' or an explicit w")
    return None


def resolve_w(V: np.ndarray, w: str = "auto", layer: int = -1) -> WChoice:
    """Which closed-form w a string choice means for the value matrix V_cat (H e, d).

    ``"auto"`` is ``"inverse"`` when V_cat has full column rank d (so z = u is reachable)
    and ``"value"`` otherwise (H e < d, or grouped-query heads, whose V_cat repeats each
    key/value head over its group); ``"value"`` is kept; ``"inverse"`` is kept where it is
    possible and refused (ValueError, with the reason) where it is not. One SVD of V_cat
    on the host."""
    if not isinstance(w, str) or w not in W_CHOICES:
        raise ValueError(f"unknown w {w!r}; expected one of {W_CHOICES}")
    V = np.asarray(V, np.float64)
    sv = np.linalg.svd(V, compute_uv=False)
    refusal = _inverse_refusal(V.shape, sv, layer) if sv.size and sv[0] > 0 else \
        f"w='inverse' needs V_cat of full column rank, but layer {layer}'s value matrix is zero"
    if w == "inverse" and refusal is not None:
        raise ValueError(refusal)
    kind = w if w != "auto" else ("inverse" if refusal is None else "value")
    rank = int(np.sum(sv > rank_tolerance(sv, V.shape))) if sv.size and sv[0] > 0 else 0
    return WChoice(requested=w, kind=kind, rank=rank, d=V.shape[1], layer=layer)


def layer_w_choice(layers: Layers, w: str = "auto", layer: int = -1) -> WChoice:
    """:func:`resolve_w` for unique layer ``layer`` of ``layers`` (its V_cat in float64)."""
    l = layer_index(layers, layer)
    return resolve_w(host_matrices(layers, l)[1], w, l)


def _min_norm_solve(V: np.ndarray, B: np.ndarray, layer: int) -> np.ndarray:
    """pinv(V^T) B: the minimum-norm solution W of V^T W = B (V (H e, d), B (d,) or (d, k)).

    Least squares on V^T itself (SVD, LAPACK ``gelsd``), so V^T W - B is at float64 rounding
    times cond(V), not cond(V)^2 as through the normal equations V (V^T V)^{-1}. Error if
    H e < d or V is rank-deficient (then no W gives V^T W = B for every B).
    """
    if V.shape[0] < V.shape[1]:
        raise ValueError(_inverse_refusal(V.shape, None, layer))
    W, _, _, sv = np.linalg.lstsq(V.T, B, rcond=None)
    refusal = _inverse_refusal(V.shape, sv, layer)
    if refusal is not None:
        raise ValueError(refusal)
    return W


def inverse_map(V: np.ndarray, layer: int = -1) -> np.ndarray:
    """pinv(V^T) = V (V^T V)^{-1}: (H e, d), so that V^T pinv(V^T) = I_d. Error if rank V < d."""
    return _min_norm_solve(V, np.eye(V.shape[1]), layer)


def choose_w(V: np.ndarray, u: np.ndarray, w: Union[str, np.ndarray], layer: int = -1) -> np.ndarray:
    """The read-in vector w (H e,) for direction u (see module docstring)."""
    He = V.shape[0]
    if isinstance(w, str):
        if w == "auto":
            w = resolve_w(V, w, layer).kind
        if w == "inverse":
            return _min_norm_solve(V, u, layer)
        if w == "value":
            Vu = V @ u
            n = np.linalg.norm(Vu)
            if n == 0:
                raise ValueError(f"w='value' is undefined: V_cat u = 0 on layer {layer} (u is in the value null space)")
            return Vu / n
        raise ValueError(f"unknown w {w!r}; expected one of {W_CHOICES} or an array of shape ({He},)")
    a = np.asarray(w, np.float64)
    if a.shape != (He,):
        raise ValueError(f"w must have shape ({He},) (H*d_head of layer {layer}), got {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("w contains non-finite values (NaN or inf)")
    if not np.any(a):
        raise ValueError("w is the zero vector")
    return a


def steer_layers(layers: Layers, delta_O, layer: int = -1) -> Layers:
    """Layers with W_o[layer] += delta_O (d, H e). Works on NumPy or traced JAX arrays."""
    import jax.numpy as jnp
    l = layer_index(layers, layer)
    W_o = layers.W_o
    delta = jnp.asarray(delta_O, W_o.dtype)
    if tuple(delta.shape) != tuple(W_o.shape[1:]):
        raise ValueError(f"delta_O has shape {tuple(delta.shape)}, expected {tuple(W_o.shape[1:])} (d, H*d_head)")
    return layers.replace(W_o=W_o.at[l].add(delta))


def asymptotic_prediction(F: np.ndarray, u: np.ndarray, z: np.ndarray, alpha: float):
    """lambda' = alpha z.u + z^T F u / z.u and x' ∝ (lambda' I - F)^{-1} u (unit, x'.u >= 0).

    Returns (nan, nan-vector) when z.u = 0 (no rank-1 branch to leading order).
    """
    zu = float(z @ u)
    d = F.shape[0]
    if abs(zu) <= 1e-14 * np.linalg.norm(z):
        return float("nan"), np.full(d, np.nan)
    lam = alpha * zu + float(z @ F @ u) / zu
    try:
        x = np.linalg.solve(lam * np.eye(d) - F, u)
    except np.linalg.LinAlgError:
        x = u.copy()
    x = x / np.linalg.norm(x)
    return lam, x * (1.0 if x @ u >= 0 else -1.0)


@dataclasses.dataclass
class Rank1Result:
    """Everything about one rank-1 perturbation O' = O + alpha u w^T of unique layer ``layer``."""

    layers: Layers                 # the steered parameters (same dtype as the input)
    layer: int                     # unique-layer index (non-negative)
    alpha: float
    u: np.ndarray                  # (d,) unit
    w: np.ndarray                  # (H e,)
    w_kind: str                    # the choice used: "inverse", "value" or "given" (an explicit array)
    z: np.ndarray                  # (d,) = V_cat^T w
    delta_O: np.ndarray            # (d, H e) = alpha u w^T
    delta_norm: float              # ||delta_O||_F = alpha ||w||
    F: np.ndarray                  # (d, d) before
    F_new: np.ndarray              # (d, d) after = F + alpha u z^T
    predicted_eigenvalue: float    # asymptotic lambda'
    predicted_eigenvector: np.ndarray   # (d,) unit
    branch_eigenvalue: complex     # exact eigenvalue of F' closest to the prediction
    branch_eigenvector: np.ndarray      # its unit eigenvector (real part, sign to u)
    spectrum: Optional[LayerSpectrum]   # exact spectrum of F', both orderings (None if not asked)

    @property
    def exact_top(self) -> complex:
        """Principal eigenvalue of F' in the shifted ordering (|1 + lambda|); NaN if not computed."""
        return self.spectrum.shifted.top if self.spectrum is not None else complex(np.nan, np.nan)

    @property
    def zu(self) -> float:
        return float(self.z @ self.u)

    def checkpoint_delta(self, family) -> np.ndarray:
        """delta_O in the stored layout of the checkpoint's output projection (see
        :func:`powerlens._src.models.layout.checkpoint_delta`): ``family`` is a family name, a
        ModelInfo or a Model (the layers alone do not know their family: pass ``model`` or
        ``model.info``)."""
        return checkpoint_delta(family, self.delta_O)

    def to_json(self) -> dict:
        c = lambda z: [float(np.real(z)), float(np.imag(z))]
        out = {"layer": self.layer, "w": self.w_kind, "alpha": self.alpha, "delta_norm": self.delta_norm,
               "z_dot_u": self.zu, "predicted_top_eigenvalue": self.predicted_eigenvalue}
        if self.spectrum is None:
            return out
        return {
            **out,
            "exact_branch_eigenvalue": c(self.branch_eigenvalue),
            "exact_top_eigenvalue_shifted": c(self.spectrum.shifted.top),
            "exact_top_eigenvalue_plain": c(self.spectrum.plain.top),
            "eigenvector_cos_u": float(abs(self.branch_eigenvector @ self.u)),
            "predicted_eigenvector_cos_exact": float(abs(self.predicted_eigenvector @ self.branch_eigenvector)),
            "spectrum": self.spectrum.to_json(),
        }


def rank1(layers: Layers, u, *, alpha, w: Union[str, np.ndarray] = "auto", layer: int = -1,
          spectrum: bool = True) -> Rank1Result:
    """Closed-form rank-1 steering O' = O + alpha u w^T of unique layer ``layer``.

    Args:
      layers: the system (its dtype is kept for the steered parameters).
      u: direction (d,), normalised here (zero / non-finite / wrong size: ValueError).
      alpha: strength > 0.
      w: ``"auto"`` (``"inverse"`` where V_cat has full column rank, else ``"value"``),
        ``"inverse"`` (z = u), ``"value"`` (max z.u for unit w) or an explicit (H e,) vector;
        the choice used is ``w_kind``.
      layer: unique-layer index (default the last). For a shared-weight system this
        perturbs the one shared layer, hence every step.
      spectrum: compute the exact spectrum of F' (host float64 eig + Schur: a few
        dense decompositions of a (d, d) matrix); False leaves ``spectrum`` None and the
        branch eigenpair NaN (for quick parameter edits on large models).
    """
    l = layer_index(layers, layer)
    d = layers.config.d_model
    u = as_direction(u, d)
    alpha = check_alpha(alpha)
    W_o, V, F = host_matrices(layers, l)
    if isinstance(w, str) and w == "auto":
        w = resolve_w(V, w, l).kind
    w_kind = w if isinstance(w, str) else "given"
    wv = choose_w(V, u, w, l)
    z = V.T @ wv
    delta = alpha * np.outer(u, wv)
    F_new = F + alpha * np.outer(u, z)
    lam, x = asymptotic_prediction(F, u, z, alpha)
    if not spectrum:
        return Rank1Result(
            layers=steer_layers(layers, delta, l), layer=l, alpha=alpha, u=u, w=wv, w_kind=w_kind, z=z,
            delta_O=delta, delta_norm=float(alpha * np.linalg.norm(wv)), F=F, F_new=F_new, predicted_eigenvalue=lam,
            predicted_eigenvector=x, branch_eigenvalue=complex(np.nan, np.nan), branch_eigenvector=np.full(d, np.nan),
            spectrum=None)
    factors = host_factors(layers, l, W_o + delta)
    ev, vectors = eigen_decomposition(F_new, factors)
    target = lam if np.isfinite(lam) else ev[np.argmax(np.abs(1 + ev))]
    k = int(np.argmin(np.abs(ev - target)))
    v = np.real(vectors([k])[:, 0])
    nv = np.linalg.norm(v)
    v = v / nv if nv > 0 else v
    v = v * (1.0 if v @ u >= 0 else -1.0)
    return Rank1Result(
        layers=steer_layers(layers, delta, l), layer=l, alpha=alpha, u=u, w=wv, w_kind=w_kind, z=z,
        delta_O=delta, delta_norm=float(alpha * np.linalg.norm(wv)), F=F, F_new=F_new, predicted_eigenvalue=lam,
        predicted_eigenvector=x, branch_eigenvalue=complex(ev[k]), branch_eigenvector=v,
        spectrum=layer_spectra(F_new[None], factors=(factors[0][None], factors[1][None]))[0])
