"""The constrained optimiser shared by every steering objective (design.md §4).

Problem: minimise a normalised edit size N(theta) subject to constraints g(theta) <= 0
(g a scalar or an array: one multiplier per entry). Augmented Lagrangian::

    L(theta; lam) = N + sum_j (max(0, lam_j + mu g_j)^2 - lam_j^2) / (2 mu),
    lam <- max(0, lam + mu g) every ``dual_every`` Adam steps,

with Adam's step size on a cosine decay from ``lr`` to ``lr_floor * lr`` over the steps (the
size shrinks by large factors, so a constant step becomes too large late in the run). The
best feasible iterate (every g_j <= tol, smallest N) is kept; the last iterate is checked too.

Everything here is a pure function of traced arrays (jit/vmap over targets by the callers).
The loop is three pieces (:func:`adam_start`, :func:`adam_steps`, :func:`adam_finish`) so that
a caller can run its steps in chunks from the host, reporting progress between them
(:func:`solve_in_chunks`), with the numbers of one scan over all the steps.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax

from ..dynamics import execution
from ..dynamics.execution import map_systems


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


def default_optimizer(lr: float, steps: int, lr_floor: float = 0.05) -> optax.GradientTransformation:
    """Adam with its step size on a cosine decay from ``lr`` to ``lr_floor * lr`` over ``steps``."""
    return optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=lr_floor))


def _objective(size: Callable, constraints: Callable, mu: float) -> Callable:
    """(params, lam) -> (L, (g, aux, N)): the augmented Lagrangian and what a step records."""
    def objective(p, lam):
        N = size(p)
        g, aux = constraints(p)
        return N + al_penalty(g, lam, mu), (g, aux, N)
    return objective


def adam_start(constraints: Callable, params, optimizer: optax.GradientTransformation) -> dict:
    """The loop's state before step 0: ``params``, the optimiser's state ``opt``, multipliers
    ``lam`` = 0 (the shape of g), ``best`` = (params, inf, g, aux) (no feasible iterate yet) and
    ``g``, the constraint values of the last step taken (here: of ``params``)."""
    g0, aux0 = constraints(params)
    inf = jnp.asarray(jnp.inf, jnp.result_type(aux0))
    return {"params": params, "opt": optimizer.init(params), "lam": jnp.zeros_like(g0),
            "best": (params, inf, g0, aux0), "g": g0}


def adam_steps(size: Callable, constraints: Callable, state: dict, i0, n: int, *,
               optimizer: optax.GradientTransformation, mu: float, dual_every: int, tol: float, stop=None):
    """Steps i0 .. i0 + n - 1 of the loop (one ``lax.scan`` of static length n; ``i0`` may be
    traced) from ``state`` (:func:`adam_start` or an earlier call): (state, (aux "float[n]",
    N "float[n]")). Running the steps in several calls gives the same state as one call: the
    optimiser's own step count (its schedule) is part of the state. ``stop`` (may be traced):
    steps i >= stop leave the state as it is (their aux and N are to be dropped), so that
    calls of one length n cover any number of steps with one compiled program."""
    grad = jax.value_and_grad(_objective(size, constraints, mu), has_aux=True)

    def step(carry, i):
        p, opt_state, lam, best, _ = carry
        (_, (g, aux, N)), gr = grad(p, lam)
        better = jnp.all(g <= tol) & (N < best[1])
        best = _keep_better(better, best, (p, N, g, aux))
        upd, opt_state = optimizer.update(gr, opt_state, p)
        p = optax.apply_updates(p, upd)
        lam = jnp.where((i + 1) % dual_every == 0, jnp.maximum(0.0, lam + mu * g), lam)
        new = (p, opt_state, lam, best, g)
        if stop is not None:
            new = jax.tree_util.tree_map(lambda a, b: jnp.where(i < stop, a, b), new, carry)
        return new, (aux, N)

    carry = (state["params"], state["opt"], state["lam"], state["best"], state["g"])
    (p, opt_state, lam, best, g), hist = jax.lax.scan(step, carry, i0 + jnp.arange(n))
    return {"params": p, "opt": opt_state, "lam": lam, "best": best, "g": g}, hist


def adam_finish(size: Callable, constraints: Callable, state: dict, *, mu: float, tol: float) -> dict:
    """The result after the last step: the last iterate is checked too. A dict: ``params`` (best
    feasible iterate, the initial one when none was), ``size``, ``g``, ``aux`` at it (``size``
    inf when none was feasible), ``multiplier`` (the final lam)."""
    _, (g_last, aux_last, N_last) = _objective(size, constraints, mu)(state["params"], state["lam"])
    best = state["best"]
    better = jnp.all(g_last <= tol) & (N_last < best[1])
    best_p, best_N, best_g, best_aux = _keep_better(better, best, (state["params"], N_last, g_last, aux_last))
    return {"params": best_p, "size": best_N, "g": best_g, "aux": best_aux, "multiplier": state["lam"]}


def constrained_adam(size: Callable, constraints: Callable, params, *, steps: int, lr: float, mu: float,
                     dual_every: int, tol: float, lr_floor: float = 0.05,
                     optimizer: Optional[optax.GradientTransformation] = None) -> dict:
    """Minimise ``size(params)`` subject to ``constraints(params) <= 0`` (module docstring), all
    ``steps`` in one scan: :func:`adam_start`, :func:`adam_steps`, :func:`adam_finish`.

    Args:
      size: params -> N (scalar), the normalised squared size of the edit.
      constraints: params -> (g, aux): g the constraint values (scalar or "float[J]"), aux a
        scalar recorded per step (e.g. the alignment reached).
      params: the initial pytree.
      optimizer: any optax transformation (default :func:`default_optimizer` of lr, steps, lr_floor).
    Returns :func:`adam_finish`'s dict with ``history_aux``, ``history_size`` ("float[steps]").
    """
    opt = default_optimizer(lr, steps, lr_floor) if optimizer is None else optimizer
    state = adam_start(constraints, params, opt)
    state, (hist_aux, hist_N) = adam_steps(size, constraints, state, 0, steps, optimizer=opt, mu=mu,
                                           dual_every=dual_every, tol=tol)
    return {**adam_finish(size, constraints, state, mu=mu, tol=tol), "history_aux": hist_aux, "history_size": hist_N}


# ------------------------------------------------------------------ the host loop

def map_targets(fn, split: int, shared: tuple, mapped: tuple, static: dict, mesh=None):
    """``fn(*shared[:split], *one, *shared[split:], **static)`` for every target ``one`` of
    ``mapped`` (a tuple of arrays with a leading target axis K): one compiled program, the
    targets split evenly over all devices (:func:`~powerlens._src.dynamics.execution.map_systems`:
    K padded to a multiple of the device count, the padding dropped), each device vmapping
    its share; ``shared`` is given whole to each device. ``mesh``: the devices' mesh (default:
    all devices)."""
    return map_systems(_per_target(fn, split, tuple(sorted(static.items()))), mapped, shared=shared,
                       devices=jax.device_count() if mesh is None else mesh, micro="all", check_vma=False)


@functools.lru_cache(maxsize=64)
def _per_target(fn, split: int, static_items):
    """``fn`` for one target, the problem's arrays shared: one function object per setting
    (map_systems keys its compiled programs by it)."""
    static = dict(static_items)
    return lambda shared, *one: fn(*shared[:split], *one, *shared[split:], **static)


CHUNK = 25
"""The most Adam steps per compiled call of :func:`solve_in_chunks` (progress is reported
between calls)."""


def chunk_length(steps: int, chunk: int = CHUNK) -> int:
    """The one length of every call of :func:`solve_in_chunks`: ``ceil(steps / calls)`` with
    ``calls = ceil(steps / chunk)``, so that the calls are as even as they can be (30 steps:
    2 x 15, not 25 + 5) and the last one masks fewer than ``calls`` steps."""
    calls = max(1, -(-int(steps) // int(chunk)))
    return -(-int(steps) // calls)


def solve_in_chunks(phases, shared: tuple, mapped: tuple, static: dict, *, steps: int, report=None,
                    chunk: int = CHUNK) -> dict:
    """Run a steering loop of ``steps`` Adam steps for K targets from the host, ``chunk`` steps
    per compiled call, each call sharded over the devices (:func:`map_targets`).

    ``phases`` = (start, advance, finish), called as ``start(*shared, *one)`` -> (ctx, state),
    ``advance(*shared, i0, stop, *one, ctx, state, n=n)`` -> (state, (aux "float[n]", size
    "float[n]")), steps i >= stop left undone (:func:`adam_steps`)
    and ``finish(*shared, *one, ctx, state, aux "float[steps]", size "float[steps]")`` -> the
    result's dict, each with ``**static`` (``one``: a target's slice of ``mapped``). The state
    carries everything the loop needs (parameters, the optimiser's state and step count,
    multipliers, the best iterate), so the numbers do not depend on ``chunk``. Every call has
    the same length (:func:`chunk_length`; the last one's extra steps masked), so the loop is
    three compiled programs whatever ``steps`` is; they have no host callbacks, so they go to
    the persistent compilation cache.

    ``report``: None, or ``report(i, ctx, state, aux)`` on the host after each call, i the
    number of steps done and aux "float[K n]" that call's per-step values (it waits for them).
    """
    start, advance, finish = phases
    n_shared = len(shared)
    mesh = execution.device_mesh(jax.device_count())      # one mesh for every call of the run
    ctx, state = map_targets(start, n_shared, shared, mapped, static, mesh)
    hist_aux, hist_size = [], []
    i, n, stop = 0, chunk_length(steps, chunk), jnp.asarray(steps, jnp.int32)
    while i < steps:
        state, (aux, size) = map_targets(advance, n_shared + 2, shared + (jnp.asarray(i, jnp.int32), stop),
                                         mapped + (ctx, state), {**static, "n": n}, mesh)
        done = min(n, steps - i)                            # the steps of this call that were taken
        aux, size = (aux, size) if done == n else (aux[:, :done], size[:, :done])
        hist_aux.append(aux)
        hist_size.append(size)
        i += done
        if report is not None:
            report(i, ctx, state, aux)
    cat = lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
    return map_targets(finish, n_shared, shared, mapped + (ctx, state, cat(hist_aux), cat(hist_size)), static, mesh)
