"""The sweep engine: every system of a spec through one compiled program per group.

    plan_chunks(spec, groups)           -> chunks: (group, index, systems [start, stop))
    run_sweep(spec, store=...)          -> SweepResult (the table on process 0)

* Points are grouped by static shape (:mod:`powerlens.sweeps.grid`); each group runs in
  chunks, one call of ``jit(shard_map(lax.map(vmap(measure o build))))`` each
  (:func:`powerlens.dynamics.sweep.system_map`): the systems of a chunk are split over the
  devices (GPUs, TPU cores, or CPU cores exposed as host devices), each device vmaps over
  micro-batches of its share. Synthetic systems are built inside the program from their
  seeds; a model's or a custom builder's systems are built on the host and placed.
* The chunk size comes from a memory estimate per system (:func:`bytes_per_system`)
  against the device's memory (a fixed budget on CPUs), capped so that progress and
  resumption stay fine-grained, and balanced so that the last chunk is not mostly padding.
  Every chunk of a group is padded to the same size: one compilation per group.
* Chunk j goes to process j mod N (``"local"`` mode: each process runs its chunks on its
  own devices); in ``"global"`` mode every chunk is sharded over the global mesh of all
  processes' devices. A finished chunk is reduced to its columns on the host and stored
  at once; a chunk already in the store is never recomputed. The next chunk is dispatched
  (and a new group compiled) before the previous one is reduced, so host work overlaps
  device work.
* The numbers of a system do not depend on the chunking, the process count or resumption:
  each device always runs the same micro-batch program.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Dict, List, Optional

import jax
import numpy as np

from ..dynamics.sweep import MICRO_CPU, pad_systems, padded_size, system_map
from . import columns
from .grid import DYNAMIC, Grid, Group, system_seeds
from .measures import measure
from .spec import Spec
from .systems import Static, Systems, concat, host_builder, model_systems, synthetic

CPU_BUDGET = 1 << 30           # bytes per CPU device for one chunk
MAX_CHUNK = {"cpu": 1024}      # systems per chunk at most (accelerators: 16384)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Systems [start, stop) of group ``group`` (its own numbering), padded to ``size``."""

    group: int
    index: int
    start: int
    stop: int
    size: int

    @property
    def name(self) -> str:
        return f"g{self.group:03d}-c{self.index:06d}"

    @property
    def n(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass
class SweepResult:
    """What :func:`run_sweep` did. ``table`` is set on process 0 only (None elsewhere)."""

    table: Any
    chunks: int
    computed: int
    resumed: int
    systems_computed: int
    seconds: float
    compute_seconds: float
    devices: List[str]
    processes: int
    groups: List[dict]


def static_of(spec: Spec, group: Group) -> Static:
    s = group.static
    return Static(d=s["d"], tokens=s["tokens"], heads=s["heads"], kind=s["kind"], spectrum=s["spectrum"],
                  init=s["init"], steps=s["steps"], attention=s["attention"], rule=s["rule"], order=s["order"],
                  keep_bias=s["keep_bias"], x64=s["x64"], series=tuple(spec.measure["series"]))


def bytes_per_system(st: Static, d: int, n: int, heads: int, micro: int) -> Dict[str, int]:
    """Rough bytes of one system: ``held`` (its parameters, the build's d x d temporaries,
    inputs and outputs: alive for the whole chunk) and ``working`` (the scan's stacked
    outputs and one step's temporaries, alive for one micro-batch)."""
    T, item, m = st.steps, (8 if st.x64 else 4), 3
    held = 12 * d * d + 2 * n * d + 4 * d * 4 + 6 * (T + 1) + 2 * n * d
    if "plane_angle" in st.series:
        held += (T + 1) * n
    working = (3 * m + 8) * (T + 1) + heads * n * n * 4 + 3 * n * d * 6
    return {"held": held * item, "working": working * item * micro}


def _platform() -> str:
    return jax.local_devices()[0].platform


def _micro(spec: Spec) -> Optional[int]:
    """Systems per vmap step (None: the device's whole share at once)."""
    m = spec.run["micro_batch"]
    if m == "auto":
        return MICRO_CPU if _platform() == "cpu" else None
    return None if m == "all" else int(m)


def _budget() -> int:
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(0.4 * stats["bytes_limit"])
    return CPU_BUDGET


def chunk_size(spec: Spec, group: Group, st: Static) -> int:
    """Systems per chunk for ``group``: the spec's ``chunk_size``, else what the memory estimate
    allows (at most :data:`MAX_CHUNK`), balanced over the group and rounded to the micro-batch;
    whole points for host-built systems."""
    G = group.n_systems
    R = group.replicates
    host = spec.model is not None or spec.system.get("builder", "synthetic") != "synthetic"
    micro = _micro(spec) or 1
    if spec.run["chunk_size"]:
        size = spec.run["chunk_size"]
    else:
        d, n, heads = st.d or 64, st.tokens or 64, st.heads or 1
        b = bytes_per_system(st, d, n, heads, micro)
        cap = MAX_CHUNK.get(_platform(), 16384)
        size = max(1, min(cap, (_budget() - b["working"]) // max(b["held"], 1)))
        n_chunks = math.ceil(G / size)
        size = math.ceil(G / n_chunks)
        if size > micro:
            size = math.ceil(size / micro) * micro
    if host:
        size = max(R, size // R * R)
    return min(size, G)


def plan_chunks(spec: Spec, groups: List[Group]) -> List[Chunk]:
    """Every chunk of the sweep, group after group (the same list on every process)."""
    out = []
    for g in groups:
        size = chunk_size(spec, g, static_of(spec, g))
        for k, start in enumerate(range(0, g.n_systems, size)):
            out.append(Chunk(g.index, k, start, min(start + size, g.n_systems), size))
    return out


class _Missing(Exception):
    """Raised by the compute function that only asks a store whether it has a chunk."""


def _missing():
    raise _Missing


def stored(store, name: str):
    """The chunk ``name`` from ``store``, or None (stores expose only ``cached``)."""
    try:
        return store.cached(name, _missing)
    except _Missing:
        return None


def _program(st: Static, device_built: bool, mesh, micro: Optional[int]):
    """The compiled chunk program of a group (one per static config, mesh and micro-batch);
    host-built systems bring their shapes with them, so only the dynamics' settings count."""
    if not device_built:
        st = dataclasses.replace(st, d=None, tokens=None, heads=None, kind=None, spectrum=None, init=None,
                                 order="shifted")
    return _compiled(st, device_built, mesh, micro)


@functools.lru_cache(maxsize=64)
def _compiled(st: Static, device_built: bool, mesh, micro: Optional[int]):
    # the system is built inside each micro-batch (LAPACK-free, :mod:`powerlens.sweeps.linalg`),
    # so every device runs the same program on the same micro-batch shape
    if device_built:
        fn = lambda seed, p: measure(synthetic(seed, p, st), st)
    else:
        fn = lambda sy: measure(sy, st)
    return system_map(fn, mesh, micro)


class Engine:
    """Runs the chunks of one spec on this process (see the module docstring)."""

    def __init__(self, spec: Spec, store, *, mode: str = "local", progress: bool = True, desc: str = "",
                 prefix: str = ""):
        if mode not in ("local", "global"):
            raise ValueError(f"unknown distribution mode {mode!r}; expected 'local' or 'global'")
        self.spec, self.store, self.mode = spec, store, mode
        self.grid = Grid(spec)
        self.groups = self.grid.groups()
        self.statics = [static_of(spec, g) for g in self.groups]
        self.chunks = plan_chunks(spec, self.groups)
        self.rank, self.nproc = jax.process_index(), jax.process_count()
        from jax.sharding import Mesh
        if mode == "global":
            self.mesh = jax.make_mesh((jax.device_count(),), ("systems",))
        else:
            self.mesh = Mesh(np.array(jax.local_devices()), ("systems",))
        self.micro = _micro(spec)
        self.progress, self.desc, self.prefix = progress, desc, prefix
        builder = spec.system.get("builder", "synthetic")
        self.device_built = spec.model is None and builder == "synthetic"
        self.build = model_systems if spec.model is not None else (
            None if self.device_built else host_builder(builder))

    # ------------------------------------------------------------------ inputs

    def _inputs(self, chunk: Chunk):
        """(global ids, program inputs padded to the chunk size, micro-batch, host facts): the
        host facts are the float64 lam/dim/v1 of host-built systems (kept off the device)."""
        group, st = self.groups[chunk.group], self.statics[chunk.group]
        ids = group.systems(chunk.start, chunk.stop)
        R = self.grid.replicates
        size, micro = padded_size(chunk.size, self.mesh.size, self.micro), self.micro
        if self.device_built:
            inputs, facts = self._seeds_and_values(ids, st), {}
        else:
            sy = self._host_systems(ids[::R] // R)
            facts = {"lam": np.asarray(sy.lam), "dim": np.asarray(sy.dim), "v1": np.asarray(sy.v1)}
            inputs = (sy.replace(lam=None, dim=None, v1=None),)
        return ids, pad_systems(jax.tree_util.tree_map(np.asarray, inputs), size), micro, facts

    def _seeds_and_values(self, ids, st: Static):
        """What a synthetic system is built from: its seed "int32[S]" and dynamic values."""
        R, dt = self.grid.replicates, (np.float64 if st.x64 else np.float32)
        seeds = system_seeds(self.spec.seed, ids // R, ids % R).astype(np.int32)
        return seeds, {k: self.grid.array(k, ids // R, dt) for k in DYNAMIC}

    def _host_systems(self, points) -> Systems:
        """The host-built systems of whole points (the builder is called once per point)."""
        R = self.grid.replicates
        batches = []
        for p in points.tolist():
            point = {**self.spec.system, **self.spec.run,
                     **{k: self.grid.values(k, [p])[0] for k in self.grid.axes}, "point": p}
            seeds = system_seeds(self.spec.seed, np.full(R, p), np.arange(R))
            batches.append(self.build(point, seeds, self.spec))
        return concat(batches)

    def systems_of(self, ids) -> Systems:
        """The systems with global ids ``ids`` (one group), as host arrays: exactly what their
        rows were computed from (synthetic ones are rebuilt from their seeds)."""
        ids = np.asarray(ids, np.int64)
        R = self.grid.replicates
        group = next(g for g in self.groups if np.isin(ids[0] // R, g.points))
        if not np.isin(ids // R, group.points).all():
            raise ValueError("systems_of: the systems must belong to one group (equal static keys)")
        st = self.statics[group.index]
        with jax.enable_x64(st.x64):
            if not self.device_built:
                sy = self._host_systems(np.unique(ids // R))
                pos = np.searchsorted(np.unique(ids // R), ids // R) * R + ids % R
                return jax.tree_util.tree_map(lambda a: np.asarray(a)[pos], sy)
            build = jax.jit(jax.vmap(lambda seed, q: synthetic(seed, q, st)))
            return jax.tree_util.tree_map(np.asarray, build(*self._seeds_and_values(ids, st)))

    def _place(self, tree):
        from jax.sharding import NamedSharding, PartitionSpec as P
        sharding = NamedSharding(self.mesh, P("systems"))
        if self.mode == "local":
            return jax.device_put(tree, sharding)
        return jax.tree_util.tree_map(
            lambda a: jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx]), tree)

    def _gather(self, out):
        if self.mode == "local":
            return jax.device_get(out)
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(out, tiled=True)

    # ------------------------------------------------------------------ one chunk

    def launch(self, chunk: Chunk):
        """Dispatch a chunk (asynchronously): (chunk, ids, device outputs)."""
        st = self.statics[chunk.group]
        with jax.enable_x64(st.x64):                 # host builders make their arrays in the group's precision
            ids, inputs, micro, facts = self._inputs(chunk)
            run = _program(st, self.device_built, self.mesh, micro)
            out = run(*self._place(inputs))
        return chunk, ids, out, facts

    def finish(self, launched) -> dict:
        """Wait for a dispatched chunk, reduce it to columns and store it (its owner only)."""
        chunk, ids, out, facts = launched
        st = self.statics[chunk.group]
        with jax.enable_x64(st.x64):
            raw = jax.tree_util.tree_map(lambda a: np.asarray(a)[: chunk.n], self._gather(out))
        raw.update(facts)
        eps = float(np.finfo(np.float64 if st.x64 else np.float32).eps)
        cols = columns.reduce(raw, self.spec.measure, eps, st.series)
        value = {"system": ids.tolist(), "columns": {**self.grid.columns(ids), **cols}}
        if self.mode == "local" or self.rank == 0:
            value = self.store.cached(self.prefix + chunk.name, lambda: value)
        return value

    # ------------------------------------------------------------------ the whole sweep

    def mine(self) -> List[Chunk]:
        if self.mode == "global":
            return list(self.chunks)
        return [c for j, c in enumerate(self.chunks) if j % self.nproc == self.rank]

    def run(self) -> SweepResult:
        """Every chunk of this process (resumed ones loaded), a barrier, the merge on process 0."""
        from tqdm.auto import tqdm
        t0 = time.time()
        mine = self.mine()
        values = {c.name: stored(self.store, self.prefix + c.name) for c in mine}
        todo = [c for c in mine if values[c.name] is None]
        total = sum(c.n for c in mine)
        bar = tqdm(total=total, initial=total - sum(c.n for c in todo), unit=" systems", unit_scale=True,
                   desc=self.desc or self.spec.name, disable=not self.progress, leave=True, dynamic_ncols=True)
        t1 = time.time()
        pending = None
        for c in todo + [None]:                       # launch chunk k+1, then reduce chunk k
            launched = None if c is None else self.launch(c)
            if pending is not None:
                values[pending[0].name] = self.finish(pending)
                bar.update(pending[0].n)
            pending = launched
        bar.close()
        compute = time.time() - t1
        barrier("powerlens-sweep-done")
        table = None
        if self.rank == 0:
            for c in self.chunks:                      # the other processes' chunks
                if values.get(c.name) is None:
                    values[c.name] = stored(self.store, self.prefix + c.name)
                if values[c.name] is None:
                    raise ValueError(f"chunk {c.name} of the sweep is missing: a process did not finish it "
                                     f"(run the sweep again to resume)")
            table = columns.to_frame([values[c.name] for c in self.chunks])
        groups = [{"static": g.static, "systems": g.n_systems,
                   "chunks": sum(1 for c in self.chunks if c.group == g.index)} for g in self.groups]
        return SweepResult(table=table, chunks=len(self.chunks), computed=len(todo), resumed=len(mine) - len(todo),
                           systems_computed=sum(c.n for c in todo), seconds=time.time() - t0,
                           compute_seconds=compute, devices=[str(d) for d in jax.devices()],
                           processes=self.nproc, groups=groups)


def barrier(name: str) -> None:
    """All processes wait here (a no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def run_sweep(spec: Spec, store, *, mode: str = "local", progress: bool = True, desc: str = "",
              prefix: str = "") -> SweepResult:
    """Run (or resume) every chunk of ``spec`` into ``store`` (see the module docstring);
    chunks are stored as ``prefix + "gGGG-cCCCCCC"``."""
    return Engine(spec, store, mode=mode, progress=progress, desc=desc, prefix=prefix).run()
