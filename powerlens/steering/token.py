"""Steering the model's own next token (``objective="token"``, design.md §4).

For a target token t (one per target k), prompts b = 1..B and control prompts c = 1..C::

    minimise   ||E||^2 / n0^2
    subject to g_b  = log(target_prob) - log p_E(t | prompt b) <= 0     (b = 1..B)
               g_kl = mean_c KL(p_0(. | c) || p_E(. | c)) - max_kl <= 0

p_E is the model's own next-token distribution at a prompt's last valid token under rule
``full`` with the edit E: the final state of :func:`powerlens.dynamics.run` (the residual
stream), the model's final norm once, its LM head and soft-capping
(:func:`powerlens.models.forward.logits`). The edit E of unique layer l (param)::

    "lowrank"     W_o[l] += dO = n0 P Q^T            (P (d, r), Q (H e, r)),  ||E|| = ||dO||_F
    "w_alpha"     W_o[l] += dO = e^a u w^T           (a scalar, w (H e,)),    the closed-form ray's family
    "activation"  h += v = n0 s at every token of the output of the last step applying l,
                  ||E|| = ||v||  (activation addition)

u is the target's unit read-out row (the ``token:`` direction). The constraints go through
the augmented Lagrangian of :func:`~.lagrangian.constrained_adam`, one multiplier per
constraint (B + 1). The steps before the edited one do not depend on E and run once,
outside the optimisation; gradients flow through the one ``run`` of the remaining steps
and the head.

Start: the closed-form ray, dO = alpha u w_cf^T (w_cf of :func:`~.rank1.resolve_w`) or
v = alpha u for activation addition. The target probability need not increase along it, so
alpha is found by a scan of log alpha over [-10, 10] (41 points) and bisection inside the
first bracket where min_b p(t | b) crosses ``target_prob`` (the largest min_b p on the grid
when it never does; ``closed_feasible`` says which). n0 is that start's norm (when the ray
never gets there, at least a tenth of the layer's own scale, so the start is not a vanishing edit).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.layer import check_rule
from ..dynamics.run import run_batch
from ..models.forward import logits as model_logits
from .lagrangian import bisect_increasing, constrained_adam
from .optimize import _delta_sq, edit_factors, factor_norm, initial_params, run_tail
from .rank1 import factor_rank, host_matrices, inverse_map, layer_index, resolve_w

TOKEN_PARAMS = ("lowrank", "w_alpha", "activation")

CONTROL_PROMPTS = (
    "The weather was mild and the streets were",
    "He read the report twice before he",
    "Trains leave the station every twenty",
    "My favourite thing to cook on a Sunday is",
)
"""Neutral control prompts: the default specificity check (their next-token distributions
should not move)."""

RAY_GRID = np.linspace(-10.0, 10.0, 41)


# ------------------------------------------------------------------ pure pieces

def last_positions(valid: "bool[M n]") -> "int[M]":
    """Index of each row's last valid token."""
    n = valid.shape[1]
    return n - 1 - jnp.argmax(valid[:, ::-1], axis=1)


def next_token_logp(model, h: "float[M d]") -> "float[M V]":
    """log p(. | prompt) from final residual states at the prompts' last tokens: final norm,
    LM head (soft-capped), log-softmax in float32."""
    return jax.nn.log_softmax(model_logits(model, h).astype(jnp.float32), axis=-1)


def edited_final_states(model, X, valid, last, edit, *, before_add, after_add):
    """Final residual states "float[M d]" at each row's last token: the steps ``before_add``
    from X (the tokens entering the edited step), with ``edit`` = (dO or None, v or None)
    applied (dO to W_o of the edited layer, already in ``edit``'s layers; v added to every
    token after those steps), then the steps ``after_add``."""
    layers, v = edit
    Y = run_tail(layers, X, valid, before_add, rule="full", attention="softmax", keep_bias=True)
    if v is not None:
        Y = Y + v
    if len(after_add):
        Y = run_tail(layers, Y, valid, after_add, rule="full", attention="softmax", keep_bias=True)
    return Y[jnp.arange(Y.shape[0]), last]


def token_constraints(logp, target_id, log_target, base_logp, max_kl: float, n_prompts: int):
    """(g "float[B+1]", log p(target) "float[B]", mean control KL): the constraints of the
    module docstring from next-token log-probabilities "float[B+C V]" (prompts first)."""
    lp_t = logp[:n_prompts, target_id]
    kl_each = jnp.sum(jnp.exp(base_logp) * (base_logp - logp[n_prompts:]), axis=-1)
    kl = jnp.mean(kl_each)
    return jnp.concatenate([log_target - lp_t, (kl - max_kl)[None]]), lp_t, kl


def _edit(model, params, u, n0, *, param: str, layer: int):
    """(layers with the weight edit, v or None) of a parameterisation."""
    layers = model.layers
    if param == "activation":
        return layers, n0 * params["s"]
    fP, fQ = edit_factors(params, u, n0, param)
    return layers.replace(W_o=layers.W_o.at[layer].add(fP @ fQ.T)), None


def _size(params, n0, param: str):
    """||E||^2 / n0^2."""
    if param == "activation":
        return jnp.sum(params["s"] ** 2)
    return _delta_sq(params, param) / (n0 * n0 if param == "w_alpha" else 1.0)


def ray_start(min_logp, log_target, dtype, bisect_iters: int):
    """log alpha of the closed-form start (module docstring) and whether it is feasible, for
    ``min_logp(log_alpha)`` = min over prompts of log p(target)."""
    grid = jnp.asarray(RAY_GRID, dtype)
    vals = jax.lax.map(min_logp, grid)
    ok = vals >= log_target
    feasible = jnp.any(ok)
    first = jnp.argmax(ok)
    lo = jnp.where(first > 0, grid[jnp.maximum(first - 1, 0)], grid[0] - 10.0)
    _, hi = bisect_increasing(lambda m: min_logp(m) >= log_target, lo, grid[first], bisect_iters)
    return jnp.where(feasible, hi, grid[jnp.argmax(vals)]), feasible


def solve_token_one(model, X, valid, last, base_logp, u, target_id, log_target, key, R, *, layer: int,
                    before_add, after_add, n_prompts: int, param: str, rank: int, max_kl: float, steps: int,
                    lr: float, mu: float, dual_every: int, tol: float, w_kind: str, bisect_iters: int = 30,
                    lr_floor: float = 0.05):
    """One target (module docstring): u (d,) unit, target_id, log_target = log(target_prob).
    R: pinv(V^T) (H e, d) for w_kind 'inverse', else V (H e, d). Returns a dict of arrays
    (see :class:`TokenSteeringResult`)."""
    dtype = X.dtype
    fwd = lambda edit: next_token_logp(model, edited_final_states(model, X, valid, last, edit, before_add=before_add,
                                                                   after_add=after_add))
    constraints_of = lambda logp: token_constraints(logp, target_id, log_target, base_logp, max_kl, n_prompts)
    if param == "activation":
        w_hat, wn = None, jnp.asarray(1.0, dtype)
        ray_edit = lambda log_a: (model.layers, jnp.exp(log_a) * u)
    else:
        w_cf = R @ u
        w_cf = w_cf / jnp.linalg.norm(w_cf) if w_kind == "value" else w_cf
        wn = jnp.linalg.norm(w_cf)
        w_hat = w_cf / wn
        ray_edit = lambda log_a: (model.layers.replace(
            W_o=model.layers.W_o.at[layer].add(jnp.exp(log_a) * jnp.outer(u, w_cf))), None)
    min_logp = lambda log_a: jnp.min(constraints_of(fwd(ray_edit(log_a)))[1])
    log_cf, cf_feasible = ray_start(min_logp, log_target, dtype, bisect_iters)
    alpha_cf = jnp.exp(log_cf)
    _, cf_lp, cf_kl = constraints_of(fwd(ray_edit(log_cf)))
    # where the ray never gets there its best point may be a vanishing edit: the edit's scale
    # n0 is then at least a tenth of the layer's own (||W_o|| or the mean token norm entering it)
    floor = 0.1 * (jnp.sqrt(jnp.mean(jnp.sum(X * X, -1))) if param == "activation"
                   else jnp.linalg.norm(model.layers.W_o[layer]))
    n0 = jnp.where(cf_feasible, alpha_cf * wn, jnp.maximum(alpha_cf * wn, floor))
    params = {"s": u} if param == "activation" else initial_params(param, n0, w_hat, u, rank, key, dtype)

    def constraints(p):
        g, lp_t, _ = constraints_of(fwd(_edit(model, p, u, n0, param=param, layer=layer)))
        return g, jnp.min(lp_t)

    sol = constrained_adam(lambda p: _size(p, n0, param), constraints, params, steps=steps, lr=lr, mu=mu,
                           dual_every=dual_every, tol=tol, lr_floor=lr_floor)
    best = sol["params"]
    found = jnp.isfinite(sol["size"])
    _, lp_t, kl = constraints_of(fwd(_edit(model, best, u, n0, param=param, layer=layer)))
    nan = lambda a: jnp.where(found, a, jnp.nan)
    if param == "activation":
        vec = n0 * best["s"]
        fP, fQ, norm = vec[:, None], jnp.ones((1, 1), dtype), jnp.linalg.norm(vec)
    else:
        fP, fQ = edit_factors(best, u, n0, param)
        norm = factor_norm(fP, fQ)
    return {"factor_P": nan(fP), "factor_Q": nan(fQ), "norm": nan(norm), "target_prob": nan(jnp.exp(lp_t)),
            "control_kl": nan(kl), "feasible": found,
            "closed_alpha": alpha_cf, "closed_norm": n0, "closed_target_prob": jnp.exp(cf_lp),
            "closed_control_kl": cf_kl, "closed_feasible": cf_feasible, "multiplier": sol["multiplier"],
            "history_min_target_prob": jnp.exp(sol["history_aux"]), "history_norm": jnp.sqrt(sol["history_size"]) * n0}


_STATIC = ("layer", "before_add", "after_add", "n_prompts", "param", "rank", "max_kl", "steps", "lr", "mu",
           "dual_every", "tol", "w_kind", "bisect_iters")


@functools.partial(jax.jit, static_argnames=_STATIC)
def solve_token_many(model, X, valid, last, base_logp, U, target_ids, log_targets, keys, R, **static):
    """:func:`solve_token_one` vmapped over K targets (U (K, d), ids (K,), log targets (K,), keys (K, 2))."""
    one = lambda u, t, lt, k: solve_token_one(model, X, valid, last, base_logp, u, t, lt, k, R, **static)
    return jax.vmap(one)(U, target_ids, log_targets, keys)


# ------------------------------------------------------------------ public API

@dataclasses.dataclass
class TokenSteeringResult:
    """Token steering of K targets (leading axis K on every array).

    ``param`` "lowrank"/"w_alpha": delta_O (K, d, H e) = factor_P factor_Q^T; "activation":
    ``vector`` (K, d), the vector added to the edited layer's output. norm (K,): ||delta_O||_F
    or ||v||; target_prob (K, B) reached at each prompt; control_kl (K,) the mean KL over
    the controls; feasible (K,). The closed-form start along the ray (module docstring):
    closed_alpha, closed_norm, closed_target_prob (K, B), closed_control_kl, closed_feasible.
    """

    target_ids: np.ndarray
    directions: np.ndarray
    factor_P: np.ndarray
    factor_Q: np.ndarray
    norm: np.ndarray
    target_prob: np.ndarray
    control_kl: np.ndarray
    feasible: np.ndarray
    closed_alpha: np.ndarray
    closed_norm: np.ndarray
    closed_target_prob: np.ndarray
    closed_control_kl: np.ndarray
    closed_feasible: np.ndarray
    multiplier: np.ndarray
    history_min_target_prob: np.ndarray
    history_norm: np.ndarray
    target_prob_level: np.ndarray
    max_kl: float
    param: str
    rank: int
    layer: int
    w: str
    objective: str = "token"

    @property
    def delta_O(self) -> np.ndarray:
        """The dense weight changes (K, d, H e) in float64 (not for ``activation``)."""
        if self.param == "activation":
            raise ValueError("an activation-addition result has no delta_O; its edit is .vector")
        return np.einsum("kdr,ker->kde", np.asarray(self.factor_P, np.float64), np.asarray(self.factor_Q, np.float64))

    @property
    def vector(self) -> np.ndarray:
        """The added vectors v (K, d) (``activation`` only)."""
        if self.param != "activation":
            raise ValueError(f"a {self.param!r} result is a weight change; use .delta_O")
        return np.asarray(self.factor_P[..., 0], np.float64)

    def delta_rank(self, i: int = 0) -> int:
        """Numerical rank of delta_O[i] (see :meth:`~.optimize.SteeringResult.delta_rank`); 1
        for a nonzero activation vector, 0 when infeasible."""
        return factor_rank(np.asarray(self.factor_P[i]), np.asarray(self.factor_Q[i]))

    def to_json(self, i: int = 0) -> dict:
        f = lambda a: float(np.asarray(a)[i])
        return {"objective": "token", "param": self.param, "rank": self.rank, "delta_rank": self.delta_rank(i),
                "layer": self.layer, "w": self.w, "target_id": int(self.target_ids[i]),
                "target_prob_level": f(self.target_prob_level), "max_kl": self.max_kl, "norm": f(self.norm),
                "target_prob": np.asarray(self.target_prob[i]).tolist(), "control_kl": f(self.control_kl),
                "feasible": bool(self.feasible[i]), "closed_alpha": f(self.closed_alpha),
                "closed_norm": f(self.closed_norm), "closed_target_prob": np.asarray(self.closed_target_prob[i]).tolist(),
                "closed_control_kl": f(self.closed_control_kl), "closed_feasible": bool(self.closed_feasible[i])}


def check_probability(p, name: str) -> np.ndarray:
    a = np.asarray(p, np.float64)
    if a.ndim > 1 or not np.all(np.isfinite(a)) or np.any(a <= 0) or np.any(a >= 1):
        raise ValueError(f"{name} must be a number (or one per target) strictly between 0 and 1, got {p!r}")
    return a


def control_batch(model, controls):
    """Token ids (C, n) and mask of the control prompts (texts or id lists; default
    :data:`CONTROL_PROMPTS`)."""
    from ..models.embed import padded_ids, prompt_ids
    rows = prompt_ids(model, list(CONTROL_PROMPTS) if controls is None else controls)
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("controls: give at least one non-empty control prompt")
    return padded_ids(model, rows)


def _pad_to(x, valid, n):
    B, m, d = x.shape
    return (np.concatenate([x, np.zeros((B, n - m, d), x.dtype)], 1),
            np.concatenate([valid, np.zeros((B, n - m), bool)], 1))


def entering(layers, X, valid, step: int):
    """The tokens entering schedule step ``step`` under rule ``full`` (the steps before it run once)."""
    if step == 0:
        return X
    return run_batch(layers, X, valid, rule="full", schedule=np.asarray(layers.schedule[:step]),
                     observe=("final",))["final"]


def optimize_token(model, x0, targets, *, valid=None, layer: int = -1, rank: int = 1, param: str = "lowrank",
                   target_prob=0.5, max_kl: float = 0.5, controls=None, steps: int = 300, lr: float = 3e-3,
                   mu: float = 10.0, dual_every: int = 10, tol: float = 1e-4, w: str = "auto",
                   seed: int = 0) -> TokenSteeringResult:
    """:func:`~.optimize.optimize_steering` with ``objective="token"`` (module docstring).

    model: a loaded causal decoder; x0 "float[B n d]" the prompts' embeddings with ``valid``;
    targets: a token id or K ids; target_prob: one level or one per target; controls: texts
    or token-id lists (default :data:`CONTROL_PROMPTS`)."""
    from ..models.base import Model
    from ..models.embed import embed_ids
    from ..models.layout import unembedding_matrix
    if not isinstance(model, Model) or model.info is None or not model.info.decoder:
        raise ValueError("objective='token' needs a loaded causal decoder (its LM head gives the next-token "
                         "distribution), not bare layers")
    if param not in TOKEN_PARAMS:
        raise ValueError(f"unknown param {param!r}; expected one of {TOKEN_PARAMS}")
    for name, v in (("rank", rank), ("steps", steps), ("dual_every", dual_every)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    for name, v in (("lr", lr), ("mu", mu), ("max_kl", max_kl)):
        if not isinstance(v, (int, float, np.floating, np.integer)) or not np.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    layers = model.layers
    l = layer_index(layers, layer)
    V_head = unembedding_matrix(model)
    ids = np.atleast_1d(np.asarray(targets))
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"targets must be a token id or a list of token ids for objective='token', got {targets!r}")
    if ids.min() < 0 or ids.max() >= V_head.shape[0]:
        raise ValueError(f"target token id {int(ids.max() if ids.max() >= V_head.shape[0] else ids.min())} is outside "
                         f"the vocabulary [0, {V_head.shape[0]})")
    levels = check_probability(target_prob, "target_prob")
    levels = np.broadcast_to(levels, ids.shape) if levels.ndim == 0 or levels.size == 1 else levels
    if levels.shape != ids.shape:
        raise ValueError(f"target_prob has {levels.size} levels for {ids.size} targets")
    U = V_head[ids] / np.linalg.norm(V_head[ids], axis=-1, keepdims=True)
    dtype = layers.W_v.dtype
    x0 = np.asarray(x0, dtype)
    x0 = x0[None] if x0.ndim == 2 else x0
    vb = np.ones(x0.shape[:2], bool) if valid is None else np.asarray(valid, bool).reshape(x0.shape[:2])
    if x0.ndim != 3 or x0.shape[-1] != layers.config.d_model or not vb.any(axis=1).all():
        raise ValueError(f"x0 must be prompts' embeddings (B, n, {layers.config.d_model}) with a valid token each, "
                         f"got shape {x0.shape}")
    cid, cvalid = control_batch(model, controls)
    xc, cv = (np.asarray(a) for a in embed_ids(model, cid, cvalid))
    n = max(x0.shape[1], xc.shape[1])
    (xp, vp), (xc, cv) = _pad_to(x0, vb, n), _pad_to(xc.astype(dtype), np.asarray(cv, bool), n)
    X_all, V_all = jnp.asarray(np.concatenate([xp, xc])), jnp.asarray(np.concatenate([vp, cv]))
    B = x0.shape[0]
    sched = layers.schedule
    steps_of = sched.steps_of(l)
    if not steps_of:
        raise ValueError(f"unique layer {l} is never applied by the schedule {sched}")
    t0 = steps_of[-1] if param == "activation" else steps_of[0]
    t_last = steps_of[-1]
    before_add, after_add = tuple(sched[t0:t_last + 1]), tuple(sched[t_last + 1:])
    X = entering(layers, X_all, V_all, t0)
    last = last_positions(V_all)
    h_base = edited_final_states(model, X, V_all, last, (layers, None), before_add=before_add, after_add=after_add)
    base_logp = next_token_logp(model, h_base)[B:]
    _, Vc, _ = host_matrices(layers, l)
    w_kind = resolve_w(Vc, w, l).kind if w == "auto" else resolve_w(Vc, w, l).kind
    R = jnp.asarray(inverse_map(Vc, l) if w_kind == "inverse" else Vc, dtype)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(ids))
    out = solve_token_many(model, X, V_all, last, base_logp, jnp.asarray(U, dtype), jnp.asarray(ids, jnp.int32),
                           jnp.asarray(np.log(levels), dtype), keys, R, layer=l, before_add=before_add,
                           after_add=after_add, n_prompts=B, param=param, rank=int(rank), max_kl=float(max_kl),
                           steps=int(steps), lr=float(lr), mu=float(mu), dual_every=int(dual_every), tol=float(tol),
                           w_kind=w_kind)
    out = jax.tree_util.tree_map(np.asarray, out)
    return TokenSteeringResult(target_ids=ids, directions=U, target_prob_level=np.asarray(levels, np.float64),
                               max_kl=float(max_kl), param=param, rank=1 if param == "activation" else int(rank),
                               layer=l, w="none" if param == "activation" else w_kind, **out)
