"""The constrained optimiser shared by every steering objective (design.md §4).

Problem: minimise a normalised edit size N(theta) subject to constraints g(theta) <= 0
(g a scalar or an array: one multiplier per entry). Augmented Lagrangian::

    L(theta; lam) = N + sum_j (max(0, lam_j + mu g_j)^2 - lam_j^2) / (2 mu),
    lam <- max(0, lam + mu g) every ``dual_every`` Adam steps,

with Adam's step size on a cosine decay from ``lr`` to ``lr_floor * lr`` over the steps (the
size shrinks by large factors, so a constant step becomes too large late in the run). The
best feasible iterate (every g_j <= tol, smallest N) is kept; the last iterate is checked too.

Everything here is a pure function of traced arrays (jit/vmap over targets by the callers).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax


def al_penalty(g, lam, mu: float):
    """sum_j (max(0, lam_j + mu g_j)^2 - lam_j^2) / (2 mu): the augmented-Lagrangian term of
    constraints g <= 0 with multipliers lam (same shape, scalar or array)."""
    return jnp.sum(jnp.square(jnp.maximum(0.0, lam + mu * g)) - lam * lam) / (2.0 * mu)


def bisect_increasing(ok: Callable, lo, hi, iters: int):
    """(lo, hi) after ``iters`` halvings of [lo, hi] keeping ok(lo) false and ok(hi) true
    (``ok`` is a traced predicate assumed monotone on the interval)."""
    def body(_, lohi):
        a, b = lohi
        mid = 0.5 * (a + b)
        good = ok(mid)
        return jnp.where(good, a, mid), jnp.where(good, mid, b)

    return jax.lax.fori_loop(0, iters, body, (lo, hi))


def _keep_better(better, best, new):
    return jax.tree_util.tree_map(lambda b, q: jnp.where(better, q, b), best, new)


def constrained_adam(size: Callable, constraints: Callable, params, *, steps: int, lr: float, mu: float,
                     dual_every: int, tol: float, lr_floor: float = 0.05) -> dict:
    """Minimise ``size(params)`` subject to ``constraints(params) <= 0`` (module docstring).

    Args:
      size: params -> N (scalar), the normalised squared size of the edit.
      constraints: params -> (g, aux): g the constraint values (scalar or "float[J]"), aux a
        scalar recorded per step (e.g. the alignment reached).
      params: the initial pytree.
    Returns a dict: ``params`` (best feasible iterate, the initial one when none was),
    ``size``, ``g``, ``aux`` at it (``size`` inf when none was feasible), ``multiplier`` (the
    final lam), ``history_aux``, ``history_size`` ("float[steps]").
    """
    def objective(p, lam):
        N = size(p)
        g, aux = constraints(p)
        return N + al_penalty(g, lam, mu), (g, aux, N)

    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=lr_floor))
    grad = jax.value_and_grad(objective, has_aux=True)

    def step(carry, i):
        p, state, lam, best = carry
        (_, (g, aux, N)), gr = grad(p, lam)
        better = jnp.all(g <= tol) & (N < best[1])
        best = _keep_better(better, best, (p, N, g, aux))
        upd, state = opt.update(gr, state, p)
        p = optax.apply_updates(p, upd)
        lam = jnp.where((i + 1) % dual_every == 0, jnp.maximum(0.0, lam + mu * g), lam)
        return (p, state, lam, best), (aux, N)

    g0, aux0 = constraints(params)
    dtype = jnp.result_type(aux0)
    inf = jnp.asarray(jnp.inf, dtype)
    lam0 = jnp.zeros_like(g0)
    best0 = (params, inf, g0, aux0)
    (p, _, lam, best), (hist_aux, hist_N) = jax.lax.scan(step, (params, opt.init(params), lam0, best0),
                                                         jnp.arange(steps))
    _, (g_last, aux_last, N_last) = objective(p, lam)          # the last iterate is checked too
    better = jnp.all(g_last <= tol) & (N_last < best[1])
    best_p, best_N, best_g, best_aux = _keep_better(better, best, (p, N_last, g_last, aux_last))
    return {"params": best_p, "size": best_N, "g": best_g, "aux": best_aux, "multiplier": lam,
            "history_aux": hist_aux, "history_size": hist_N}
