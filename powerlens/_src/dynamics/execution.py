"""Execution over devices: one place for the mesh, the placement, the micro-batch and the
CPU tuning constants.

    device_mesh(devices, axis)               -> 1-D Mesh (the only place a mesh is built)
    mapped_sharding(mesh)                    -> NamedSharding splitting the leading axis (the only one)
    micro_size(setting, platform)            -> systems per vmap step, or None (the one choice)
    padded_size(systems, devices, micro)     -> the padded count
    pad_systems(tree, size)                  -> every leaf's leading axis padded (last system repeated)
    system_map(fn, mesh, micro, ...)         -> jit(shard_map(lax.map(vmap(fn)))) over a leading axis
    map_systems(fn, tree, *, devices, micro) -> fn over the leading axis of ``tree``: padded,
                                                sharded, micro-batched, the padding dropped
    model_mesh(model, data, devices)         -> 2-D Mesh ("data", "model"): one model over devices
    axis_sharding(mesh, ndim, axis, name)    -> NamedSharding splitting one axis over ``name``
    put(a, sharding)                         -> ``a`` placed with ``sharding`` (any process count)
    host_array(a)                            -> the whole of ``a`` as NumPy on every process

``map_systems`` is what :func:`powerlens._src.dynamics.sweep.simulate_sweep`, the sweep engine
(:mod:`powerlens._src.sweeps.engine`) and the steering optimiser
(:mod:`powerlens._src.steering.optimize`) run through. The count of mapped items (systems,
directions) never has to divide the device count: it is padded by repeating the last item,
whose results are dropped.

:data:`TUNING` (:class:`Tuning`) holds the constants that choose how work is batched on a
CPU; the measurements behind each are in docs/performance.md, under the constant's name.
:func:`backends_initialized` is the one place powerlens reads JAX's private state.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

AXIS = "systems"
"""The name of the mapped mesh axis."""


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How work is batched on a CPU (other platforms run one ``vmap``); each value was chosen
    by measurement: docs/performance.md, heading ``Tuning.<field>``."""

    micro_cpu: int = 8
    """Systems per vmap step on a CPU device: a micro-batch's weights stay in cache for all the
    steps of its scan (docs/performance.md, ``Tuning.micro_cpu``)."""
    chunk_tokens_cpu: int = 1024
    """Tokens per ``lax.map`` step of a batch of short prompts on a CPU: a chunk's activations
    stay in cache for the whole scan (docs/performance.md, ``Tuning.chunk_tokens_cpu``)."""
    measure_after_bytes: int = 2 ** 21
    """Measure after the scan while all prompts' states fit in this many bytes: fewer, larger
    kernels for small runs (docs/performance.md, ``Tuning.measure_after_bytes``)."""
    blocked_above: int = 256
    """Prompts longer than this many tokens go by query blocks: one dense block is faster up to
    here (docs/performance.md, ``Tuning.blocked_above``)."""
    query_block: int = 128
    """Queries per block above ``blocked_above`` tokens: the fastest block size measured
    (docs/performance.md, ``Tuning.query_block``)."""


TUNING = Tuning()
"""The tuning in use (read at trace time; replace it with ``dataclasses.replace`` to try others)."""


def backends_initialized() -> bool:
    """Whether this process's JAX backends have started (after which XLA's flags and thread
    pool are fixed). JAX has no public API for this: every public one
    (``jax.devices``, ``jax.extend.backend.backends``) starts the backends. Reads
    ``jax._src.xla_bridge.backends_are_initialized`` (checked on jax 0.10.2)."""
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())


# ------------------------------------------------------------------ mesh and placement

def device_mesh(devices: Union[None, int, str, Sequence] = None, axis: str = AXIS):
    """The 1-D mesh named ``axis`` over ``devices``: None (this process's devices,
    ``jax.local_devices()``), an int n (the first n of ``jax.devices()``), ``"global"`` (every
    process's devices, ``jax.make_mesh``) or a sequence of devices."""
    from jax.sharding import Mesh
    if isinstance(devices, str):
        if devices != "global":
            raise ValueError(f"devices {devices!r}: expected None, a count, 'global' or a list of devices")
        return jax.make_mesh((jax.device_count(),), (axis,))
    if devices is None:
        devices = jax.local_devices()
    elif isinstance(devices, (int, np.integer)):
        if not 1 <= devices <= jax.device_count():
            raise ValueError(f"devices {devices}: expected 1 .. {jax.device_count()} (the devices there are)")
        devices = jax.devices()[:int(devices)]
    return Mesh(np.array(list(devices)), (axis,))


def mapped_sharding(mesh):
    """The placement that splits an array's leading axis evenly over the 1-D ``mesh``."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(mesh, P(mesh.axis_names[0]))


def place(tree, mesh, *, spread: str = "local"):
    """``tree``'s leaves split over ``mesh`` along their leading axis (:func:`mapped_sharding`):
    ``"local"``: ``device_put`` from this process; ``"global"``: every process holds the whole
    (host) arrays and gives the shards of its own devices."""
    sharding = mapped_sharding(mesh)
    if spread == "local":
        return jax.device_put(tree, sharding)
    return jax.tree_util.tree_map(
        lambda a: jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx]), tree)


# ------------------------------------------------------------------ one model over devices

DATA, MODEL = "data", "model"
"""The axes of a model mesh (:func:`model_mesh`): prompts split over ``data``, each layer's
heads, FFN width and the vocabulary over ``model`` (``powerlens._src.models.shard``)."""


def model_mesh(model: Optional[int] = None, data: int = 1, devices: Union[None, str, Sequence] = None):
    """The 2-D mesh ``(data, model)`` with axes :data:`DATA` and :data:`MODEL` over ``devices``:
    None or ``"global"`` (every process's devices, ``jax.devices()``, laid out by
    ``jax.make_mesh``), ``"local"`` (this process's) or a sequence of devices. ``model``
    defaults to the device count over ``data``; ``data * model`` must equal the device count
    (a ValueError naming both otherwise). Neighbouring devices (one host, one NVLink island)
    share the ``model`` axis, whose collectives run once per layer."""
    if devices is None or isinstance(devices, str):
        if devices not in (None, "global", "local"):
            raise ValueError(f"devices {devices!r}: expected None, 'global', 'local' or a list of devices")
        devices = jax.local_devices() if devices == "local" else jax.devices()
    devices = list(devices)
    for name, v in (("data", data), ("model", model)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"model_mesh: {name}={v!r} must be a positive integer")
    data = int(data)
    model = len(devices) // data if model is None else int(model)
    if data * model != len(devices) or model < 1:
        raise ValueError(f"model_mesh: data={data} x model={model} must equal the {len(devices)} devices")
    from jax.sharding import AxisType, Mesh
    if len(devices) == jax.device_count() and devices == list(jax.devices()):
        try:     # Auto axes: XLA's partitioner places every intermediate (make_mesh's default is Explicit)
            return jax.make_mesh((data, model), (DATA, MODEL), (AxisType.Auto,) * 2, devices=devices)
        except (TypeError, ValueError, NotImplementedError):  # pragma: no cover - no topology-aware layout
            pass
    return Mesh(np.array(devices).reshape(data, model), (DATA, MODEL))


def axis_sharding(mesh, ndim: int, axis: Optional[int] = None, name: str = MODEL):
    """The placement of an ``ndim``-dimensional array on ``mesh``: axis ``axis`` split over the
    mesh axis ``name``, every other axis (all of them when ``axis`` is None) replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(mesh, P(*[name if i == axis else None for i in range(ndim)]))


def put(a, sharding):
    """``a`` (a NumPy or JAX array) placed with ``sharding``: ``jax.device_put`` when this process
    holds every device of it, else each process gives the shards of its own devices from its
    copy of ``a`` (``jax.make_array_from_callback``: every process must hold the same values,
    as every process of a multi-host load does). Waits for the copy, so the source of a large
    weight can be freed at once."""
    if sharding.is_fully_addressable:
        out = jax.device_put(a, sharding)
    else:
        host = a if isinstance(a, np.ndarray) else np.asarray(a)
        out = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    out.block_until_ready()
    return out


def host_array(a) -> np.ndarray:
    """The whole of ``a`` as a NumPy array, on every process: ``np.asarray`` when this process
    holds all of it (one host, or a replicated array), else gathered from every process
    (``multihost_utils.process_allgather``; every process must call it, as in any SPMD program).
    Across hosts, ``np.asarray`` of an array split over other hosts' devices is an error."""
    if not isinstance(a, jax.Array) or a.is_fully_addressable or a.is_fully_replicated:
        return np.asarray(a)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


# ------------------------------------------------------------------ micro-batches and padding

def micro_size(setting: Union[str, int, None] = "auto", platform: Optional[str] = None) -> Optional[int]:
    """Systems per vmap step: ``"auto"`` gives :attr:`Tuning.micro_cpu` on a CPU and None (the
    device's whole share in one vmap) elsewhere; ``"all"`` or None: None; an int m >= 1: m."""
    if setting == "auto":
        platform = jax.local_devices()[0].platform if platform is None else platform
        return TUNING.micro_cpu if platform == "cpu" else None
    if setting is None or setting == "all":
        return None
    if isinstance(setting, bool) or not isinstance(setting, (int, np.integer)) or setting < 1:
        raise ValueError(f"micro {setting!r}: expected 'auto', 'all' or a positive integer")
    return int(setting)


def padded_size(systems: int, devices: int, micro: Optional[int]) -> int:
    """The system count padded so that every device gets an equal share, a whole number of
    micro-batches when ``micro`` is given (every system is then computed by the same vmap
    width, whatever the count: XLA's rounding can depend on it)."""
    per = -(-systems // devices)
    return (-(-per // micro) * micro if micro else per) * devices


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


# ------------------------------------------------------------------ the mapped program

def system_map(fn: Callable, mesh, micro: Optional[int] = None, *, shared: bool = False,
               check_vma: bool = True) -> Callable:
    """``fn`` (one system's arrays -> outputs, pure) mapped over a leading axis:
    ``jit(shard_map(per_device))`` with the systems split evenly over the 1-D ``mesh``, where
    each device runs ``vmap(fn)`` over its share, in ``lax.map`` steps of ``micro`` systems
    when given (a small batch stays in cache for all the steps of a scan: faster on CPUs),
    else all at once. The system count must be a multiple of ``mesh.size * micro`` (pad
    first). ``shared``: the first argument is one pytree given whole to every system
    (replicated), ``fn(shared, *one_system)``."""
    from jax.sharding import PartitionSpec as P
    axis = mesh.axis_names[0]

    def batched(one, mapped):
        b = jax.tree_util.tree_leaves(mapped)[0].shape[0]
        if not micro or micro >= b:
            return jax.vmap(one)(*mapped)
        split = lambda a: a.reshape((b // micro, micro) + a.shape[1:])
        out = jax.lax.map(lambda xs: jax.vmap(one)(*xs), jax.tree_util.tree_map(split, mapped))
        return jax.tree_util.tree_map(lambda a: a.reshape((b,) + a.shape[2:]), out)

    if not shared:
        local = lambda *mapped: batched(fn, mapped)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=check_vma))
    local = lambda common, mapped: batched(lambda *xs: fn(common, *xs), mapped)
    split = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(axis), check_vma=check_vma)
    return jax.jit(lambda common, *mapped: split(common, mapped))


@functools.lru_cache(maxsize=64)
def _program(fn: Callable, mesh, micro: Optional[int], shared: bool, check_vma: bool) -> Callable:
    """The compiled :func:`system_map` of ``fn`` (kept per function, mesh and micro-batch:
    callers pass one function object per setting, so a program compiles once)."""
    return system_map(fn, mesh, micro, shared=shared, check_vma=check_vma)


def map_systems(fn: Callable, tree: Sequence, *, devices: Any = None, micro: Union[str, int, None] = "auto",
                shared: Any = None, size: Optional[int] = None, spread: str = "local", trim: bool = True,
                check_vma: bool = True):
    """``fn(*one)`` for every item of ``tree`` (a tuple of pytrees sharing a leading axis of S
    items), or ``fn(shared, *one)`` with ``shared`` given whole to every item: one compiled
    call, the items split evenly over ``devices`` (a Mesh, or what :func:`device_mesh` takes),
    each device vmapping its share in micro-batches of ``micro`` (:func:`micro_size`).

    S (or ``size`` when larger: a chunk's fixed size, so that every chunk runs one program)
    is padded to :func:`padded_size` by repeating the last item; with ``trim`` the padding
    is dropped from the outputs (leading axis S), else they keep the padded axis.
    ``spread``: how the inputs are placed (:func:`place`). ``fn`` must be the same object
    for the same program (it keys the compiled-program cache)."""
    from jax.sharding import Mesh
    mesh = devices if isinstance(devices, Mesh) else device_mesh(devices)
    tree = tuple(tree)
    S = int(np.shape(jax.tree_util.tree_leaves(tree)[0])[0])
    m = micro_size(micro, mesh.devices.flat[0].platform)
    total = padded_size(max(S, size or 0), mesh.size, m)
    args = place(pad_systems(tree, total), mesh, spread=spread) if mesh.size > 1 or spread != "local" \
        else pad_systems(tree, total)
    run = _program(fn, mesh, m, shared is not None, check_vma)
    out = run(shared, *args) if shared is not None else run(*args)
    if not trim or total == S:
        return out
    return jax.tree_util.tree_map(lambda a: a[:S], out)
