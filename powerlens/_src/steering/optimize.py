"""Gradient-based steering with optax, vmapped over target directions (design.md §4).

Problem, for a direction u (d,), prompts X0 (B, n, d) and the steered unique layer l::

    minimise   ||delta_O||_F^2
    subject to a(delta_O) >= target,   a = mean (or min) over valid tokens of cos(y_i, u)

where y_i are the *final* tokens of the schedule run under ``rule`` (default ``paper``)
with W_o[l] + delta_O. Gradients flow through the dynamics (the scan of
:func:`powerlens._src.dynamics.run`), never through eigenvector derivatives. Steps before the first one that
applies layer l do not depend on delta_O and are run once, outside the optimisation.

Parameterisations (``param``)::

    "w_alpha"   delta_O = e^a u w^T            (a scalar, w (H e,)), rank 1 with u fixed
    "lowrank"   delta_O = n0 P Q^T             (P (d, r), Q (H e, r)), rank r, u not imposed

Constraint: augmented Lagrangian for g = target - a <= 0, with normalised norm
N = ||delta_O||_F^2 / n0^2::

    L(theta; lam) = N + (max(0, lam + mu g)^2 - lam^2) / (2 mu),
    lam <- max(0, lam + mu g) every ``dual_every`` Adam steps.

Adam's step size follows a cosine decay from ``lr`` to ``0.05 lr`` over the steps (the
norm shrinks by large factors, so a constant step becomes too large late in the run).

Initialisation is the closed form at the target: w_cf ("inverse" = pinv(V^T) u or "value";
"auto" picks "inverse" where V_cat has full column rank, see :func:`~.rank1.resolve_w`),
alpha_cf found by bisection on log alpha so that a(alpha_cf u w_cf^T) = target (a is
assumed increasing in alpha along that ray); n0 = ||alpha_cf u w_cf^T||_F, the closed
form's norm at equal alignment, which the result is compared with. The best feasible
iterate (a >= target - tol, smallest norm) is returned; the closed form itself is
feasible, so the result is never worse than it (up to ``tol``).

Everything for one direction is a pure function (``solve_one``), in three phases (start,
Adam steps, finish); ``optimize_steering`` runs them vmapped over K directions at once, the
Adam steps in chunks called from the host (:func:`solve_in_chunks`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..dynamics.layer import check_rule, default_keep_bias
from ..dynamics.options import Dynamics
from ..dynamics.params import Layers
from .alpha import check_target, entering_states, run_tail, steered_steps
from .directions import as_direction
from .edits import EDITS, delta_matrix, delta_sq, edit_factors, factor_norm, initial_params
from .progress import active_progress
from .lagrangian import (CHUNK, adam_finish, adam_start, adam_steps, bisect_increasing, default_optimizer,
                         map_targets, solve_in_chunks)
from .rank1 import W_CHOICES, factor_rank, host_matrices, inverse_map, layer_index, resolve_w

PARAMS = ("w_alpha", "lowrank")
OBJECTIVES = ("alignment", "token")
REDUCTIONS = ("mean", "min")


# ------------------------------------------------------------------ pure pieces

def token_cos(Y, u):
    """cos(y_i, u) for every token: (B, n)."""
    return (Y @ u) / jnp.linalg.norm(Y, axis=-1)


def reduce_alignment(cos, valid, reduce: str):
    if reduce == "mean":
        w = valid.astype(cos.dtype)
        return jnp.sum(cos * w) / jnp.maximum(jnp.sum(w), 1.0)
    return jnp.min(jnp.where(valid, cos, jnp.inf))


def _alignment(layers, delta, X, valid, u, *, layer, tail, rule, attention, keep_bias, reduce, positions,
               signed=True):
    steered = layers.replace(W_o=layers.W_o.at[layer].add(delta))
    Y = run_tail(steered, X, valid, tail, rule=rule, attention=attention, keep_bias=keep_bias, positions=positions)
    cos = token_cos(Y, u)
    return reduce_alignment(cos if signed else jnp.abs(cos), valid, reduce)


def _paper_last_layer(pm, u, valid, reduce, signed, dtype):
    """The closed-form alignment of a last, paper-rule steered layer (see :func:`solve_one`):
    (along_u(scale, w), align_lowrank(params, n0), reduced coordinates or None).

    ``reduced`` holds the bases of the reduced problem (``lowrank`` only): Bp0, Bm, q_hat,
    u_red."""
    p_out, m_mix = pm["p"], pm["m"]
    pu = p_out @ u                                   # (B, n)
    pp = jnp.sum(p_out * p_out, axis=-1)             # (B, n)
    Bp0, Bm = pm["Bp"], pm["Bm"]
    c_u = Bp0.T @ u                                  # u = Bp0 c_u + q, q orthogonal to every p_i
    q = u - Bp0 @ c_u
    nq = jnp.linalg.norm(q)
    q_hat = jnp.where(nq > 1e-6, q / jnp.where(nq > 1e-6, nq, 1.0), 0.0)
    p_red = jnp.concatenate([p_out @ Bp0, jnp.zeros(p_out.shape[:-1] + (1,), dtype)], axis=-1)
    m_red, u_red = m_mix @ Bm, jnp.concatenate([c_u, nq[None]])

    def align_cos(yu, yy):
        cos = yu / jnp.sqrt(yy)
        return reduce_alignment(cos if signed else jnp.abs(cos), valid, reduce)

    def along_u(scale, w):
        """Final cos for the change scale (w.m) u: y.u and ||y||^2 in closed form."""
        c = scale * (m_mix @ w)                      # (B, n)
        return align_cos(pu + c, pp + 2.0 * c * pu + c * c)

    def align_lowrank(prm, n0):
        """y = p + n0 P (Q^T m), P = Bp P~, Q = Bm Q~: y.u and ||y||^2 from (B, n, r) products."""
        # the small contractions are written elementwise: under vmap over directions a
        # batched (K, r, r) dot would become K tiny GEMMs on a CPU
        a = n0 * (m_red @ prm["Q"])                  # (B, n, r): one GEMM over directions
        P_ = prm["P"]
        Pu = jnp.sum(P_ * u_red[:, None], axis=0)                      # (r,)
        G = jnp.sum(P_[:, :, None] * P_[:, None, :], axis=0)           # (r, r) = P^T P
        yu = pu + jnp.sum(a * Pu, axis=-1)
        aG = jnp.sum(a[..., :, None] * G, axis=-2)
        yy = pp + 2.0 * jnp.sum(a * (p_red @ P_), axis=-1) + jnp.sum(aG * a, axis=-1)
        return align_cos(yu, yy)

    reduced = {"Bp0": Bp0, "Bm": Bm, "q_hat": q_hat, "u_red": u_red}
    return along_u, align_lowrank, reduced


def closed_form_start(ray, target, dtype, bisect_iters: int):
    """Bisection on log alpha in [-14, 14] along the closed-form ray (``ray(log_alpha)`` the
    alignment, assumed increasing): (log alpha_cf, whether the ray reaches ``target`` at all)."""
    lo0, hi0 = jnp.asarray(-14.0, dtype), jnp.asarray(14.0, dtype)
    _, log_cf = bisect_increasing(lambda mid: ray(mid) >= target, lo0, hi0, bisect_iters)
    return log_cf, ray(hi0) >= target


def _align_problem(layers, X, valid, u, R, positions, pm, *, layer, tail, rule, attention, keep_bias, reduce,
                   param, w_kind, signed):
    """The pieces of one direction's problem (see :func:`solve_one`): (w_cf "(H e,)", ray(log_alpha)
    -> alignment on the closed-form ray, align_params(params, n0) -> alignment, reduced bases or None)."""
    dtype = X.dtype
    w_cf = R @ u
    if w_kind == "value":
        w_cf = w_cf / jnp.linalg.norm(w_cf)
    reduced = None
    if pm is not None:
        along_u, align_lowrank, red = _paper_last_layer(pm, u, valid, reduce, signed, dtype)
        reduced = red if param == "lowrank" else None
        ray = lambda log_a: along_u(jnp.exp(log_a), w_cf)
        align_params = (lambda prm, n0: along_u(jnp.exp(prm["a"]), prm["w"])) if param == "w_alpha" else align_lowrank
    else:
        align = functools.partial(_alignment, layers, X=X, valid=valid, u=u, layer=layer, tail=tail, rule=rule,
                                  attention=attention, keep_bias=keep_bias, reduce=reduce, positions=positions,
                                  signed=signed)
        ray = lambda log_a: align(jnp.exp(log_a) * jnp.outer(u, w_cf))
        align_params = lambda prm, n0: align(delta_matrix(prm, u, n0, param))
    return w_cf, ray, align_params, reduced


def _align_loop(align_params, n0, *, target, param, lr, steps, lr_floor, optimizer=None):
    """(size, constraints, optimiser) of the Adam loop for the scale n0."""
    def constraints(p):
        a = align_params(p, n0)
        return target - a, a

    size = lambda p: delta_sq(p, param) / (n0 * n0 if param == "w_alpha" else 1.0)
    opt = default_optimizer(lr, steps, lr_floor) if optimizer is None else optimizer
    return size, constraints, opt


@dataclasses.dataclass(frozen=True)
class AlignSettings:
    """Everything static about one alignment-steering loop, as one hashable value (the one
    ``jit`` static argument of :func:`solve_one` and its phases).

    layer: the steered unique layer; tail: the steps its edit reaches (``prepare_problem``);
    rule, attention, keep_bias: the run (a resolved :class:`~powerlens._src.dynamics.options.
    Dynamics`'s fields, keep_bias a bool); target, reduce, signed: the constraint (final-token
    alignment >= target, ``mean``/``min`` over valid tokens, cos or |cos|); param, rank: the
    edit (``w_alpha`` or ``lowrank`` of rank r); w_kind: the closed-form w (``inverse`` or
    ``value``); steps, lr, lr_floor, optimizer: the optimiser (default Adam on a cosine decay
    from lr to lr_floor lr); mu, dual_every, tol: the augmented Lagrangian; bisect_iters: the
    closed-form start's bisection."""

    layer: int
    tail: Tuple[int, ...]
    rule: str
    attention: str
    keep_bias: bool
    target: float
    reduce: str
    param: str
    rank: int
    steps: int
    lr: float
    mu: float
    dual_every: int
    tol: float
    w_kind: str
    bisect_iters: int = 40
    lr_floor: float = 0.05
    signed: bool = True
    optimizer: Optional[optax.GradientTransformation] = None


def _problem_kw(settings: AlignSettings) -> dict:
    return {k: getattr(settings, k) for k in ("layer", "tail", "rule", "attention", "keep_bias", "reduce", "param",
                                              "w_kind", "signed")}


def _loop_kw(settings: AlignSettings) -> dict:
    return {k: getattr(settings, k) for k in ("target", "param", "lr", "steps", "lr_floor", "optimizer")}


def align_start(layers, X, valid, R, positions, pm, u, key, *, settings: AlignSettings):
    """Phase 1 of :func:`solve_one` for direction u: the closed-form start (bisection along the
    ray) and the loop's initial state. Returns (ctx, state): ctx the closed form's arrays and
    the scale n0, state :func:`~.lagrangian.adam_start`'s."""
    dtype = X.dtype
    w_cf, ray, align_params, reduced = _align_problem(layers, X, valid, u, R, positions, pm, **_problem_kw(settings))
    log_cf, cf_feasible = closed_form_start(ray, settings.target, dtype, settings.bisect_iters)
    alpha_cf = jnp.exp(log_cf)
    wn = jnp.linalg.norm(w_cf)
    n0 = alpha_cf * wn
    cf_align = ray(log_cf)
    w_hat = w_cf / wn
    u0, w0 = (reduced["u_red"], reduced["Bm"].T @ w_hat) if reduced is not None else (u, w_hat)
    params = initial_params(settings.param, n0, w0, u0, settings.rank, key, dtype)    # same effect on every token
    _, constraints, opt = _align_loop(align_params, n0, **_loop_kw(settings))
    ctx = {"closed_alpha": alpha_cf, "closed_w": w_cf, "closed_norm": n0, "closed_alignment": cf_align,
           "closed_feasible": cf_feasible}
    return ctx, adam_start(constraints, params, opt)


def align_advance(layers, X, valid, R, positions, pm, i0, stop, u, key, ctx, state, *, n: int,
                  settings: AlignSettings):
    """Phase 2: Adam steps i0 .. i0 + n - 1 from ``state``, those >= ``stop`` left undone
    (:func:`~.lagrangian.adam_steps`)."""
    _, _, align_params, _ = _align_problem(layers, X, valid, u, R, positions, pm, **_problem_kw(settings))
    size, constraints, opt = _align_loop(align_params, ctx["closed_norm"], **_loop_kw(settings))
    return adam_steps(size, constraints, state, i0, n, optimizer=opt, mu=settings.mu, dual_every=settings.dual_every,
                      tol=settings.tol, stop=stop)


def align_finish(layers, X, valid, R, positions, pm, u, key, ctx, state, hist_aux, hist_size, *,
                 settings: AlignSettings):
    """Phase 3: the best feasible iterate as factors of dO, with the closed form and the histories
    (a dict of arrays, see :class:`SteeringResult`)."""
    _, _, align_params, reduced = _align_problem(layers, X, valid, u, R, positions, pm, **_problem_kw(settings))
    n0 = ctx["closed_norm"]
    size, constraints, _ = _align_loop(align_params, n0, **_loop_kw(settings))
    sol = adam_finish(size, constraints, state, mu=settings.mu, tol=settings.tol)
    best_p = sol["params"]
    found = jnp.isfinite(sol["size"])
    if reduced is not None:   # lift: P = [Bp0, q_hat] P~ (without forming the per-direction basis)
        Pr = best_p["P"]
        best_p = {"P": reduced["Bp0"] @ Pr[:-1] + reduced["q_hat"][:, None] * Pr[-1:], "Q": reduced["Bm"] @ best_p["Q"]}
    # dO = factor_P factor_Q^T, returned as factors: the dense (d, H e) matrix of every
    # direction would dominate the run's memory traffic (SteeringResult.delta_O forms it)
    fP, fQ = edit_factors(best_p, u, n0, settings.param)
    return {
        "factor_P": jnp.where(found, fP, jnp.nan), "factor_Q": jnp.where(found, fQ, jnp.nan),
        "norm": jnp.where(found, factor_norm(fP, fQ), jnp.nan),
        "alignment": jnp.where(found, sol["aux"], jnp.nan),
        "feasible": found, **ctx,
        "multiplier": sol["multiplier"],
        "history_alignment": hist_aux, "history_norm": jnp.sqrt(hist_size) * n0,
    }


def solve_one(layers, X, valid, u, key, R, positions=None, pm=None, *, settings: AlignSettings):
    """Optimise one direction u (d,) (unit), all the steps in one program, with the static
    :class:`AlignSettings`. R: pinv(V^T) (H e, d) for w_kind 'inverse', else V (H e, d).

    ``pm`` (see :func:`last_layer_terms`): when the steered layer is the last step under
    rule ``paper``, its unsteered pre-norm output p (B, n, d) and head mix m (B, n, H e)
    (neither depends on W_o), with the bases Bp, Bm of the reduced problem; the final tokens
    are then N2(y), y = p + dO m, and N2 does not change the angle, so cos(y, u) needs only y.u and ||y||^2. For dO = n0 P Q^T, with a = n0 m Q:

        y.u = p.u + a (P^T u),   ||y||^2 = ||p||^2 + 2 a.(p P) + a (P^T P) a^T

    (dO = e^a u w^T is the same with a = e^a (w.m), P = u). No (n, d) array is formed
    per direction; with ``lowrank`` P and Q live in the reduced coordinates P = Bp P~,
    Q = Bm Q~, so a step costs O(n r (k_p + k_m)) with k <= B n + K.

    The three phases (:func:`align_start`, :func:`align_advance`, :func:`align_finish`) are
    what :func:`solve_in_chunks` runs from the host, the steps in chunks. Returns a dict of
    arrays (see :class:`SteeringResult`)."""
    shared = (layers, X, valid, R, positions, pm)
    ctx, state = align_start(*shared, u, key, settings=settings)
    state, (hist_aux, hist_size) = align_advance(*shared, 0, None, u, key, ctx, state, n=settings.steps,
                                                 settings=settings)
    return align_finish(*shared, u, key, ctx, state, hist_aux, hist_size, settings=settings)


solve_one_jit = jax.jit(solve_one, static_argnames=("settings",))


def solve_many(layers, X, valid, U, keys, R, positions=None, pm=None, *, settings: AlignSettings):
    """:func:`solve_one` vmapped over directions U (K, d) and keys (K, 2)."""
    return jax.vmap(lambda u, k: solve_one(layers, X, valid, u, k, R, positions, pm, settings=settings))(U, keys)


solve_many_jit = jax.jit(solve_many, static_argnames=("settings",))


def solve_many_sharded(layers, X, valid, U, keys, R, positions=None, pm=None, *, settings: AlignSettings):
    """:func:`solve_one` over directions U (K, d) and keys (K, 2), the directions split evenly
    over all devices (:func:`~powerlens._src.dynamics.execution.map_systems`: K padded to a multiple
    of the device count, the padding dropped), everything else given whole to each device."""
    return map_targets(solve_one, 3, (layers, X, valid, R, positions, pm), (U, keys), {"settings": settings})


# ------------------------------------------------------------------ public API

@dataclasses.dataclass
class SteeringResult:
    """Gradient steering of K directions (leading axis K on every array).

    delta_O (K, d, H e) = factor_P factor_Q^T (factors (K, d, r), (K, H e, r)),
    norm (K,) = ||delta_O||_F, alignment (K,) reached (reduce over valid final tokens),
    feasible (K,) bool; the closed form at the same target: closed_alpha, closed_w
    (K, H e), closed_norm, closed_alignment, with ``w`` the closed-form choice used
    ("inverse" or "value"); histories (K, steps)."""

    directions: np.ndarray
    factor_P: np.ndarray
    factor_Q: np.ndarray
    norm: np.ndarray
    alignment: np.ndarray
    feasible: np.ndarray
    closed_alpha: np.ndarray
    closed_w: np.ndarray
    closed_norm: np.ndarray
    closed_alignment: np.ndarray
    closed_feasible: np.ndarray
    multiplier: np.ndarray
    history_alignment: np.ndarray
    history_norm: np.ndarray
    target: float
    reduce: str
    param: str
    rank: int
    layer: int
    rule: str
    w: str

    @property
    def delta_O(self) -> np.ndarray:
        """The dense changes (K, d, H e) (formed on the host, in float64)."""
        return np.einsum("kdr,ker->kde", np.asarray(self.factor_P, np.float64),
                         np.asarray(self.factor_Q, np.float64))

    def delta_rank(self, i: int = 0) -> int:
        """Numerical rank of delta_O[i] = P Q^T (at most ``rank``; 0 when infeasible;
        :func:`~.rank1.factor_rank`)."""
        return factor_rank(np.asarray(self.factor_P[i]), np.asarray(self.factor_Q[i]))

    @property
    def norm_ratio(self) -> np.ndarray:
        """||delta_O|| (gradient) / ||delta_O|| (closed form) at equal alignment."""
        return self.norm / self.closed_norm

    def to_json(self, i: int = 0) -> dict:
        f = lambda a: float(np.asarray(a)[i])
        return {"param": self.param, "rank": self.rank, "delta_rank": self.delta_rank(i), "target": self.target,
                "reduce": self.reduce, "rule": self.rule, "layer": self.layer, "w": self.w, "norm": f(self.norm),
                "alignment": f(self.alignment), "feasible": bool(self.feasible[i]),
                "closed_alpha": f(self.closed_alpha), "closed_norm": f(self.closed_norm),
                "closed_alignment": f(self.closed_alignment), "norm_ratio": f(self.norm_ratio)}


def _row_basis(rows: np.ndarray, extra: Optional[np.ndarray] = None, tol: float = 1e-10) -> np.ndarray:
    """Orthonormal basis (dim, k) of span(extra, rows) (host SVD)."""
    M = rows if extra is None else np.concatenate([extra[None], rows])
    _, sv, Vt = np.linalg.svd(np.asarray(M, np.float64), full_matrices=False)
    k = max(int(np.sum(sv > tol * sv[0])), 1)
    return Vt[:k].T


def last_layer_terms(layers: Layers, X, valid, layer: int, keep_bias: bool, attention: str,
                     positions=None) -> dict:
    """p, m of the steered (last, paper-rule) layer and the bases of the reduced problem.

    Only dO m_i (valid tokens i) reaches the output, and only its components in span(u, p_i)
    can raise |cos(y_i, u)|, so a minimum-norm dO = P Q^T has Q in span(m_i) and P in
    span(p_i, u): the optimiser works in those coordinates (at most B n + 1 columns; the
    direction's own column is added per direction) and lifts the result back.
    """
    from .alpha import terms_batch
    p, m = terms_batch(layers.layer(layer), X, valid, keep_bias, attention, positions)
    v = np.asarray(valid, bool)
    dtype = layers.dtype
    Bm = _row_basis(np.asarray(m, np.float64)[v])
    Bp = _row_basis(np.asarray(p, np.float64)[v])
    return {"p": p, "m": m, "Bp": jnp.asarray(Bp, dtype), "Bm": jnp.asarray(Bm, dtype)}


def prepare_problem(layers: Layers, x0, valid=None, *, layer: int = -1, rule: str = "paper",
                    attention: str = "softmax", keep_bias: Optional[bool] = None, positions=None):
    """Tokens entering the first steered step (B, n, d), valid (B, n), and the schedule tail."""
    check_rule(rule)
    l = layer_index(layers, layer)
    kb = default_keep_bias(rule) if keep_bias is None else bool(keep_bias)
    X, vb = entering_states(layers, x0, valid, layer=l, rule=rule, attention=attention, keep_bias=kb,
                            positions=positions)
    t0 = steered_steps(layers, l)[0]
    return X, vb, layers.schedule[t0:], l, kb


@dataclasses.dataclass(frozen=True, eq=False)
class AlignmentObjective:
    """The paper's claim as a constraint: reduce over valid final tokens of cos(y_i, u) (or the
    sign-free |cos(y_i, u)| when ``signed`` is False) >= ``target``, under the run's rule.

    direction: u "float[d]" or K directions "float[K d]" (each normalised; zero or non-finite:
    an error when the problem is built); target in (0, 1); reduce ``mean`` or ``min``."""

    direction: object
    target: float = 0.99
    reduce: str = "mean"
    signed: bool = True

    def __post_init__(self):
        try:
            D = np.asarray(self.direction, np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"AlignmentObjective.direction must be a vector (d,) or (K, d) of numbers, "
                             f"got {self.direction!r}") from None
        if D.ndim not in (1, 2) or D.size == 0:
            raise ValueError(f"AlignmentObjective.direction must have shape (d,) or (K, d), got {D.shape}")
        object.__setattr__(self, "direction", D)
        object.__setattr__(self, "target", check_target(self.target, "AlignmentObjective.target"))
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"AlignmentObjective.reduce must be one of {REDUCTIONS}, got {self.reduce!r}")
        if not isinstance(self.signed, (bool, np.bool_)):
            raise ValueError(f"AlignmentObjective.signed must be True or False, got {self.signed!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenObjective:
    """The model's own next token (:mod:`powerlens._src.steering.token`): p(t | prompt) >=
    ``target_prob`` at every prompt's last valid token and mean KL(p_base || p_edited) <=
    ``max_kl`` over ``controls`` (texts or token-id lists; None: the neutral defaults), under
    rule ``full``. token_ids: one id or K ids; target_prob: one level in (0, 1) or one per id."""

    token_ids: object
    target_prob: object = 0.5
    max_kl: float = 0.5
    controls: Optional[Sequence] = None

    def __post_init__(self):
        ids = np.atleast_1d(np.asarray(self.token_ids))
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0:
            raise ValueError(f"TokenObjective.token_ids must be a token id or a list of token ids (>= 0), "
                             f"got {self.token_ids!r}")
        levels = np.asarray(self.target_prob, np.float64) if np.ndim(self.target_prob) or \
            isinstance(self.target_prob, (int, float, np.number)) else None
        if levels is None or levels.ndim > 1 or not np.all(np.isfinite(levels)) or np.any(levels <= 0) \
                or np.any(levels >= 1) or (levels.ndim == 1 and levels.size not in (1, ids.size)):
            raise ValueError(f"TokenObjective.target_prob must be a number strictly between 0 and 1, or one per "
                             f"token id ({ids.size}), got {self.target_prob!r}")
        kl = self.max_kl
        if isinstance(kl, bool) or not isinstance(kl, (int, float, np.number)) or not np.isfinite(kl) or kl <= 0:
            raise ValueError(f"TokenObjective.max_kl must be a finite number > 0, got {kl!r}")
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "max_kl", float(kl))


@dataclasses.dataclass(frozen=True)
class SteeringConfig:
    """How the optimiser runs (the same for every objective unless said). None means the
    objective's default: steps 300; lr 1e-2 (alignment) or 3e-3 (token); mu 100 or 10; tol 1e-4
    on the alignment or 0 (token). rank: r of a ``lowrank`` edit; w: the closed-form start's w
    (``auto``, ``inverse``, ``value``); layer: the edited unique layer; seed: the initial noise;
    dynamics: the run whose final state the alignment objective constrains, a
    :class:`~powerlens._src.dynamics.options.Dynamics` (default ``Dynamics()``, the paper rule;
    ``faithful`` resolved against the model's norm placement; ``attention_block`` must be left
    None: the objective computes attention densely). The token objective runs the model's own
    forward pass and takes only the default. vectorize: one vmapped program over the targets,
    or a loop (benchmarks)."""

    steps: Optional[int] = None
    lr: Optional[float] = None
    mu: Optional[float] = None
    dual_every: int = 10
    tol: Optional[float] = None
    rank: int = 1
    w: str = "auto"
    layer: int = -1
    seed: int = 0
    dynamics: Dynamics = Dynamics()
    vectorize: bool = True

    def __post_init__(self):
        if not isinstance(self.dynamics, Dynamics):
            raise ValueError(f"SteeringConfig.dynamics must be a powerlens.Dynamics, e.g. Dynamics(rule='paper'), "
                             f"got {self.dynamics!r}")
        if self.dynamics.attention_block is not None:
            raise ValueError(f"SteeringConfig.dynamics.attention_block must be None (steering computes attention "
                             f"densely), got {self.dynamics.attention_block!r}")


def optimize_steering(model_or_layers, x0, objective=None, /, *, edit: str = "lowrank", optimizer=None,
                      config: Optional[SteeringConfig] = None, valid=None, positions=None, progress: bool = False,
                      **legacy):
    """Minimise the size of an edit of one layer subject to a steering ``objective``, for K targets.

    ``objective``: an :class:`AlignmentObjective` (min ||dO||_F subject to the final-token
    alignment, the paper's claim; K directions) or a :class:`TokenObjective` (min ||edit|| subject
    to p(token) and a control-KL bound; K token ids; needs a loaded decoder). ``edit``: the
    parametrisation (:mod:`~.edits`): ``lowrank`` (dO of rank ``config.rank``), ``w_alpha`` (the
    closed-form ray), ``activation`` (activation addition; token objective only). ``optimizer``:
    any ``optax.GradientTransformation`` (default :func:`~.lagrangian.default_optimizer`: Adam
    on a cosine decay from lr to 0.05 lr over the steps). ``config``: :class:`SteeringConfig`.
    ``progress``: report to the active :class:`~.progress.SteerProgress` (same numbers).
    Returns a :class:`SteeringResult` or a :class:`~.token.TokenSteeringResult`.

    The older keyword form ``optimize_steering(model, x0, targets, objective="token", target=...,
    param=..., steps=..., ...)`` still works and warns (DeprecationWarning)."""
    if not isinstance(objective, (AlignmentObjective, TokenObjective)):
        import warnings
        warnings.warn("optimize_steering(model, x0, targets, objective=..., target=..., param=..., steps=...) is "
                      "deprecated: pass an AlignmentObjective or TokenObjective, edit=, optimizer= and "
                      "config=SteeringConfig(...)", DeprecationWarning, stacklevel=2)
        if objective is None and "targets" not in legacy:
            raise TypeError("optimize_steering() needs an objective (AlignmentObjective or TokenObjective)")
        targets = legacy.pop("targets") if objective is None else objective
        if edit != "lowrank":
            legacy.setdefault("param", edit)
        if config is not None:
            raise TypeError("optimize_steering(): config= goes with an objective value, not with targets")
        return _optimize_keywords(model_or_layers, x0, targets, valid=valid, positions=positions, progress=progress,
                                  optimizer=optimizer, **legacy)
    if legacy:
        raise TypeError(f"optimize_steering() got unexpected keyword(s) {sorted(legacy)}: with an objective value "
                        f"they go in SteeringConfig or the objective")
    cfg = SteeringConfig() if config is None else config
    if not isinstance(cfg, SteeringConfig):
        raise TypeError(f"config must be a SteeringConfig, got {type(cfg).__name__}")
    if not isinstance(edit, str) or edit not in EDITS:
        raise ValueError(f"unknown edit {edit!r}; expected one of {EDITS}")
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
    common = dict(valid=valid, param=edit, rank=cfg.rank, steps=cfg.steps, lr=cfg.lr, mu=cfg.mu,
                  dual_every=cfg.dual_every, tol=cfg.tol, w=cfg.w, layer=cfg.layer, seed=cfg.seed,
                  progress=progress, optimizer=optimizer)
    if isinstance(objective, TokenObjective):
        if cfg.dynamics != Dynamics():
            raise ValueError(f"SteeringConfig.dynamics: the token objective runs the model's own forward pass "
                             f"(rule 'full') and takes the default Dynamics(), got {cfg.dynamics!r}")
        return _optimize_keywords(model_or_layers, x0, objective.token_ids, objective="token",
                                  target_prob=objective.target_prob, max_kl=objective.max_kl,
                                  controls=objective.controls, **common)
    dyn = cfg.dynamics.resolved(getattr(model_or_layers, "layers", model_or_layers).config)
    return _optimize_keywords(model_or_layers, x0, objective.direction, target=objective.target,
                              reduce=objective.reduce, signed=objective.signed, rule=dyn.rule,
                              attention=dyn.attention, keep_bias=dyn.keep_bias, positions=positions,
                              vectorize=cfg.vectorize, **common)


def _optimize_keywords(model_or_layers, x0, targets, *, objective: str = "alignment", valid=None,
                      target: float = 0.99, reduce: str = "mean", param: str = "lowrank", rank: int = 1,
                      steps: Optional[int] = None, lr: Optional[float] = None, mu: Optional[float] = None,
                      dual_every: int = 10, tol: Optional[float] = None, w: str = "auto", layer: int = -1,
                      rule: str = "paper",
                      attention: str = "softmax", keep_bias: Optional[bool] = None, positions=None, seed: int = 0,
                      vectorize: bool = True, signed: bool = True, target_prob=0.5, max_kl: float = 0.5,
                      controls=None, progress: bool = False, optimizer=None):
    """:func:`optimize_steering` in its keyword form (one keyword per setting).

    ``objective="alignment"`` (the paper's claim): min ||delta_O||_F subject to the final-token
    alignment >= ``target`` under ``rule`` (module docstring); ``targets`` are directions.
    ``objective="token"`` (the model's own output): ``targets`` are token ids, one per target;
    min ||edit|| subject to p(target | prompt) >= ``target_prob`` at every prompt's last valid
    token and mean KL(p_base || p_steered) <= ``max_kl`` over ``controls``, under rule ``full``
    (:mod:`powerlens._src.steering.token`; needs a loaded decoder; ``param`` may also be
    ``"activation"``). Returns a :class:`SteeringResult` or a
    :class:`~.token.TokenSteeringResult`.

    Args:
      model_or_layers: a :class:`~powerlens._src.models.base.Model` or its Layers (alignment only).
      x0: initial tokens (n, d) or (B, n, d) with ``valid`` (B, n).
      targets: alignment: directions (d,) or (K, d), each normalised (zero / non-finite /
        wrong size: error); token: a token id or K ids.
      target: alignment in (0, 1); reduce: ``mean`` or ``min`` over valid final tokens.
      param: ``w_alpha`` or ``lowrank`` (with ``rank`` r >= 1); token also ``activation``.
        Under the alignment objective ``w_alpha`` learns w and alpha; under the token
        objective it is the closed-form ray u w_cf^T with only alpha learned.
      steps, lr, mu: Adam steps and step size, augmented-Lagrangian penalty (defaults:
        300, 1e-2, 100 for alignment; 300, 3e-3, 10 for token); dual_every: multiplier
        updates; tol: feasibility slack (default 1e-4 on the alignment; 0 for the token
        objective, so a returned edit reaches ``target_prob`` and ``max_kl`` exactly).
      w: closed-form initial w, ``auto`` (``inverse`` where V_cat has full column rank, else
        ``value``), ``inverse`` or ``value``; the choice used is the result's ``w``.
      vectorize: one vmapped run over the K directions (default), or a Python loop over
        the same jitted single-direction function (for the benchmark).
      signed: alignment is cos(y, u) (True) or the sign-free |cos(y, u)| (the paper's gamma).
      target_prob, max_kl, controls: the token objective's levels (one level or one per
        target) and control prompts (texts or token-id lists; default
        :data:`~.token.CONTROL_PROMPTS`).
      progress: report the steps to the active :class:`~.progress.SteerProgress` (the loop
        runs in even chunks of at most :data:`CHUNK` steps whether or not it reports, so the
        numbers are the same; ``vectorize=False`` reports nothing).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")
    if objective == "token":
        from .token import optimize_token
        return optimize_token(model_or_layers, x0, targets, valid=valid, layer=layer, rank=rank, param=param,
                              target_prob=target_prob, max_kl=max_kl, controls=controls,
                              steps=300 if steps is None else steps, lr=3e-3 if lr is None else lr,
                              mu=10.0 if mu is None else mu, dual_every=dual_every, tol=0.0 if tol is None else tol,
                              w=w, seed=seed, progress=progress, optimizer=optimizer)
    layers = getattr(model_or_layers, "layers", model_or_layers)
    directions = targets
    tol = 1e-4 if tol is None else tol
    steps = 300 if steps is None else steps
    lr = 1e-2 if lr is None else lr
    mu = 100.0 if mu is None else mu
    target = check_target(target)
    if reduce not in REDUCTIONS:
        raise ValueError(f"unknown reduce {reduce!r}; expected one of {REDUCTIONS}")
    if param not in PARAMS:
        raise ValueError(f"unknown param {param!r}; expected one of {PARAMS}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    for name, v in (("lr", lr), ("mu", mu)):
        if not np.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    if not isinstance(w, str) or w not in W_CHOICES:
        raise ValueError(f"unknown w {w!r}; expected one of {W_CHOICES}")
    d = layers.config.d_model
    D = np.asarray(directions, np.float64)
    D = D[None] if D.ndim == 1 else D
    if D.ndim != 2:
        raise ValueError(f"directions must have shape (d,) or (K, d), got {D.shape}")
    D = np.stack([as_direction(v, d, name=f"direction {i}") for i, v in enumerate(D)])
    X, vb, tail, l, kb = prepare_problem(layers, x0, valid, layer=layer, rule=rule, attention=attention,
                                         keep_bias=keep_bias, positions=positions)
    _, V, _ = host_matrices(layers, l)
    w = resolve_w(V, w, l).kind if w == "auto" else w
    R = inverse_map(V, l) if w == "inverse" else V
    dtype = layers.dtype
    R = jnp.asarray(R, dtype)
    U = jnp.asarray(D, dtype)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(D))
    settings = AlignSettings(layer=l, tail=tail, rule=rule, attention=attention, keep_bias=kb, target=target,
                             reduce=reduce, param=param, rank=int(rank), steps=int(steps), lr=float(lr),
                             mu=float(mu), dual_every=int(dual_every), tol=float(tol), w_kind=w,
                             signed=bool(signed), optimizer=optimizer)
    pm = None
    if rule == "paper" and tail == (l,):
        pm = last_layer_terms(layers, X, vb, l, kb, attention, positions)
    if vectorize:
        report = None
        sink = active_progress() if progress else None
        if sink is not None:
            def report(i, ctx, state, aux):
                for v in np.asarray(aux[:, -1], np.float64):
                    sink.step(i - 1, float(v), float("nan"), float(target))
        out = solve_in_chunks((align_start, align_advance, align_finish), (layers, X, vb, R, positions, pm),
                              (U, keys), {"settings": settings}, steps=int(steps), report=report)
    else:
        outs = [solve_one_jit(layers, X, vb, U[i], keys[i], R, positions, pm, settings=settings)
                for i in range(len(D))]
        out = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
    out = jax.tree_util.tree_map(np.asarray, out)
    return SteeringResult(directions=D, target=target, reduce=reduce, param=param, rank=int(rank), layer=l,
                          rule=rule, w=w, **out)
