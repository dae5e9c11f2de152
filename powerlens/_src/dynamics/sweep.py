"""Sweeps: many systems of the same shapes simulated in one compiled call.

    stack_systems([layers_1, ..., layers_S]) -> Layers with a leading system axis (S, U, ...)
    simulate_sweep(stacked, X0 "float[S n d]", subspaces (leading S)) -> Trajectory with leading S

``simulate_sweep`` runs through :func:`powerlens._src.dynamics.execution.map_systems`: the
systems split over the devices, and on a CPU in micro-batches of
:attr:`~powerlens._src.dynamics.execution.Tuning.micro_cpu` systems.

Each system runs :func:`~powerlens._src.dynamics.simulate.simulate`, i.e. the one scan of
:func:`~powerlens._src.dynamics.run`. The reference subspaces of each system come from its
spectrum (:func:`powerlens._src.analysis.spectra.sweep_subspaces`), stacked with
:func:`~powerlens._src.dynamics.subspaces.stack_subspaces`.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from .execution import map_systems
from .options import Dynamics, as_dynamics
from .params import Layers
from .simulate import Trajectory, simulate
from .subspaces import Subspaces


def stack_systems(systems: Sequence[Layers]) -> Layers:
    """Stack systems with identical static configs along a new leading axis."""
    if not systems:
        raise ValueError("no systems to stack")
    cfg = systems[0].config
    for i, s in enumerate(systems):
        if s.config != cfg:
            raise ValueError(f"system {i} has a different static config than system 0; sweeps need equal shapes")
    return _stack(*systems)


@jax.jit
def _stack(*trees):
    """The leaves of ``trees`` stacked along a new leading axis: one compiled program."""
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)


@functools.lru_cache(maxsize=32)
def _one(dynamics: Dynamics, save_states):
    """simulate for one system (layers, x0, subspaces, valid), the settings fixed (one function
    object per setting: it keys :func:`~powerlens._src.dynamics.execution.map_systems`'s program cache)."""
    return lambda lay, x, sub, v: simulate(lay, x, sub, valid=v, dynamics=dynamics, save_states=save_states)


def simulate_sweep(stacked: Layers, X0, subspaces: Subspaces, *, valid=None, dynamics: Optional[Dynamics] = None,
                   save_states: bool = False, shard: bool = True, rule: Optional[str] = None,
                   attention: Optional[str] = None, keep_bias: Optional[bool] = None) -> Trajectory:
    """Simulate S systems, one prompt X0[s] "float[n d]" each, in one compiled call.

    ``dynamics``: the rule, attention mode and bias of every system, a
    :class:`~powerlens._src.dynamics.options.Dynamics` (default ``Dynamics()``, the paper's rule);
    ``rule``, ``attention``, ``keep_bias``: deprecated.

    The systems are split evenly over the devices with ``shard_map`` (with ``shard``; GPUs,
    TPU cores, or CPU cores exposed as host devices with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax is imported), and
    on a CPU each device runs its share in micro-batches of
    :attr:`~powerlens._src.dynamics.execution.Tuning.micro_cpu` systems
    (:func:`~powerlens._src.dynamics.execution.map_systems`). S is padded to fit by repeating the
    last system (to whole micro-batches: a system's numbers do not depend on S); the padding
    is dropped from the returned :class:`Trajectory` (leading axis S).
    """
    dyn = as_dynamics(dynamics, rule, attention, keep_bias, where="simulate_sweep").resolved(stacked.config)
    X0 = jnp.asarray(X0, stacked.W_v.dtype)
    if X0.ndim != 3:
        raise ValueError(f"X0 must have shape (S, n, d), got {X0.shape}")
    if valid is None:
        valid = jnp.ones(X0.shape[:2], bool)
    return map_systems(_one(dyn, save_states), (stacked, X0, subspaces, jnp.asarray(valid)),
                       devices=jax.device_count() if shard else 1, micro="auto")
