"""How large must alpha be? Two answers (design.md §4).

(a) Spectral: the smallest alpha from which u's direction is principal in the shifted
    ordering. Precisely, for F'(alpha) = F + alpha u z^T the condition P(alpha) is

      the eigenvalue lambda_1 of largest |1 + lambda| is real and strictly dominant
      (|1 + lambda_1| > (1 + gap_rtol) |1 + lambda_2|), its eigenvector v_1 is, of all
      eigenvectors of F', the one closest to u (largest |cos|; this picks the rank-1
      branch, not an unrelated eigenvector that happens to lean toward u, which a
      non-normal F can have), and |cos(v_1, u)| >= cos_tol.

    :func:`principal_alpha` returns alpha* = inf{a : P(alpha) holds for every scanned
    alpha >= a}: a log grid over [1e-4, 1e5] x scale (scale = 1 + max |lambda(F)|) finds
    the last grid point where P fails, then bisection on the exact spectrum (numpy eig,
    float64) refines the crossing to ``rtol``. When u is an eigenvector of F with
    eigenvalue lambda_k and z = u (w = "inverse") the eigenvector is u itself and the
    closed form is alpha* = max_{j != k} |1 + lambda_j| - (1 + lambda_k).

(b) Alignment after one step of the ``paper`` rule: the smallest alpha for which every
    valid token leaving the steered layer has cos(y_i, u) >= c. Attention A does not
    depend on W_o, so for the input X (n, d) of the steered layer

      m_i = concat_h V_h (A_h X)_i  (+ b_v when the bias is kept)          (H e,)
      y~_i = x_i + W_o' m_i (+ b_o) = p_i + alpha s_i u,                    s_i = w.m_i
      p_i  = x_i + W_o m_i (+ b_o),  b_i = p_i.u,  p_perp_i = ||p_i - b_i u||

    N2 does not change the angle, so with beta_i = alpha s_i

      cos(y_i, u) = (b_i + beta_i) / sqrt(p_perp_i^2 + (b_i + beta_i)^2),

    increasing in b_i + beta_i. Setting it to c (0 < c < 1) and solving:

      beta_i* = c p_perp_i / sqrt(1 - c^2) - b_i.

    Token i is satisfied iff alpha s_i >= beta_i*:
      s_i > 0: alpha >= beta_i*/s_i (a lower bound);
      s_i < 0: alpha <= beta_i*/s_i (an upper bound; no alpha > 0 when beta_i* > 0);
      s_i = 0: always if beta_i* <= 0, never otherwise.
    alpha_min = max(0, max_{s_i > 0} beta_i*/s_i), feasible iff it is below every upper
    bound; otherwise :func:`alignment_alpha` raises, naming the token (use w="value", whose
    s_i = ||V u||^{-1} (V u).m_i, or a learned w). alpha_min = 0 means the tokens are
    already aligned. The alignment is the *signed* cosine with +u (we steer toward u).

    X is the state entering the steered step: for a layer-varying model steered at its last
    layer, the output of the first L-1 layers (computed here under the same rule). The
    relation is one-step: the steered unique layer must be applied once in the schedule
    (for a shared-weight system use ``layers.with_schedule((0,))``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.inputs import check_batch
from ..dynamics.layer import attention_output
from ..dynamics.options import Dynamics
from ..dynamics.params import Layers
from ..dynamics.observers import final
from ..dynamics.run import run, run_batch
from .directions import as_direction
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Real
from .rank1 import choose_w, host_factors, host_matrices, layer_index, layer_w_choice


def check_target(c, name: str = "target alignment") -> float:
    try:
        v = float(c)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1), got {c!r}") from None
    if not np.isfinite(v) or not 0.0 < v < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {c!r}")
    return v


# ------------------------------------------------------------------ (a) spectral

@dataclasses.dataclass
class PrincipalAlpha:
    alpha: float                # the smallest alpha from which u's direction is principal
    eigenvalue: complex         # principal eigenvalue of F'(alpha) (shifted ordering)
    cos: float                  # |cos(v_1, u)| at alpha
    cos_tol: float

    def to_json(self):
        return {"alpha": self.alpha, "eigenvalue": [self.eigenvalue.real, self.eigenvalue.imag],
                "cos": self.cos, "cos_tol": self.cos_tol}


def _judge(ev, vecs, u, cos_tol, gap_rtol, *, other_key: float = 0.0, other_cos: float = 0.0):
    """P(alpha) from eigenpairs of F'(alpha) for a batch of alphas: eigenvalues ev "complex[G k]",
    eigenvectors vecs "[G d k]"; ``other_key`` and ``other_cos``: the key |1 + lambda| of
    eigenvalues left out of ev and the largest |cos| with u in their eigenspace (0: none).
    Returns (ok (G,), top eigenvalue (G,), |cos| (G,))."""
    key = np.abs(1.0 + ev)
    order = np.argsort(-key, axis=1)
    g = np.arange(ev.shape[0])
    i1 = order[:, 0]
    k2 = key[g, order[:, 1]] if ev.shape[1] > 1 else np.zeros(ev.shape[0])
    lam = ev[g, i1]
    real = np.abs(lam.imag) <= 1e-12 * (1.0 + np.abs(lam))
    cos_all = np.abs(np.einsum("gdk,d->gk", vecs, u)) / np.maximum(np.linalg.norm(vecs, axis=1), 1e-300)
    cos = cos_all[g, i1]
    closest = cos >= np.maximum(cos_all.max(axis=1), other_cos) * (1.0 - 1e-12)
    dominant = key[g, i1] > (1.0 + gap_rtol) * np.maximum(k2, other_key)
    return real & dominant & closest & (cos >= cos_tol), lam, cos


def _principal_ok(F, u, z, alphas, cos_tol, gap_rtol):
    """P(alpha) for a batch of alphas: (ok (G,), top eigenvalue (G,), |cos| (G,))."""
    Fs = F[None] + np.asarray(alphas)[:, None, None] * np.outer(u, z)[None]
    return _judge(*np.linalg.eig(Fs), u, cos_tol, gap_rtol)


TOP_K = 6          # eigenpairs of largest |1 + lambda| that the fast predicate computes


def _principal_ok_top(F, u, z, alpha: float, cos_tol, gap_rtol):
    """P(alpha) from the TOP_K eigenpairs of largest |1 + lambda| only (ARPACK on I + F',
    O(d^2) per iteration instead of a full O(d^3) eig): ``closest`` is then judged among
    those TOP_K eigenvectors. None when ARPACK does not converge (the caller uses the full
    eig). Same return as :func:`_principal_ok` for one alpha."""
    from scipy.sparse.linalg import ArpackNoConvergence, eigs
    d = F.shape[0]
    M = np.eye(d) + F + alpha * np.outer(u, z)
    try:
        vals, vecs = eigs(M, k=TOP_K, which="LM", v0=np.full(d, 1.0 / np.sqrt(d)) + 0.5 * u, tol=0,
                          maxiter=50 * d)
    except ArpackNoConvergence:
        return None
    order = np.argsort(-np.abs(vals))
    vals, vecs = vals[order], vecs[:, order]
    lam = vals[0] - 1.0
    real = abs(lam.imag) <= 1e-12 * (1.0 + abs(lam))
    cos_all = np.abs(u @ vecs) / np.maximum(np.linalg.norm(vecs, axis=0), 1e-300)
    ok = real and abs(vals[0]) > (1.0 + gap_rtol) * abs(vals[1]) and cos_all[0] >= cos_all.max() * (1.0 - 1e-12) \
        and cos_all[0] >= cos_tol
    return np.array([ok]), np.array([lam]), np.array([cos_all[0]])


def _factored_predicate(A, B, u, z, cos_tol, gap_rtol):
    """P(alpha) (same return as :func:`_principal_ok`) through the r x r matrices of F = A B
    (A "[d r]", B "[r d]", r < d; grouped-query attention), or None when z is not in the row
    space of B (then F' has no such factors).

    With z = B^T w~, F'(alpha) = (A + alpha u w~^T) B, so its nonzero eigenvalues are those of
    M(alpha) = B A + alpha (B u) w~^T with eigenvectors (A + alpha u w~^T) y
    (:func:`powerlens._src.analysis.spectra._eig_factored`), and its d - r others are 0 (|1 + 0| = 1)
    with eigenspace null(B). In that eigenspace the eigenvector closest to u is u's projection,
    at |cos| = ||P_null(B) u||, the value ``closest`` is judged against for it."""
    d, r = A.shape
    wt, *_ = np.linalg.lstsq(B.T, z, rcond=None)
    if np.linalg.norm(B.T @ wt - z) > 1e-9 * max(np.linalg.norm(z), 1e-300):
        return None
    Q, _ = np.linalg.qr(B.T)                                          # (d, r): the row space of B
    null_cos = float(np.sqrt(max(1.0 - np.linalg.norm(Q.T @ u) ** 2, 0.0))) if d > r else 0.0
    BA, Bu = B @ A, B @ u

    def predicate(alphas):
        a = np.atleast_1d(np.asarray(alphas, np.float64))
        ev, Y = np.linalg.eig(BA[None] + a[:, None, None] * np.outer(Bu, wt)[None])    # (G, r), (G, r, r)
        X = A @ Y + a[:, None, None] * u[None, :, None] * (wt @ Y)[:, None, :]          # (G, d, r)
        return _judge(ev, X, u, cos_tol, gap_rtol, other_key=1.0 if d > r else 0.0, other_cos=null_cos)

    return predicate


def principal_alpha(layers: Layers, u, *, w: Union[str, np.ndarray] = "auto", layer: int = -1,
                    cos_tol: float = 0.95, gap_rtol: float = 1e-9, rtol: float = 1e-7,
                    grid: int = 28) -> PrincipalAlpha:
    """(a): the smallest alpha making u's direction principal in the shifted ordering.

    When F = A B with r < d (grouped-query attention, :func:`_factored_predicate`) every step is
    an exact r x r eig. Otherwise, for d >= 64, the grid and the bisection use the top eigenpairs only
    (:func:`_principal_ok_top`, seconds less per step on a 640-wide layer), and the result is
    checked on the full spectrum: P must hold at the returned alpha with every eigenvector
    considered, and fail at the bisection's lower end; otherwise the whole search is redone
    on the full spectrum."""
    l = layer_index(layers, layer)
    u = as_direction(u, layers.config.d_model)
    cos_tol = check_target(cos_tol, "cos_tol") if cos_tol != 1.0 else 1.0
    W_o, V, F = host_matrices(layers, l)
    z = V.T @ choose_w(V, u, w, l)
    A, B = host_factors(layers, l, W_o)
    factored = _factored_predicate(A, B, u, z, cos_tol, gap_rtol) if A.shape[1] < A.shape[0] else None
    if factored is not None:
        scale = 1.0 + float(np.max(np.abs(np.linalg.eigvals(B @ A)), initial=0.0))
        return _principal_search(F, u, z, factored, l, cos_tol, rtol, grid, scale)[0]
    full = lambda a: _principal_ok(F, u, z, a, cos_tol, gap_rtol)
    if F.shape[0] >= 64:
        def top(a):
            out = [_principal_ok_top(F, u, z, float(x), cos_tol, gap_rtol) for x in np.atleast_1d(a)]
            if any(o is None for o in out):
                return full(a)
            return tuple(np.concatenate(parts) for parts in zip(*out))
        res = _principal_search(F, u, z, top, l, cos_tol, rtol, grid)
        lo = res[1]
        if bool(full(np.array([max(res[0].alpha, 1e-300)]))[0][0]) and (lo is None or not full(np.array([lo]))[0][0]):
            return res[0]
    return _principal_search(F, u, z, full, l, cos_tol, rtol, grid)[0]


def _principal_search(F, u, z, predicate, l, cos_tol, rtol, grid, scale=None):
    """The grid-then-bisection search of :func:`principal_alpha` with ``predicate``
    (alphas "float[G]" -> (ok, lambda_1, |cos|)) over ``scale`` x [1e-4, 1e5] (default scale
    1 + max |lambda(F)|); returns (result, the bisection's lower end or None when it started at 0)."""
    if scale is None:
        scale = 1.0 + float(np.max(np.abs(np.linalg.eigvals(F))))
    alphas = scale * np.logspace(-4, 5, grid)  # one batched eig; then ~log2(ratio/rtol) single eigs
    ok, _, _ = predicate(alphas)
    if not ok[-1]:
        raise ValueError(f"u's direction is not principal (|cos| >= {cos_tol}) even at alpha={alphas[-1]:.3g} "
                         f"on layer {l}: z.u = {float(z @ u):.3g}; choose another w")
    fails = np.nonzero(~ok)[0]
    if len(fails) == 0:
        lo, hi = 0.0, alphas[0]
        lo_ok = bool(predicate(np.array([1e-300]))[0][0])
        if lo_ok:  # already principal without steering
            hi = 0.0
    else:
        lo, hi = alphas[fails[-1]], alphas[fails[-1] + 1]
    while hi - lo > rtol * max(hi, 1e-300) and hi > 0:
        mid = 0.5 * (lo + hi)
        if predicate(np.array([mid]))[0][0]:
            hi = mid
        else:
            lo = mid
    _, lam, cos = predicate(np.array([max(hi, 1e-300)]))
    result = PrincipalAlpha(alpha=float(hi), eigenvalue=complex(lam[0]), cos=float(cos[0]), cos_tol=cos_tol)
    return result, (lo if lo > 0 else None)


# ------------------------------------------------------------------ (b) one-step alignment

def steered_steps(layers: Layers, layer: int) -> Sequence[int]:
    """The schedule steps that apply unique layer ``layer`` (a tuple, or a range)."""
    l = layer_index(layers, layer)
    steps = layers.schedule.steps_of(l)               # a range for a compact schedule
    if not steps:
        raise ValueError(f"unique layer {l} is never applied by the schedule {layers.schedule}")
    return steps


def prepare_tokens(layers: Layers, x0, valid=None):
    """x0 -> "float[B n d]" in the layers' dtype, valid "bool[B n]" (validated)."""
    x, valid = check_batch(x0, valid, layers.config.d_model)
    return jnp.asarray(x, layers.dtype), jnp.asarray(valid)


def entering_states(layers: Layers, x0: Real[ArrayLike, "*B n d"],
                    valid: Bool[ArrayLike, "*B n"] | Int[ArrayLike, "*B n"] | None = None, *,
                    layer: int = -1,
                    rule: str = "paper", attention: str = "softmax", keep_bias: Optional[bool] = None,
                    positions=None):
    """The tokens entering the first step that applies unique layer ``layer`` "float[B n d]",
    and the mask "bool[B n]": the ``final()`` observer of the steps before it.

    They do not depend on that layer's W_o (earlier steps use other layers)."""
    X, valid = prepare_tokens(layers, x0, valid)
    t = steered_steps(layers, layer)[0]
    if t == 0:
        return X, valid
    out = run_batch(layers, X, valid, dynamics=Dynamics(rule, attention, keep_bias), positions=positions,
                    schedule=np.asarray(layers.schedule[:t]), observe=("final",))
    return out["final"], valid


def head_mix(lp, X: Real[ArrayLike, "n d"], valid: Bool[ArrayLike, "n"], *, keep_bias: bool, attention: str = "softmax",
             positions=None) -> Float[Array, "n He"]:
    """m_i = concat_h (A_h X V_h^T)_i (+ b_v when ``keep_bias``), the heads' outputs before W_o,
    so that attn(X)_i = W_o m_i (+ b_o): :func:`~powerlens._src.dynamics.layer.attention_output`
    with W_o = I and no b_o (rows of A sum to 1, so the values' bias passes through whole)."""
    He = lp.W_o.shape[1]
    mixer = lp.replace(W_o=jnp.eye(He, dtype=lp.W_o.dtype), b_o=None)
    return attention_output(mixer, X, valid, attention=attention, keep_bias=keep_bias, positions=positions)


def _one_step_terms(lp, X, valid, keep_bias, attention, positions):
    """p (n, d) and m (n, H e) of one prompt for one layer (see module docstring)."""
    m = head_mix(lp, X, valid, keep_bias=keep_bias, attention=attention, positions=positions)
    p = X + m @ lp.W_o.T
    if keep_bias and lp.b_o is not None:
        p = p + lp.b_o
    return p, m


terms_batch = jax.jit(jax.vmap(_one_step_terms, in_axes=(None, 0, 0, None, None, None)),
                       static_argnames=("keep_bias", "attention"))


@dataclasses.dataclass
class AlignmentAlpha:
    alpha: float                 # smallest alpha >= 0 with cos(y_i, u) >= c for all valid tokens
    target: float                # c
    worst: Tuple[int, int]       # (prompt, token) that sets alpha
    upper: float                 # largest feasible alpha (inf unless some s_i < 0)
    beta_star: np.ndarray        # (B, n) required beta_i*
    s: np.ndarray                # (B, n) s_i = w.m_i
    b: np.ndarray                # (B, n) p_i.u
    p_perp: np.ndarray           # (B, n)
    valid: np.ndarray            # (B, n)
    w: np.ndarray                # (H e,)

    def cos(self, alpha) -> np.ndarray:
        """Predicted cos(y_i, u) at ``alpha`` (B, n), NaN on padding."""
        q = self.b + alpha * self.s
        out = q / np.sqrt(self.p_perp ** 2 + q ** 2)
        return np.where(self.valid, out, np.nan)

    def to_json(self):
        return {"alpha": self.alpha, "target": self.target, "worst_token": list(self.worst),
                "upper": self.upper if np.isfinite(self.upper) else None}


def alignment_alpha(layers: Layers, X, u, *, target: float = 0.99, valid=None,
                    w: Union[str, np.ndarray] = "auto", layer: int = -1, keep_bias: bool = False,
                    attention: str = "softmax", positions=None, signed: bool = True) -> AlignmentAlpha:
    """(b) for the ``paper`` rule: exact alpha from the one-step relation (module docstring).

    X: tokens *entering* the steered layer, (n, d) or (B, n, d) (see :func:`entering_states`).
    ``signed=False`` asks for the sign-free alignment |cos(y_i, u)| >= c (the gamma of
    design.md §3; a power step sends a token to +u or -u by the sign of s_i). Then
    token i is aligned for every alpha >= (K_i - sgn(s_i) b_i) / |s_i| with
    K_i = c p_perp_i / sqrt(1 - c^2), and alpha* is the largest of these (or 0).
    """
    c = check_target(target)
    l = layer_index(layers, layer)
    d = layers.config.d_model
    u = as_direction(u, d)
    _, V, _ = host_matrices(layers, l)
    wv = choose_w(V, u, w, l)
    Xb, vb = prepare_tokens(layers, X, valid)
    p, m = terms_batch(layers.layer(l), Xb, vb, keep_bias, attention, positions)
    p = np.asarray(p, np.float64)
    m = np.asarray(m, np.float64)
    vb = np.asarray(vb)
    s = m @ wv
    b = p @ u
    p_perp = np.sqrt(np.maximum(np.sum(p * p, -1) - b * b, 0.0))
    beta = c * p_perp / np.sqrt(1.0 - c * c) - b
    if not signed:
        K = c * p_perp / np.sqrt(1.0 - c * c)
        zero_bad = vb & (s == 0) & (np.abs(b) < K)
        if zero_bad.any():
            i = tuple(int(k) for k in np.argwhere(zero_bad)[0])
            raise ValueError(f"token {i} (prompt, position) has s = w.m = 0: the rank-1 term does not reach it, "
                             f"so no alpha aligns it to {c}; use another w")
        each = np.where(vb & (s != 0), (K - np.sign(s) * b) / np.where(s != 0, np.abs(s), 1.0), -np.inf)
        alpha = max(0.0, float(each.max()))
        worst = tuple(int(k) for k in np.unravel_index(np.argmax(each), each.shape))
        beta_abs = np.sign(s) * K - b
        return AlignmentAlpha(alpha=alpha, target=c, worst=worst, upper=float("inf"),
                              beta_star=np.where(vb, beta_abs, np.nan), s=np.where(vb, s, np.nan),
                              b=np.where(vb, b, np.nan), p_perp=np.where(vb, p_perp, np.nan), valid=vb, w=wv)
    pos = vb & (s > 0)
    lower = np.where(pos, beta / np.where(pos, s, 1.0), -np.inf)
    neg = vb & (s < 0)
    upper_each = np.where(neg, beta / np.where(neg, s, -1.0), np.inf)
    zero_bad = vb & (s == 0) & (beta > 0)
    if zero_bad.any():
        i = tuple(int(k) for k in np.argwhere(zero_bad)[0])
        raise ValueError(f"token {i} (prompt, position) has s = w.m = 0: the rank-1 term does not reach it, "
                         f"so no alpha aligns it to {c}; use another w")
    alpha = max(0.0, float(lower.max()))
    upper = float(upper_each.min())
    if alpha > upper:
        i = tuple(int(k) for k in np.unravel_index(np.argmin(upper_each), upper_each.shape))
        raise ValueError(
            f"no alpha > 0 gives every token alignment {c}: token {i} (prompt, position) has s = w.m = "
            f"{s[i]:.3g} < 0, so increasing alpha turns it away from u (it needs alpha <= {upper:.3g} but "
            f"another token needs alpha >= {alpha:.3g}); use signed=False (sign-free alignment, the paper's "
            f"gamma), w='value' or a learned w")
    worst = tuple(int(k) for k in np.unravel_index(np.argmax(lower), lower.shape))
    return AlignmentAlpha(alpha=alpha, target=c, worst=worst, upper=upper, beta_star=np.where(vb, beta, np.nan),
                          s=np.where(vb, s, np.nan), b=np.where(vb, b, np.nan),
                          p_perp=np.where(vb, p_perp, np.nan), valid=vb, w=wv)


@dataclasses.dataclass
class MinimalAlpha:
    principal: PrincipalAlpha
    alignment: Optional[AlignmentAlpha]

    def to_json(self):
        return {"principal": self.principal.to_json(),
                "alignment": None if self.alignment is None else self.alignment.to_json()}


def minimal_alpha(layers: Layers, u, x0=None, *, valid=None, target: float = 0.99,
                  w: Union[str, np.ndarray] = "auto", layer: int = -1, cos_tol: float = 0.95,
                  keep_bias: bool = False, attention: str = "softmax", positions=None,
                  signed: bool = True) -> MinimalAlpha:
    """Both minimal alphas: (a) spectral, (b) one-step alignment of every token (``paper`` rule).

    x0: initial tokens (n, d) or (B, n, d); the steps before the steered one are run
    unsteered under ``paper`` to get the tokens entering it. The steered unique layer must
    be applied exactly once. Without x0 only (a) is computed.
    """
    if isinstance(w, str) and w == "auto":
        w = layer_w_choice(layers, w, layer).kind
    principal = principal_alpha(layers, u, w=w, layer=layer, cos_tol=cos_tol)
    if x0 is None:
        return MinimalAlpha(principal, None)
    steps = steered_steps(layers, layer)
    if len(steps) > 1:
        raise ValueError(f"unique layer {layer_index(layers, layer)} is applied at steps {steps}; the exact "
                         f"one-step relation needs it applied once (for a shared-weight system use "
                         f"layers.with_schedule((0,)))")
    X, vb = entering_states(layers, x0, valid, layer=layer, rule="paper", attention=attention,
                            keep_bias=keep_bias, positions=positions)
    return MinimalAlpha(principal, alignment_alpha(layers, X, u, target=target, valid=vb, w=w, layer=layer,
                                                   keep_bias=keep_bias, attention=attention,
                                                   positions=positions, signed=signed))


def run_tail(layers: Layers, X: Float[ArrayLike, "B n d"], valid: Bool[ArrayLike, "B n"], tail, *, rule, attention,
             keep_bias, positions=None) -> Float[Array, "B n d"]:
    """Final tokens after the steps ``tail`` (a static Schedule or tuple of unique-layer indices): the
    ``final()`` observer of :func:`powerlens._src.dynamics.run`, vmapped over prompts (traceable:
    the optimiser differentiates through it). Only the layers of the tail are kept; their
    weights are read in place (no transposed copies inside the differentiated program)."""
    sub = layers.select(tail)
    one = lambda x, v: run(sub, x, v, dynamics=Dynamics(rule, attention, keep_bias), positions=positions,
                           observers={"final": final()})["final"]
    return jax.vmap(one)(X, valid)
