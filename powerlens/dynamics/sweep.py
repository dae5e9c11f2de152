"""Sweeps: many systems of the same shapes simulated in one compiled call.

    stack_systems([layers_1, ..., layers_S]) -> Layers with a leading system axis (S, U, ...)
    simulate_sweep(stacked, X0 "float[S n d]", subspaces (leading S)) -> Trajectory with leading S
    system_map(fn, mesh, micro) -> jit(shard_map(lax.map(vmap(fn)))) over a leading system axis

``simulate_sweep`` runs through ``system_map`` too: the systems split over the devices, and
on a CPU in micro-batches of :data:`MICRO_CPU` (:func:`micro_batch`).

Each system runs :func:`~powerlens.dynamics.simulate.simulate`, i.e. the one scan of
:func:`~powerlens.dynamics.run`. The reference subspaces of each system come from its
spectrum (:func:`powerlens.analysis.spectra.sweep_subspaces`), stacked with
:func:`~powerlens.dynamics.subspaces.stack_subspaces`.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Tuple

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


MICRO_CPU = 8
"""Systems per vmap step on a CPU device (:func:`system_map`'s ``micro``): a micro-batch's
weights stay in cache for all the steps of its scan. Measured with ``benchmarks/simulate.py``'s
sweep (256 systems, d = 64, n = 32, T = 200) on this project's 2-core CPU machine: one vmap
over all 256 took 2.4 s, micro-batches of 8 in ``lax.map`` 1.7 s on one device and 0.8-0.9 s
over the 2 cores as host devices; 16 was as fast as 8, 2 and 32 slower."""


def padded_size(systems: int, devices: int, micro: Optional[int]) -> int:
    """The system count padded so that every device gets an equal share, a whole number of
    micro-batches when ``micro`` is given (every system is then computed by the same vmap
    width, whatever the count: XLA's rounding can depend on it)."""
    per = -(-systems // devices)
    return (-(-per // micro) * micro if micro else per) * devices


def micro_batch(systems: int, devices: int, platform: str) -> Tuple[int, Optional[int]]:
    """(padded system count, micro-batch or None) for ``systems`` split evenly over ``devices``:
    on a CPU, micro-batches of :data:`MICRO_CPU` when a device's share is larger than one;
    elsewhere (and for small shares) one vmap over the share (:func:`padded_size`)."""
    micro = MICRO_CPU if platform == "cpu" and -(-systems // devices) > MICRO_CPU else None
    return padded_size(systems, devices, micro), micro


def pad_systems(tree, size: int):
    """Every leaf's leading (system) axis padded to ``size`` by repeating the last system: the
    padding runs real data (never a NaN) and is sliced off the results. NumPy leaves stay on
    the host (NumPy), the others become JAX arrays."""
    def pad(a):
        xp = np if isinstance(a, np.ndarray) else jnp
        a = xp.asarray(a)
        extra = size - a.shape[0]
        return xp.concatenate([a, xp.repeat(a[-1:], extra, axis=0)]) if extra > 0 else a
    return jax.tree_util.tree_map(pad, tree)


@functools.lru_cache(maxsize=32)
def _sweep_program(ndev: int, micro: Optional[int], rule, attention, keep_bias, save_states):
    """jit(shard_map(lax.map(vmap(simulate)))) over the first ``ndev`` devices."""
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:ndev]), ("systems",))
    return mesh, system_map(_one(rule, attention, keep_bias, save_states), mesh, micro)


def simulate_sweep(stacked: Layers, X0, subspaces: Subspaces, *, valid=None, rule: str = "paper",
                   attention: str = "softmax", keep_bias: Optional[bool] = None,
                   save_states: bool = False, shard: bool = True) -> Trajectory:
    """Simulate S systems, one prompt X0[s] "float[n d]" each, in one compiled call.

    The systems are split evenly over the devices with ``shard_map`` (with ``shard``; GPUs,
    TPU cores, or CPU cores exposed as host devices with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax is imported), and
    on a CPU each device runs its share in micro-batches of :data:`MICRO_CPU` systems
    (:func:`micro_batch`). S is padded to fit by repeating the last system; the padding is
    dropped from the returned :class:`Trajectory` (leading axis S).
    """
    X0 = jnp.asarray(X0, stacked.W_v.dtype)
    if X0.ndim != 3:
        raise ValueError(f"X0 must have shape (S, n, d), got {X0.shape}")
    S = X0.shape[0]
    if valid is None:
        valid = jnp.ones(X0.shape[:2], bool)
    ndev = jax.device_count() if shard else 1
    size, micro = micro_batch(S, ndev, jax.devices()[0].platform)
    mesh, run = _sweep_program(ndev, micro, rule, attention, keep_bias, save_states)
    args = pad_systems((stacked, X0, subspaces, jnp.asarray(valid)), size)
    if ndev > 1:
        from jax.sharding import NamedSharding, PartitionSpec as P
        args = jax.device_put(args, NamedSharding(mesh, P("systems")))
    out = run(*args)
    return out if size == S else jax.tree_util.tree_map(lambda a: a[:S], out)
