"""Sweeps: many systems of the same shapes simulated in one ``jit(vmap(simulate))`` call.

    stack_systems([layers_1, ..., layers_S]) -> Layers with a leading system axis (S, U, ...)
    simulate_sweep(stacked, X0 "float[S n d]", subspaces (leading S)) -> Trajectory with leading S
    system_map(fn, mesh, micro) -> jit(shard_map(lax.map(vmap(fn)))) over a leading system axis

Each system runs :func:`~powerlens.dynamics.simulate.simulate`, i.e. the one scan of
:func:`~powerlens.dynamics.run`. The reference subspaces of each system come from its
spectrum (:func:`powerlens.analysis.spectra.sweep_subspaces`), stacked with
:func:`~powerlens.dynamics.subspaces.stack_subspaces`.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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


def _one(rule, attention, keep_bias, save_states):
    """simulate for one system (layers, x0, subspaces, valid), the settings fixed."""
    return lambda lay, x, sub, v: simulate(lay, x, sub, valid=v, rule=rule, attention=attention,
                                           keep_bias=keep_bias, save_states=save_states)


def _sweep(stacked, X0, subspaces, valid, *, rule, attention, keep_bias, save_states):
    return jax.vmap(_one(rule, attention, keep_bias, save_states))(stacked, X0, subspaces, valid)


_sweep_jit = jax.jit(_sweep, static_argnames=("rule", "attention", "keep_bias", "save_states"))


def system_map(fn: Callable, mesh, micro: Optional[int] = None) -> Callable:
    """``fn`` (one system's arrays -> outputs, pure) mapped over a leading system axis:
    ``jit(shard_map(per_device))`` with the systems split evenly over the 1-D ``mesh``
    (axis ``"systems"``), where each device runs ``vmap(fn)`` over its share, in
    ``lax.map`` steps of ``micro`` systems when given (a small batch stays in cache for
    all the steps of a scan: faster on CPUs), else all at once. The system count must be a
    multiple of ``mesh.size * micro`` (pad first).
    """
    from jax.sharding import PartitionSpec as P

    def local(*args):
        b = jax.tree_util.tree_leaves(args)[0].shape[0]
        if not micro or micro >= b:
            return jax.vmap(fn)(*args)
        split = lambda a: a.reshape((b // micro, micro) + a.shape[1:])
        out = jax.lax.map(lambda xs: jax.vmap(fn)(*xs), jax.tree_util.tree_map(split, args))
        return jax.tree_util.tree_map(lambda a: a.reshape((b,) + a.shape[2:]), out)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("systems"), out_specs=P("systems")))


@functools.lru_cache(maxsize=32)
def _sharded_sweep(ndev: int, rule, attention, keep_bias, save_states):
    """jit(shard_map(vmap(simulate))) over the first ``ndev`` devices, systems split evenly."""
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:ndev]), ("systems",))
    return mesh, system_map(_one(rule, attention, keep_bias, save_states), mesh)


def simulate_sweep(stacked: Layers, X0, subspaces: Subspaces, *, valid=None, rule: str = "paper",
                   attention: str = "softmax", keep_bias: Optional[bool] = None,
                   save_states: bool = False, shard: bool = True) -> Trajectory:
    """Simulate S systems, one prompt X0[s] "float[n d]" each, in one jit/vmap call.

    With several devices (GPUs, TPU cores, or CPU cores exposed as host devices with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax is imported) and
    ``shard``, the systems are split evenly over them with ``shard_map`` when S divides.
    """
    X0 = jnp.asarray(X0, stacked.W_v.dtype)
    if X0.ndim != 3:
        raise ValueError(f"X0 must have shape (S, n, d), got {X0.shape}")
    if valid is None:
        valid = jnp.ones(X0.shape[:2], bool)
    ndev = jax.device_count()
    if shard and ndev > 1 and X0.shape[0] % ndev == 0:
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh, run = _sharded_sweep(ndev, rule, attention, keep_bias, save_states)
        args = jax.device_put((stacked, X0, subspaces, jnp.asarray(valid)), NamedSharding(mesh, P("systems")))
        return run(*args)
    return _sweep_jit(stacked, X0, subspaces, valid, rule=rule, attention=attention, keep_bias=keep_bias,
                      save_states=save_states)
