"""Steering the model's own next token (``objective="token"``, design.md §4).

For a target token t (one per target k), prompts b = 1..B and control prompts c = 1..C::

    minimise   ||E||^2 / n0^2
    subject to g_b  = log(target_prob) - log p_E(t | prompt b) <= 0     (b = 1..B)
               g_kl = mean_c KL(p_0(. | c) || p_E(. | c)) - max_kl <= 0

p_E is the model's own next-token distribution at a prompt's last valid token under rule
``full`` with the edit E: the final state of :func:`powerlens._src.dynamics.run` (the residual
stream), the model's final norm once, its LM head and soft-capping
(:func:`powerlens._src.models.forward.logits`). The edit E of unique layer l (param)::

    "lowrank"     W_o[l] += dO = n0 P Q^T            (P (d, r), Q (H e, r)),  ||E|| = ||dO||_F
    "w_alpha"     W_o[l] += dO = e^a u w_cf^T        (only a learned; w_cf fixed), the closed-form ray
    "activation"  h += v = n0 s at every token of the output of the last step applying l,
                  ||E|| = ||v||  (activation addition)

u is the target's unit read-out row (the ``token:`` direction). The constraints go through
the augmented Lagrangian of :func:`~.lagrangian.constrained_adam`, one multiplier per
constraint (B + 1). Only each row's last token reaches the head, so the final step of the
schedule runs at that token only (its keys and values read every token); what does not
depend on E runs once, outside the optimisation (:func:`prepare_states`): the steps before
the edited one, and, when the edited layer is the final step (the default, the last layer),
that step's entering state and head mix at the last tokens, so that a step of the loop is
the edit (W_o + n0 P Q^T) m applied as (m Q)(n0 P)^T, the block's MLP, the final norm and
the head at B + C tokens. The scores go through one logsumexp (:func:`token_constraints`),
in the states' precision (float64 under ``jax_enable_x64`` with a float64 model). The K
targets run as compiled, vmapped programs sharded over the devices, the Adam steps in chunks
called from the host (:func:`~.lagrangian.solve_in_chunks`, progress reported between chunks).

Start: the closed-form ray, dO = alpha u w_cf^T (w_cf of :func:`~.rank1.resolve_w`) or
v = alpha u for activation addition. The target probability need not increase along it, so
alpha is found by a scan of log alpha over [-10, 10] (41 points) and bisection inside the
first bracket where min_b p(t | b) crosses ``target_prob`` (the largest min_b p on the grid
when it never does; ``closed_feasible`` says which). n0 is that start's norm (when the ray
never gets there, at least a tenth of the layer's own scale, so the start is not a vanishing edit).

End: Adam's best feasible iterate E is moved to the boundary of the feasible set along its own
ray, s E with the smallest s in (0, 1] that stays feasible (:func:`boundary_scale`): Adam's
first steps overshoot to p(target) near 1, and where both constraints are then slack a smaller
multiple of the same edit is feasible too. Every method thus ends where a constraint is active,
as the closed form at the token alpha does, so their sizes are compared on equal terms.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from ..dynamics.layer import full_attention_input, full_block
from ..dynamics.options import Dynamics
from ..dynamics.run import inert_padding, run_batch
from ..models.forward import logits as model_logits
from .alpha import head_mix, run_tail
from .lagrangian import (adam_finish, adam_start, adam_steps, bisect_increasing, constrained_adam,
                         default_optimizer, solve_in_chunks)
from .edits import edit_of, edit_size, factor_norm, initial_params, learned, scaled
from .progress import active_progress
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

def last_positions(valid: Bool[ArrayLike, "M n"]) -> Int[Array, "M"]:
    """Index of each row's last valid token."""
    n = valid.shape[1]
    return n - 1 - jnp.argmax(valid[:, ::-1], axis=1)


def score_dtype(dtype):
    """The precision of the scores (logits, log-probabilities): the states' own, at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def next_token_logp(model, h: Float[ArrayLike, "M d"]) -> Float[Array, "M V"]:
    """log p(. | prompt) from final residual states at the prompts' last tokens: final norm,
    LM head (soft-capped), log-softmax, in :func:`score_dtype` of the states."""
    z = model_logits(model, h)
    return jax.nn.log_softmax(z.astype(score_dtype(z.dtype)), axis=-1)


def edit_dependent_steps(param: str, before_add: tuple, after_add: tuple) -> tuple:
    """The schedule steps (unique-layer indices) whose input depends on the edit: a weight
    edit, all of them (the first applies the edited layer); activation addition, those after
    the addition."""
    return tuple(after_add) if param == "activation" else tuple(before_add) + tuple(after_add)


def final_step_inputs(lp, S: Float[ArrayLike, "M n d"], valid: Bool[ArrayLike, "M n"], last: Int[ArrayLike, "M"]):
    """(x "float[M d]", mix "float[M H e]"): each row's state at its last token entering the
    final step (layer ``lp``, rule ``full``) and that step's head mix there
    (:func:`~.alpha.head_mix` of the attention's input; the keys and values read every token
    of S). Only the last tokens reach the head, so the final step runs nowhere else."""
    S = inert_padding(S, valid)               # padding as powerlens._src.dynamics.run keeps it: finite norms
    mix = jax.vmap(lambda s, v: head_mix(lp, full_attention_input(lp, s), v, keep_bias=True))(S, valid)
    rows = jnp.arange(S.shape[0])
    return S[rows, last], mix[rows, last]


def final_step(lp, x: Float[ArrayLike, "M d"], mix: Float[ArrayLike, "M He"], factors=None) -> Float[Array, "M d"]:
    """The final step's output at the last tokens: attention output a = (W_o + fP fQ^T) mix + b_o,
    the edit applied as (mix fQ) fP^T (no (d, H e) matrix formed), then the block
    (:func:`~powerlens._src.dynamics.layer.full_block`). ``factors``: (fP "(d, r)", fQ "(H e, r)") or None."""
    a = mix @ lp.W_o.T
    if lp.b_o is not None:
        a = a + lp.b_o
    if factors is not None:
        fP, fQ = factors
        a = a + (mix @ fQ) @ fP.T
    return full_block(lp, x, a)


def prepare_states(layers, X: Float[ArrayLike, "M n d"], valid: Bool[ArrayLike, "M n"], last: Int[ArrayLike, "M"], *,
                   param: str, before_add: tuple, after_add: tuple) -> dict:
    """The part of the forward pass that does not depend on the edit, run once: ``X`` (the tokens
    entering the first edited step), ``S`` (those entering the first edit-dependent step: X, or
    the output of ``before_add`` for activation addition), and, when the final step is the only
    edit-dependent one (the usual case: the last layer edited), its inputs ``x`` and ``mix`` at
    the last tokens (:func:`final_step_inputs`); when no step is (activation addition after the
    final step), the final states ``h`` "float[M d]"."""
    tail = edit_dependent_steps(param, before_add, after_add)
    S = run_tail(layers, X, valid, tuple(before_add), rule="full", attention="softmax", keep_bias=True) \
        if param == "activation" else X
    pre = {"X": X, "S": S}
    if not tail:
        pre["h"] = S[jnp.arange(S.shape[0]), last]
    elif len(tail) == 1:
        pre["x"], pre["mix"] = final_step_inputs(layers.layer(tail[0]), S, valid, last)
    return pre


def edited_final_states(layers, pre: dict, valid, last, edit, *, layer: int, param: str,
                        tail: tuple) -> Float[Array, "M d"]:
    """Final residual states "float[M d]" at each row's last token with ``edit``: (fP, fQ), the
    factors of dO = fP fQ^T added to W_o of unique layer ``layer``, or the vector v
    (``param="activation"``) added to every token after the steps ``before_add``; None: no
    edit. ``pre``: :func:`prepare_states`; ``tail``: :func:`edit_dependent_steps`. The steps
    of the tail but its last run on every token, the last at the last tokens only
    (:func:`final_step`)."""
    if param == "activation":
        add = 0.0 if edit is None else edit
        if not tail:
            return pre["h"] + add
        S, edited = pre["S"] + add, layers
    elif len(tail) == 1:
        return final_step(layers.layer(layer), pre["x"], pre["mix"], edit)
    else:
        S = pre["S"]
        edited = layers if edit is None else layers.replace(W_o=layers.W_o.at[layer].add(edit[0] @ edit[1].T))
    if len(tail) > 1:
        S = run_tail(edited, S, valid, tail[:-1], rule="full", attention="softmax", keep_bias=True)
    lp = edited.layer(tail[-1])
    return final_step(lp, *final_step_inputs(lp, S, valid, last))


def token_constraints(z: Float[ArrayLike, "M V"], target_id, log_target, base_logp, max_kl: float, n_prompts: int):
    """(g "float[B+1]", log p(target) "float[B]", mean control KL): the constraints of the
    module docstring from next-token logits z "float[B+C V]" (prompts first) and the controls'
    unedited log-probabilities base_logp "float[C V]". The log-softmax is never formed: with
    s = logsumexp(z), log p(t | b) = z_t - s and KL(p_0 || p) = sum_v p_0 (log p_0 - z) + s sum_v p_0."""
    z = z.astype(score_dtype(z.dtype))
    lse = jax.nn.logsumexp(z, axis=-1)
    lp_t = z[:n_prompts, target_id] - lse[:n_prompts]
    p0 = jnp.exp(base_logp)
    kl_each = jnp.sum(p0 * (base_logp - z[n_prompts:]), axis=-1) + lse[n_prompts:] * jnp.sum(p0, axis=-1)
    kl = jnp.mean(kl_each)
    return jnp.concatenate([log_target - lp_t, (kl - max_kl)[None]]), lp_t, kl


def boundary_scale(score, edit, *, tol: float, iters: int, dtype):
    """The smallest s in (0, 1] (to 2^-iters) at which s E still meets every constraint, E a
    feasible edit: bisection on s with s = 1 feasible kept as the upper end.

    Adam's best feasible iterate can lie inside the feasible set, both constraints slack
    (p(target) near 1 at every prompt, the control KL below its bound): its norm is then not
    minimal, since a smaller multiple of the same edit is feasible too. Along the ray s E the
    norm is s ||E||, and at s = 0 the target constraint fails (the unedited model does not
    reach ``target_prob``, or the scale goes to 2^-iters), so the bisection ends where a
    constraint becomes active. Where feasibility along the ray is not monotone the result is
    still feasible (the upper end always is), though perhaps not the smallest such s. A scaled
    edit must meet the constraints with a margin of 100 ulp of ``dtype`` (in log p and nats),
    so that the same numbers recomputed on another path (the model's own forward pass, as
    :func:`~.compare.edit_effects` does) still find it feasible."""
    margin = 100 * float(jnp.finfo(dtype).eps)
    feasible = lambda t: jnp.all(score(scaled(edit, t))[0] <= tol - margin)
    _, hi = bisect_increasing(feasible, jnp.asarray(0.0, dtype), jnp.asarray(1.0, dtype), iters)
    return hi


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


def _scores(model, pre, valid, last, base_logp, target_id, log_target, edit, *, layer, param, tail, max_kl,
            n_prompts):
    """token_constraints of one edit (the forward pass, the head, the constraints)."""
    h = edited_final_states(model.layers, pre, valid, last, edit, layer=layer, param=param, tail=tail)
    return token_constraints(model_logits(model, h), target_id, log_target, base_logp, max_kl, n_prompts)


@dataclasses.dataclass(frozen=True)
class TokenSettings:
    """Everything static about one token-steering loop, as one hashable value (the one ``jit``
    static argument of :func:`solve_token_one`, its phases and :func:`token_adam`).

    layer: the edited unique layer; tail: the steps the edit reaches
    (:func:`edit_dependent_steps`); n_prompts: the prompts (the rest of the batch are the
    controls); param, rank: the edit (``lowrank`` of rank r, ``w_alpha``, ``activation``);
    max_kl: the control-KL bound (nats); w_kind: the closed-form w (``inverse`` or ``value``);
    steps, lr, lr_floor, optimizer: the optimiser (default Adam on a cosine decay from lr to
    lr_floor lr); mu, dual_every, tol: the augmented Lagrangian; bisect_iters: the bisections
    of the ray start and of :func:`boundary_scale`."""

    layer: int
    tail: Tuple[int, ...]
    n_prompts: int
    param: str
    max_kl: float
    steps: int
    lr: float
    mu: float
    dual_every: int
    tol: float
    rank: int = 1
    w_kind: str = "value"
    bisect_iters: int = 30
    lr_floor: float = 0.05
    optimizer: Optional[optax.GradientTransformation] = None


def _token_loop(model, pre, valid, last, base_logp, u, target_id, log_target, n0, settings: TokenSettings):
    """(score, size, constraints, optimiser) of one target's Adam loop with scale n0: score(edit)
    = :func:`token_constraints` of an edit, size = ||E||^2 / n0^2, constraints(params) = (g,
    min_b log p(t | b))."""
    s = settings
    param = s.param
    score = functools.partial(_scores, model, pre, valid, last, base_logp, target_id, log_target, layer=s.layer,
                              param=param, tail=s.tail, max_kl=s.max_kl, n_prompts=s.n_prompts)

    def constraints(p):
        g, lp_t, _ = score(edit_of(learned(p, param), u, n0, param))
        return g, jnp.min(lp_t)

    opt = default_optimizer(s.lr, s.steps, s.lr_floor) if s.optimizer is None else s.optimizer
    return score, (lambda p: edit_size(learned(p, param), n0, param)), constraints, opt


def token_adam(model, pre, valid, last, base_logp, u, target_id, log_target, params0, n0, *,
               settings: TokenSettings) -> dict:
    """The Adam loop of one target from ``params0`` with scale n0, all steps in one scan:
    :func:`~.lagrangian.constrained_adam` over :func:`token_constraints` (aux: min_b log p(t | b)).
    Returns constrained_adam's dict."""
    s = settings
    _, size, constraints, opt = _token_loop(model, pre, valid, last, base_logp, u, target_id, log_target, n0, s)
    return constrained_adam(size, constraints, params0, steps=s.steps, lr=s.lr, mu=s.mu, dual_every=s.dual_every,
                            tol=s.tol, lr_floor=s.lr_floor, optimizer=opt)


def token_start(model, pre, valid, last, base_logp, R, u, target_id, log_target, key, *, settings: TokenSettings):
    """Phase 1 of :func:`solve_token_one`: the closed-form start along the ray (module
    docstring) and the loop's initial state. Returns (ctx, state): ctx the closed form's
    arrays and the scale n0 (``closed_norm``), state :func:`~.lagrangian.adam_start`'s."""
    X = pre["X"]
    dtype = X.dtype
    param, layer = settings.param, settings.layer
    score, _, _, _ = _token_loop(model, pre, valid, last, base_logp, u, target_id, log_target, None, settings)
    if param == "activation":
        w_hat, wn = None, jnp.asarray(1.0, dtype)
        ray_edit = lambda log_a: jnp.exp(log_a) * u
    else:
        w_cf = R @ u
        w_cf = w_cf / jnp.linalg.norm(w_cf) if settings.w_kind == "value" else w_cf
        wn = jnp.linalg.norm(w_cf)
        w_hat = w_cf / wn
        ray_edit = lambda log_a: ((jnp.exp(log_a) * u)[:, None], w_cf[:, None])
    min_logp = lambda log_a: jnp.min(score(ray_edit(log_a))[1])
    log_cf, cf_feasible = ray_start(min_logp, log_target, dtype, settings.bisect_iters)
    alpha_cf = jnp.exp(log_cf)
    _, cf_lp, cf_kl = score(ray_edit(log_cf))
    # where the ray never gets there its best point may be a vanishing edit: the edit's scale
    # n0 is then at least a tenth of the layer's own (||W_o|| or the mean token norm entering it)
    floor = 0.1 * (jnp.sqrt(jnp.mean(jnp.sum(X * X, -1))) if param == "activation"
                   else jnp.linalg.norm(model.layers.W_o[layer]))
    n0 = jnp.where(cf_feasible, alpha_cf * wn, jnp.maximum(alpha_cf * wn, floor))
    params = {"s": u} if param == "activation" else initial_params(param, n0, w_hat, u, settings.rank, key, dtype)
    _, _, constraints, opt = _token_loop(model, pre, valid, last, base_logp, u, target_id, log_target, n0, settings)
    ctx = {"closed_alpha": alpha_cf, "closed_norm": n0, "closed_target_prob": jnp.exp(cf_lp),
           "closed_control_kl": cf_kl, "closed_feasible": cf_feasible}
    return ctx, adam_start(constraints, params, opt)


def token_advance(model, pre, valid, last, base_logp, R, i0, stop, u, target_id, log_target, key, ctx, state, *,
                  n: int, settings: TokenSettings):
    """Phase 2: Adam steps i0 .. i0 + n - 1 from ``state``, those >= ``stop`` left undone
    (:func:`~.lagrangian.adam_steps`)."""
    _, size, constraints, opt = _token_loop(model, pre, valid, last, base_logp, u, target_id, log_target,
                                            ctx["closed_norm"], settings)
    return adam_steps(size, constraints, state, i0, n, optimizer=opt, mu=settings.mu, dual_every=settings.dual_every,
                      tol=settings.tol, stop=stop)


def token_finish(model, pre, valid, last, base_logp, R, u, target_id, log_target, key, ctx, state, hist_aux,
                 hist_size, *, settings: TokenSettings):
    """Phase 3: the best feasible iterate moved to the boundary (:func:`boundary_scale`) and
    measured, with the closed form and the histories (a dict of arrays, see
    :class:`TokenSteeringResult`)."""
    dtype = pre["X"].dtype
    param, tol = settings.param, settings.tol
    n0 = ctx["closed_norm"]
    score, size, constraints, _ = _token_loop(model, pre, valid, last, base_logp, u, target_id, log_target, n0, settings)
    sol = adam_finish(size, constraints, state, mu=settings.mu, tol=tol)
    found = jnp.isfinite(sol["size"])
    best = edit_of(sol["params"], u, n0, param)
    shrink = jnp.where(found, boundary_scale(score, best, tol=tol, iters=settings.bisect_iters, dtype=dtype),
                       1.0)
    edit = scaled(best, shrink)
    _, lp_t, kl = score(edit)
    nan = lambda a: jnp.where(found, a, jnp.nan)
    if param == "activation":
        fP, fQ, norm = edit[:, None], jnp.ones((1, 1), dtype), jnp.linalg.norm(edit)
    else:
        fP, fQ = edit
        norm = factor_norm(fP, fQ)
    return {"factor_P": nan(fP), "factor_Q": nan(fQ), "norm": nan(norm), "target_prob": nan(jnp.exp(lp_t)),
            "control_kl": nan(kl), "feasible": found, "shrink": nan(shrink), **ctx,
            "multiplier": sol["multiplier"],
            "history_min_target_prob": jnp.exp(hist_aux), "history_norm": jnp.sqrt(hist_size) * n0}


TOKEN_PHASES = (token_start, token_advance, token_finish)


def solve_token_one(model, pre, valid, last, base_logp, R, u, target_id, log_target, key, *,
                    settings: TokenSettings):
    """One target (module docstring), all the steps in one program, with the static
    :class:`TokenSettings`: u (d,) unit, target_id, log_target = log(target_prob). ``pre``:
    :func:`prepare_states`. R: pinv(V^T) (H e, d) for w_kind 'inverse', else V (H e, d).
    The phases :data:`TOKEN_PHASES` are what :func:`~.lagrangian.solve_in_chunks` runs from the
    host. Returns a dict of arrays (see :class:`TokenSteeringResult`)."""
    shared = (model, pre, valid, last, base_logp, R)
    one = (u, target_id, log_target, key)
    ctx, state = token_start(*shared, *one, settings=settings)
    state, (hist_aux, hist_size) = token_advance(*shared, 0, None, *one, ctx, state, n=settings.steps,
                                                 settings=settings)
    return token_finish(*shared, *one, ctx, state, hist_aux, hist_size, settings=settings)


def solve_token_many(model, pre, valid, last, base_logp, R, U, target_ids, log_targets, keys, *,
                     settings: TokenSettings, progress: bool = False):
    """:func:`solve_token_one` for K targets (U (K, d), ids (K,), log targets (K,), keys (K, 2)):
    compiled, vmapped programs run in chunks of steps from the host, the targets sharded over
    the devices (:func:`~.lagrangian.solve_in_chunks`). ``progress``: report the steps, p(target)
    and the control KL to the active :class:`~.progress.SteerProgress`."""
    report = None
    sink = active_progress() if progress else None
    if sink is not None:
        levels = np.exp(np.asarray(log_targets, np.float64))
        max_kl = float(settings.max_kl)

        def report(i, ctx, state, aux):
            p = np.exp(np.asarray(aux[:, -1], np.float64))
            kl = np.asarray(state["g"][:, -1], np.float64) + max_kl
            for k in range(len(levels)):
                sink.step(i - 1, float(p[k]), float(kl[k]), float(levels[k]))
    return solve_in_chunks(TOKEN_PHASES, (model, pre, valid, last, base_logp, R), (U, target_ids, log_targets, keys),
                           {"settings": settings}, steps=int(settings.steps), report=report)


# ------------------------------------------------------------------ public API

@dataclasses.dataclass
class TokenSteeringResult:
    """Token steering of K targets (leading axis K on every array).

    ``param`` "lowrank"/"w_alpha": delta_O (K, d, H e) = factor_P factor_Q^T; "activation":
    ``vector`` (K, d), the vector added to the edited layer's output. norm (K,): ||delta_O||_F
    or ||v||; target_prob (K, B) reached at each prompt; control_kl (K,) the mean KL over
    the controls; feasible (K,); shrink (K,) the factor s <= 1 that moved Adam's best feasible
    edit to the boundary of the feasible set (:func:`boundary_scale`; the edit returned is the
    scaled one). The closed-form start along the ray (module docstring):
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
    shrink: np.ndarray
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
        """Target i as JSON; KLs reported as max(0, KL) (the loop's own, in its precision: a
        value below 0 is rounding; NaN stays NaN)."""
        f = lambda a: float(np.asarray(a)[i])
        kl = lambda a: float(np.maximum(np.asarray(a, np.float64)[i], 0.0))
        return {"objective": "token", "param": self.param, "rank": self.rank, "delta_rank": self.delta_rank(i),
                "layer": self.layer, "w": self.w, "target_id": int(self.target_ids[i]),
                "target_prob_level": f(self.target_prob_level), "max_kl": self.max_kl, "norm": f(self.norm),
                "target_prob": np.asarray(self.target_prob[i]).tolist(), "control_kl": kl(self.control_kl),
                "feasible": bool(self.feasible[i]), "shrink": f(self.shrink), "closed_alpha": f(self.closed_alpha),
                "closed_norm": f(self.closed_norm), "closed_target_prob": np.asarray(self.closed_target_prob[i]).tolist(),
                "closed_control_kl": kl(self.closed_control_kl), "closed_feasible": bool(self.closed_feasible[i])}


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
    return run_batch(layers, X, valid, dynamics=Dynamics.full(), schedule=np.asarray(layers.schedule[:step]),
                     observe=("final",))["final"]


def optimize_token(model, x0, targets, *, valid=None, layer: int = -1, rank: int = 1, param: str = "lowrank",
                   target_prob=0.5, max_kl: float = 0.5, controls=None, steps: int = 300, lr: float = 3e-3,
                   mu: float = 10.0, dual_every: int = 10, tol: float = 0.0, w: str = "auto",
                   seed: int = 0, progress: bool = False, optimizer=None) -> TokenSteeringResult:
    """:func:`~.optimize.optimize_steering` with ``objective="token"`` (module docstring).

    model: a loaded causal decoder; x0 "float[B n d]" the prompts' embeddings with ``valid``;
    targets: a token id or K ids; target_prob: one level or one per target; controls: texts
    or token-id lists (default :data:`CONTROL_PROMPTS`); progress: report the steps to the
    active :class:`~.progress.SteerProgress` (the loop runs in the same chunks without it, so
    the numbers are the same); optimizer: an optax transformation (default
    :func:`~.lagrangian.default_optimizer` of lr and steps)."""
    from ..models.base import Model
    from ..models.embed import embed_ids
    from ..models.layout import unembedding_matrix, vocabulary_rows
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
    vocab = vocabulary_rows(model)
    ids = np.atleast_1d(np.asarray(targets))
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"targets must be a token id or a list of token ids for objective='token', got {targets!r}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"target token id {int(ids.max() if ids.max() >= vocab else ids.min())} is outside "
                         f"the vocabulary [0, {vocab})")
    levels = check_probability(target_prob, "target_prob")
    levels = np.broadcast_to(levels, ids.shape) if levels.ndim == 0 or levels.size == 1 else levels
    if levels.shape != ids.shape:
        raise ValueError(f"target_prob has {levels.size} levels for {ids.size} targets")
    U = unembedding_matrix(model, rows=ids)
    U = U / np.linalg.norm(U, axis=-1, keepdims=True)
    dtype = layers.dtype
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
    pre = prepare_states(layers, X, V_all, last, param=param, before_add=before_add, after_add=after_add)
    tail = edit_dependent_steps(param, before_add, after_add)
    h_base = edited_final_states(layers, pre, V_all, last, None, layer=l, param=param, tail=tail)
    base_logp = next_token_logp(model, h_base)[B:]
    _, Vc, _ = host_matrices(layers, l)
    w_kind = resolve_w(Vc, w, l).kind
    R = jnp.asarray(inverse_map(Vc, l) if w_kind == "inverse" else Vc, dtype)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(ids))
    out = solve_token_many(model, pre, V_all, last, base_logp, R, jnp.asarray(U, dtype), jnp.asarray(ids, jnp.int32),
                           jnp.asarray(np.log(levels), dtype), keys, progress=progress,
                           settings=TokenSettings(layer=l, tail=tail, n_prompts=B, param=param, rank=int(rank),
                                                  max_kl=float(max_kl), steps=int(steps), lr=float(lr),
                                                  mu=float(mu), dual_every=int(dual_every), tol=float(tol),
                                                  w_kind=w_kind, optimizer=optimizer))
    out = jax.tree_util.tree_map(np.asarray, out)
    return TokenSteeringResult(target_ids=ids, directions=U, target_prob_level=np.asarray(levels, np.float64),
                               max_kl=float(max_kl), param=param, rank=1 if param == "activation" else int(rank),
                               layer=l, w="none" if param == "activation" else w_kind, **out)
