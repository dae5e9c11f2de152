"""``simulate``: the measured run of one prompt, a thin call of :func:`powerlens._src.dynamics.run`.

``simulate`` is written for one prompt x0 "float[n d]" and one system; batch prompts and
sweep systems with ``vmap`` (``simulate_batch`` does the former, validated and jitted).
It runs the one bundle of a measured run,
:func:`~powerlens._src.dynamics.observers.run_observers` (alignment, consensus, finite, final, and
states with ``save_states``), and packs its results into a :class:`Trajectory` (:func:`trajectory`).
Memory is O(T) scalars unless ``save_states`` keeps the "float[T+1 n d]" states.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from . import struct

from .inputs import check_batch, check_schedule, check_tokens  # noqa: F401  (check_tokens: public here too)
from .observers import rotation_planes, run_observers
from .options import Dynamics, as_dynamics
from .projections import prepared_projections
from .run import map_prompts, measure_after_pays, platform_of, prompt_chunk, run
from .subspaces import REFERENCES, Subspaces, reference_index
from jaxtyping import ArrayLike, Bool, Int, Real


@struct.dataclass
class Trajectory:
    """Measures of one run (T steps, m reference subspaces; a batch adds a leading axis).

    Attributes:
      gamma: "float[T m]" mean over valid tokens of gamma_i(x_{t+1}) against reference r of
        the layer applied at step t (NaN where that reference is undefined).
      gamma_before: "float[T m]" the same for x_t, the tokens entering the step.
      rho: "float[T m]" share of valid tokens with gamma_i(x_{t+1}) > gamma_i(x_t).
      rotation: "float[T]" mean angle step in the principal plane, in [-pi, pi) (NaN unless
        the principal subspace is a 2-D complex-pair plane).
      consensus, rank_collapse, pairwise_cos: "float[T+1]" of x_0 .. x_T (index 0: x0).
      finite: "bool[T+1]" whether every valid token of state t is finite and non-zero (a
        measure of a non-finite state is NaN: report the first False, never the numbers).
      n_valid: "int[]" number of valid tokens.
      final: "float[n d]" the last state x_T.
      states: "float[T+1 n d]" every state, when asked (``save_states``), else None.
      references: static names of the m references; read a reference by name with
        ``traj.gamma[..., traj.index("random")]``.
    """

    gamma: jax.Array
    gamma_before: jax.Array
    rho: jax.Array
    rotation: jax.Array
    consensus: jax.Array
    rank_collapse: jax.Array
    pairwise_cos: jax.Array
    finite: jax.Array
    n_valid: jax.Array
    final: jax.Array
    states: Optional[jax.Array] = None
    references: Tuple[str, ...] = struct.field(pytree_node=False, default=REFERENCES)

    def index(self, name: str) -> int:
        """Position of reference ``name`` on the last axis of gamma, gamma_before and rho."""
        return reference_index(self.references, name)


def simulate(layers, x0: Real[ArrayLike, "n d"], subspaces: Subspaces, *,
             valid: Bool[ArrayLike, "n"] | Int[ArrayLike, "n"] | None = None,
             dynamics: Optional[Dynamics] = None, save_states: bool = False,
             schedule: Int[ArrayLike, "T"] | None = None, positions: Int[ArrayLike, "n"] | None = None,
             projections=None, measure_after: bool = False,
             rule: Optional[str] = None, attention: Optional[str] = None, keep_bias: Optional[bool] = None,
             planes: Bool[ArrayLike, "U"] | None = None) -> Trajectory:
    """Iterate ``layers`` over its schedule from x0 and measure. Pure; jit/vmap it.

    Args:
      layers: :class:`~powerlens._src.dynamics.params.Layers` (its static schedule, or the
        ``schedule`` array given here, picks the unique layer of each step).
      x0: initial tokens "float[n d]".
      subspaces: reference subspaces, basis "float[U m d k]", dim "int[U m]".
      valid: "bool[n]", False for padding tokens (excluded from attention keys and
        from every measure).
      dynamics: the rule, attention mode and bias, a :class:`~powerlens._src.dynamics.options.Dynamics`
        (default ``Dynamics()``, the paper's rule); ``rule``, ``attention``, ``keep_bias``: deprecated.
      save_states: also return all states "float[T+1 n d]".
      projections: the (in, out) weight copies of ``layers``, when prepared (see :func:`~powerlens._src.dynamics.run`).
      measure_after: measure all states after the scan (same numbers; see :func:`~powerlens._src.dynamics.run`).
      planes: :func:`~powerlens._src.dynamics.observers.rotation_planes` of ``subspaces`` and ``layers``,
        when precomputed (else computed here).
    """
    if valid is None:
        valid = jnp.ones(x0.shape[:1], bool)
    dyn = as_dynamics(dynamics, rule, attention, keep_bias, where="simulate")
    out = run(layers, x0, valid, dynamics=dyn,
              observers=run_observers(subspaces, planes=planes, save_states=save_states),
              positions=positions, schedule=schedule, projections=projections, measure_after=measure_after)
    return trajectory(out, valid, subspaces.names)


def trajectory(out: dict, valid: Bool[ArrayLike, "*batch n"] | Int[ArrayLike, "*batch n"],
               references: Tuple[str, ...]) -> Trajectory:
    """The :class:`Trajectory` of the results ``out`` of
    :func:`~powerlens._src.dynamics.observers.run_observers` (one prompt, or a batch with a leading
    axis on every result and on ``valid``); ``states`` when ``out`` has them, else None."""
    a, c = out["alignment"], out["consensus"]
    return Trajectory(gamma=a.gamma, gamma_before=a.gamma_before, rho=a.rho, rotation=a.rotation,
                      consensus=c.consensus, rank_collapse=c.rank_collapse, pairwise_cos=c.pairwise_cos,
                      n_valid=jnp.sum(valid, axis=-1), final=out["final"], states=out.get("states"),
                      finite=out["finite"], references=references)


_STATIC = ("dynamics", "rule", "attention", "keep_bias", "save_states", "measure_after")
simulate_jit = jax.jit(simulate, static_argnames=_STATIC)


def _simulate_batch(layers, X0, subspaces, valid, positions, schedule, projections=None, planes=None, chunk=None,
                    *, dynamics, **kw):
    f = lambda x, v: simulate(layers, x, subspaces, valid=v, positions=positions, schedule=schedule,
                              projections=projections, planes=planes, dynamics=dynamics, **kw)
    return map_prompts(f, X0, valid, chunk)


simulate_batch_jit = jax.jit(_simulate_batch, static_argnames=("dynamics", "save_states", "measure_after", "chunk"))


def simulate_batch(layers, X0: Real[ArrayLike, "*B n d"], subspaces: Subspaces, *,
                   valid: Bool[ArrayLike, "*B n"] | Int[ArrayLike, "*B n"] | None = None,
                   dynamics: Optional[Dynamics] = None, save_states: bool = False,
                   schedule: Int[ArrayLike, "T"] | None = None, positions: Int[ArrayLike, "n"] | None = None,
                   check_finite: bool = True,
                   rule: Optional[str] = None, attention: Optional[str] = None,
                   keep_bias: Optional[bool] = None) -> Trajectory:
    """``simulate`` vmapped over a batch of prompts X0 "float[B n d]" with ``valid`` "bool[B n]"
    (on a CPU, short prompts in chunks: :func:`~powerlens._src.dynamics.run.prompt_chunk`): every
    field of the :class:`Trajectory` gets a leading axis B. ``dynamics``: as for :func:`simulate`.

    Validates the inputs (:func:`~powerlens._src.dynamics.inputs.check_batch`,
    :func:`~powerlens._src.dynamics.inputs.check_schedule`: one-line ValueErrors, never a cast or a
    clamp) and runs jit-compiled; small batches are measured after the scan
    (:func:`~powerlens._src.dynamics.run.measure_after_pays`).

    ``check_finite``: a state that is not finite (a value overflowed the system's dtype, e.g.
    the attention scores of tokens or weights too large for float32) is a ValueError naming
    the prompt and the step (:func:`check_trajectory`), never a silently NaN Trajectory. False
    returns the Trajectory as it is: its ``finite`` flags mark the bad states, and every
    measure of one is NaN.
    """
    dyn = as_dynamics(dynamics, rule, attention, keep_bias, where="simulate_batch").resolved(layers.config)
    X0, valid = check_batch(X0, valid, layers.config.d_model, dtype=layers.dtype)
    if schedule is not None:
        schedule = check_schedule(schedule, layers.n_unique)
    # weights held in another dtype than the compute dtype (bf16) are cast a layer at a time in
    # the scan: no (in, out) copies of every layer's attention weights
    proj = prepared_projections(layers, dyn.attention) if layers.dtype == layers.storage_dtype else None
    traj = simulate_batch_jit(layers, X0, subspaces, valid, positions,
                              schedule, proj, rotation_planes(subspaces, layers),
                              dynamics=dyn, save_states=save_states,
                              measure_after=measure_after_pays(layers, X0, schedule),
                              chunk=prompt_chunk(*np.shape(X0)[:2], platform_of(layers.W_v)))
    if check_finite:
        check_trajectory(traj, X0, valid, rule=dyn.rule)
    return traj


def check_trajectory(traj: Trajectory, X0: Real[ArrayLike, "B n d"], valid: Bool[ArrayLike, "B n"], *,
                     rule: str) -> None:
    """A one-line ValueError naming the first prompt and step whose state is not finite (or has
    a valid token collapsed to 0) in a batch Trajectory (``finite`` "bool[B T+1]"), or nothing.
    Step t counts from 1 (the state after step t; X0 is state 0)."""
    ok = np.asarray(traj.finite, bool)
    if ok.all():
        return
    b, t = (int(i) for i in np.argwhere(~ok)[0])
    dtype = np.dtype(traj.final.dtype).name
    top = float(np.max(np.abs(np.asarray(X0[b])[np.asarray(valid[b], bool)])))
    raise ValueError(f"the state of prompt {b} became non-finite at step {t} of {ok.shape[1] - 1} (rule {rule}, "
                     f"{dtype}): a value overflowed the {dtype} range (attention scores grow as the square of the "
                     f"tokens, whose largest |entry| in x0 is {top:.3g}), or a token collapsed to 0; rescale x0 or "
                     f"the weights or use float64 (check_finite=False returns the Trajectory, NaN from that step)")


def pooled(traj: Trajectory) -> dict:
    """Pool a batch Trajectory over prompts, weighting by valid tokens.

    Returns NumPy arrays: gamma, gamma_before, rho "float[T m]"; rho_count "int[T m]",
    n_tokens (int); the prompt-mean of consensus, rank_collapse, pairwise_cos
    "float[T+1]" and rotation "float[T]"; and finite "bool[T+1]" (every prompt's state finite).
    """
    w = np.asarray(traj.n_valid, np.float64)
    if w.ndim == 0:
        traj = jax.tree_util.tree_map(lambda a: a[None], traj)
        w = w[None]
    tot = w.sum()
    wm = lambda a: np.tensordot(w, np.asarray(a, np.float64), axes=(0, 0)) / tot
    rho = wm(traj.rho)
    return {
        "gamma": wm(traj.gamma), "gamma_before": wm(traj.gamma_before), "rho": rho,
        "rho_count": np.rint(np.nan_to_num(rho) * tot).astype(np.int64), "n_tokens": int(tot),
        "consensus": np.asarray(traj.consensus, np.float64).mean(0),
        "rank_collapse": np.asarray(traj.rank_collapse, np.float64).mean(0),
        "pairwise_cos": np.asarray(traj.pairwise_cos, np.float64).mean(0),
        "rotation": np.asarray(traj.rotation, np.float64).mean(0),
        "finite": np.asarray(traj.finite, bool).all(0),
    }
