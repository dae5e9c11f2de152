"""Gradient-based steering with optax, vmapped over target directions (design.md §4).

Problem, for a direction u (d,), prompts X0 (B, n, d) and the steered unique layer l::

    minimise   ||delta_O||_F^2
    subject to a(delta_O) >= target,   a = mean (or min) over valid tokens of cos(y_i, u)

where y_i are the *final* tokens of the schedule run under ``rule`` (default ``paper``)
with W_o[l] + delta_O. Gradients flow through the dynamics (the scan of
:func:`powerlens.dynamics.run`), never through eigenvector derivatives. Steps before the first one that
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

Initialisation is the closed form at the target: w_cf ("inverse" = pinv(V^T) u or "value"),
alpha_cf found by bisection on log alpha so that a(alpha_cf u w_cf^T) = target (a is
assumed increasing in alpha along that ray); n0 = ||alpha_cf u w_cf^T||_F, the closed
form's norm at equal alignment, which the result is compared with. The best feasible
iterate (a >= target - tol, smallest norm) is returned; the closed form itself is
feasible, so the result is never worse than it (up to ``tol``).

Everything for one direction is a pure function (``solve_one``); ``optimize_steering``
jit-compiles it over the prompts and vmaps it over K directions at once.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..dynamics.layer import check_rule, default_keep_bias
from ..dynamics.observers import final
from ..dynamics.params import Layers
from ..dynamics.run import run
from .alpha import check_target, entering_states, steered_steps
from .directions import as_direction
from .rank1 import host_matrices, inverse_map, layer_index

PARAMS = ("w_alpha", "lowrank")
REDUCTIONS = ("mean", "min")


# ------------------------------------------------------------------ pure pieces

def run_tail(layers: Layers, X: "float[B n d]", valid: "bool[B n]", tail, *, rule, attention, keep_bias,
             positions=None) -> "float[B n d]":
    """Final tokens after the steps ``tail`` (a static Schedule or tuple of unique-layer indices): the
    ``final()`` observer of :func:`powerlens.dynamics.run`, vmapped over prompts (traceable:
    the optimiser differentiates through it). Only the layers of the tail are kept; their
    weights are read in place (no transposed copies inside the differentiated program)."""
    sub = layers.select(tail)
    one = lambda x, v: run(sub, x, v, rule=rule, attention=attention, keep_bias=keep_bias, positions=positions,
                           observers={"final": final()})["final"]
    return jax.vmap(one)(X, valid)


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


def _delta(params, u, n0, param):
    if param == "w_alpha":
        return jnp.exp(params["a"]) * jnp.outer(u, params["w"])
    return n0 * params["P"] @ params["Q"].T


def _delta_sq(params, param):
    """||dO||_F^2 / n0^2 (lowrank) or ||dO||_F^2 / n0^2 with n0 folded in (w_alpha: e^2a ||w||^2)."""
    if param == "w_alpha":
        return jnp.exp(2 * params["a"]) * jnp.sum(params["w"] ** 2)
    P, Q = params["P"], params["Q"]          # trace(P^T P Q^T Q), elementwise (see align_lowrank)
    return jnp.sum(jnp.sum(P[:, :, None] * P[:, None, :], axis=0) * jnp.sum(Q[:, :, None] * Q[:, None, :], axis=0))


def solve_one(layers, X, valid, u, key, R, positions=None, pm=None, *, layer: int, tail: Sequence[int],
              rule: str, attention: str,
              keep_bias: bool, target: float, reduce: str, param: str, rank: int, steps: int, lr: float,
              mu: float, dual_every: int, tol: float, w_kind: str, bisect_iters: int = 40,
              lr_floor: float = 0.05, signed: bool = True):
    """Optimise one direction u (d,) (unit). R: pinv(V^T) (H e, d) for w_kind 'inverse', else V (H e, d).

    ``pm`` (see :func:`last_layer_terms`): when the steered layer is the last step under
    rule ``paper``, its unsteered pre-norm output p (B, n, d) and head mix m (B, n, H e)
    (neither depends on W_o), with the bases Bp, Bm of the reduced problem; the final tokens are then N2(y), y = p + dO m, and N2 does not change the
    angle, so cos(y, u) needs only y.u and ||y||^2. For dO = n0 P Q^T, with a = n0 m Q:

        y.u = p.u + a (P^T u),   ||y||^2 = ||p||^2 + 2 a.(p P) + a (P^T P) a^T

    (dO = e^a u w^T is the same with a = e^a (w.m), P = u). No (n, d) array is formed
    per direction; with ``lowrank`` P and Q live in the reduced coordinates P = Bp P~,
    Q = Bm Q~, so a step costs O(n r (k_p + k_m)) with k <= B n + K.

    Returns a dict of arrays (see :class:`SteeringResult`)."""
    dtype = X.dtype
    w_cf = R @ u
    if w_kind == "value":
        w_cf = w_cf / jnp.linalg.norm(w_cf)
    reduced = pm is not None and param == "lowrank"
    if pm is not None:
        p_out, m_mix = pm["p"], pm["m"]
        pu = p_out @ u                                   # (B, n)
        pp = jnp.sum(p_out * p_out, axis=-1)             # (B, n)
        if reduced:   # coordinates in span(rows of p, u) (left) and span(rows of m) (right)
            Bp0, Bm = pm["Bp"], pm["Bm"]
            c_u = Bp0.T @ u                              # u = Bp0 c_u + q, q orthogonal to every p_i
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

        ray = lambda log_a: along_u(jnp.exp(log_a), w_cf)
        if param == "w_alpha":
            align_params = lambda prm, n0: along_u(jnp.exp(prm["a"]), prm["w"])
        else:
            align_params = align_lowrank
    else:
        align = functools.partial(_alignment, layers, X=X, valid=valid, u=u, layer=layer, tail=tail, rule=rule,
                                  attention=attention, keep_bias=keep_bias, reduce=reduce, positions=positions,
                                  signed=signed)
        ray = lambda log_a: align(jnp.exp(log_a) * jnp.outer(u, w_cf))
        align_params = lambda prm, n0: align(_delta(prm, u, n0, param))
    # closed form at the target alignment: bisection on log alpha along alpha u w_cf^T
    lo0, hi0 = jnp.asarray(-14.0, dtype), jnp.asarray(14.0, dtype)
    cf_feasible = ray(hi0) >= target

    def bis(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        ok = ray(mid) >= target
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    _, log_cf = jax.lax.fori_loop(0, bisect_iters, bis, (lo0, hi0))
    alpha_cf = jnp.exp(log_cf)
    wn = jnp.linalg.norm(w_cf)
    n0 = alpha_cf * wn
    cf_align = ray(log_cf)
    w_hat = w_cf / wn
    if param == "w_alpha":
        params = {"a": jnp.log(n0), "w": w_hat}
    else:
        u0, w0 = (u_red, Bm.T @ w_hat) if reduced else (u, w_hat)   # same effect on every token
        d, He = u0.shape[0], w0.shape[0]
        k1, k2 = jax.random.split(key)
        P = 1e-2 * jax.random.normal(k1, (d, rank), dtype) / np.sqrt(d)
        Q = 1e-2 * jax.random.normal(k2, (He, rank), dtype) / np.sqrt(He)
        params = {"P": P.at[:, 0].set(u0), "Q": Q.at[:, 0].set(w0)}

    def objective(p, lam):
        N = _delta_sq(p, param) / (n0 * n0 if param == "w_alpha" else 1.0)
        a = align_params(p, n0)
        g = target - a
        L = N + (jnp.square(jnp.maximum(0.0, lam + mu * g)) - lam * lam) / (2.0 * mu)
        return L, (a, N)

    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=lr_floor))
    grad = jax.value_and_grad(objective, has_aux=True)

    def step(carry, i):
        p, state, lam, best_p, best_N, best_a = carry
        (_, (a, N)), gr = grad(p, lam)
        feas = a >= target - tol
        better = feas & (N < best_N)
        best_p = jax.tree_util.tree_map(lambda b, q: jnp.where(better, q, b), best_p, p)
        best_N = jnp.where(better, N, best_N)
        best_a = jnp.where(better, a, best_a)
        upd, state = opt.update(gr, state, p)
        p = optax.apply_updates(p, upd)
        lam = jnp.where((i + 1) % dual_every == 0, jnp.maximum(0.0, lam + mu * (target - a)), lam)
        return (p, state, lam, best_p, best_N, best_a), (a, N)

    inf = jnp.asarray(jnp.inf, dtype)
    carry0 = (params, opt.init(params), jnp.asarray(0.0, dtype), params, inf, -inf)
    (p, _, lam, best_p, best_N, best_a), (hist_a, hist_N) = jax.lax.scan(step, carry0, jnp.arange(steps))
    # the last iterate is checked too
    _, (a_last, N_last) = objective(p, lam)
    better = (a_last >= target - tol) & (N_last < best_N)
    best_p = jax.tree_util.tree_map(lambda b, q: jnp.where(better, q, b), best_p, p)
    best_N = jnp.where(better, N_last, best_N)
    best_a = jnp.where(better, a_last, best_a)
    found = jnp.isfinite(best_N)
    if reduced:   # lift: P = [Bp0, q_hat] P~ (without forming the per-direction basis)
        Pr = best_p["P"]
        best_p = {"P": Bp0 @ Pr[:-1] + q_hat[:, None] * Pr[-1:], "Q": Bm @ best_p["Q"]}
    # dO = factor_P factor_Q^T, returned as factors: the dense (d, H e) matrix of every
    # direction would dominate the run's memory traffic (SteeringResult.delta_O forms it)
    if param == "w_alpha":
        fP, fQ = (jnp.exp(best_p["a"]) * u)[:, None], best_p["w"][:, None]
    else:
        fP, fQ = n0 * best_p["P"], best_p["Q"]
    norm = jnp.sqrt(jnp.sum((fP.T @ fP) * (fQ.T @ fQ)))
    return {
        "factor_P": jnp.where(found, fP, jnp.nan), "factor_Q": jnp.where(found, fQ, jnp.nan),
        "norm": jnp.where(found, norm, jnp.nan),
        "alignment": jnp.where(found, best_a, jnp.nan),
        "feasible": found,
        "closed_alpha": alpha_cf, "closed_w": w_cf, "closed_norm": n0, "closed_alignment": cf_align,
        "closed_feasible": cf_feasible,
        "multiplier": lam,
        "history_alignment": hist_a, "history_norm": jnp.sqrt(hist_N) * n0,
    }


_STATIC = ("layer", "tail", "rule", "attention", "keep_bias", "target", "reduce", "param", "rank", "steps",
           "lr", "mu", "dual_every", "tol", "w_kind", "bisect_iters", "signed")
solve_one_jit = jax.jit(solve_one, static_argnames=_STATIC)


def solve_many(layers, X, valid, U, keys, R, positions=None, pm=None, **static):
    """:func:`solve_one` vmapped over directions U (K, d) and keys (K, 2)."""
    return jax.vmap(lambda u, k: solve_one(layers, X, valid, u, k, R, positions, pm, **static))(U, keys)


solve_many_jit = jax.jit(solve_many, static_argnames=_STATIC)


def solve_many_sharded(layers, X, valid, U, keys, R, positions=None, pm=None, **static):
    """:func:`solve_many` with the directions split evenly over all devices (``shard_map``);
    falls back to :func:`solve_many_jit` on one device or when K does not divide."""
    ndev = jax.device_count()
    if ndev == 1 or U.shape[0] % ndev:
        return solve_many_jit(layers, X, valid, U, keys, R, positions, pm, **static)
    run, mesh = _sharded_solver(ndev, tuple(sorted(static.items())))
    from jax.sharding import NamedSharding, PartitionSpec as P
    U, keys = jax.device_put((U, keys), NamedSharding(mesh, P("directions")))
    return run(layers, X, valid, U, keys, R, positions, pm)


@functools.lru_cache(maxsize=16)
def _sharded_solver(ndev: int, static_items):
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:ndev]), ("directions",))
    static = dict(static_items)

    def local(layers, X, valid, U, keys, R, positions, pm):
        return solve_many(layers, X, valid, U, keys, R, positions, pm, **static)

    rep = P()
    f = jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, P("directions"), P("directions"), rep, rep, rep),
                      out_specs=P("directions"), check_vma=False)
    return jax.jit(f), mesh


# ------------------------------------------------------------------ public API

@dataclasses.dataclass
class SteeringResult:
    """Gradient steering of K directions (leading axis K on every array).

    delta_O (K, d, H e) = factor_P factor_Q^T (factors (K, d, r), (K, H e, r)),
    norm (K,) = ||delta_O||_F, alignment (K,) reached (reduce over valid final tokens),
    feasible (K,) bool; the closed form at the same target: closed_alpha, closed_w
    (K, H e), closed_norm, closed_alignment; histories (K, steps)."""

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

    @property
    def delta_O(self) -> np.ndarray:
        """The dense changes (K, d, H e) (formed on the host, in float64)."""
        return np.einsum("kdr,ker->kde", np.asarray(self.factor_P, np.float64),
                         np.asarray(self.factor_Q, np.float64))

    @property
    def norm_ratio(self) -> np.ndarray:
        """||delta_O|| (gradient) / ||delta_O|| (closed form) at equal alignment."""
        return self.norm / self.closed_norm

    def to_json(self, i: int = 0) -> dict:
        f = lambda a: float(np.asarray(a)[i])
        return {"param": self.param, "rank": self.rank, "target": self.target, "reduce": self.reduce,
                "rule": self.rule, "layer": self.layer, "norm": f(self.norm), "alignment": f(self.alignment),
                "feasible": bool(self.feasible[i]), "closed_alpha": f(self.closed_alpha),
                "closed_norm": f(self.closed_norm), "closed_alignment": f(self.closed_alignment),
                "norm_ratio": f(self.norm_ratio)}


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
    from .alpha import _terms_batch
    p, m = _terms_batch(layers.layer(layer), X, valid, keep_bias, attention, positions)
    v = np.asarray(valid, bool)
    dtype = layers.W_v.dtype
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


def optimize_steering(layers: Layers, x0, directions, *, valid=None, target: float = 0.99,
                      reduce: str = "mean", param: str = "lowrank", rank: int = 1, steps: int = 300,
                      lr: float = 1e-2, mu: float = 100.0, dual_every: int = 10, tol: float = 1e-4,
                      w: str = "inverse", layer: int = -1, rule: str = "paper", attention: str = "softmax",
                      keep_bias: Optional[bool] = None, positions=None, seed: int = 0,
                      vectorize: bool = True, signed: bool = True) -> SteeringResult:
    """Minimise ||delta_O||_F subject to the final-token alignment >= target, for K directions.

    Args:
      layers: the system; x0: initial tokens (n, d) or (B, n, d) with ``valid`` (B, n).
      directions: (d,) or (K, d); each is normalised (zero / non-finite / wrong size: error).
      target: alignment in (0, 1); reduce: ``mean`` or ``min`` over valid final tokens.
      param: ``w_alpha`` or ``lowrank`` (with ``rank`` r >= 1); steps, lr: Adam;
      mu, dual_every: augmented Lagrangian; tol: feasibility slack.
      w: closed-form initial w, ``inverse`` or ``value``.
      vectorize: one vmapped run over the K directions (default), or a Python loop over
        the same jitted single-direction function (for the benchmark).
      signed: alignment is cos(y, u) (True) or the sign-free |cos(y, u)| (the paper's gamma).
    """
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
    if w not in ("inverse", "value"):
        raise ValueError(f"unknown w {w!r}; expected 'inverse' or 'value'")
    d = layers.config.d_model
    D = np.asarray(directions, np.float64)
    D = D[None] if D.ndim == 1 else D
    if D.ndim != 2:
        raise ValueError(f"directions must have shape (d,) or (K, d), got {D.shape}")
    D = np.stack([as_direction(v, d, name=f"direction {i}") for i, v in enumerate(D)])
    X, vb, tail, l, kb = prepare_problem(layers, x0, valid, layer=layer, rule=rule, attention=attention,
                                         keep_bias=keep_bias, positions=positions)
    _, V, _ = host_matrices(layers, l)
    R = inverse_map(V, l) if w == "inverse" else V
    dtype = layers.W_v.dtype
    R = jnp.asarray(R, dtype)
    U = jnp.asarray(D, dtype)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(D))
    kw = dict(layer=l, tail=tail, rule=rule, attention=attention, keep_bias=kb, target=target, reduce=reduce,
              param=param, rank=int(rank), steps=int(steps), lr=float(lr), mu=float(mu),
              dual_every=int(dual_every), tol=float(tol), w_kind=w, signed=bool(signed))
    pm = None
    if rule == "paper" and tail == (l,):
        pm = last_layer_terms(layers, X, vb, l, kb, attention, positions)
    if vectorize:
        out = solve_many_sharded(layers, X, vb, U, keys, R, positions, pm, **kw)
    else:
        outs = [solve_one_jit(layers, X, vb, U[i], keys[i], R, positions, pm, **kw) for i in range(len(D))]
        out = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
    out = jax.tree_util.tree_map(np.asarray, out)
    return SteeringResult(directions=D, target=target, reduce=reduce, param=param, rank=int(rank), layer=l,
                          rule=rule, **out)
