"""The sweep engine: every system of a spec through one compiled program per group.

    Engine(spec)                        -> checks everything, plans the chunks (nothing runs)
    engine.describe()                   -> what will run: systems, chunks, memory per chunk
    engine.run(store)                   -> SweepResult (the table on process 0)
    run_sweep(spec, store=...)          -> the same in one call

* Points are grouped by static shape (:mod:`powerlens._src.sweeps.grid`); each group runs in
  chunks, one call of ``jit(shard_map(lax.map(vmap(measure o build))))`` each
  (:func:`powerlens._src.dynamics.execution.map_systems`): the systems of a chunk are split over the
  devices (GPUs, TPU cores, or CPU cores exposed as host devices), each device vmaps over
  micro-batches of its share. Synthetic systems are built inside the program from their
  seeds; a model's or a custom builder's systems are built on the host and placed.
* Before anything is compiled the engine checks what it can: a model sweep's model, layers
  and prompts, a custom builder's first point; then :class:`~powerlens._src.sweeps.plan.Planner`
  sizes the chunks of every group from the memory model and the device facts, or refuses
  the sweep naming the key that makes it large (plain Python: :mod:`powerlens._src.sweeps.plan`).
  Every chunk of a group is padded to the same size: one compilation per group, and one for
  all the groups that differ only in an explicit spectrum (:func:`program_static`: its slots
  are an argument every system of a chunk shares, :func:`shared_input`;
  :attr:`Engine.programs` counts the compilations).
* Chunk j goes to process j mod N (``"local"`` mode: each process runs its chunks on its
  own devices); in ``"global"`` mode every chunk is sharded over the global mesh of all
  processes' devices. A finished chunk is reduced to its columns on the host and stored at
  once with its provenance (:mod:`powerlens._src.sweeps.provenance`: the spec's hash, its group
  and index, a checksum of its rows); a stored chunk is taken in only if all of these match
  (else it is recomputed, and the log says why). The next chunk is dispatched (and a new
  group compiled) before the previous one is reduced, so host work overlaps device work.
* The numbers of a system do not depend on the chunking, the process count or resumption:
  each device always runs the same micro-batch program.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

from ..analysis.budget import Estimate, available_bytes, format_bytes
from ..dynamics import execution
from ..dynamics.execution import map_systems, micro_size, padded_size
from . import columns, provenance
from .grid import DYNAMIC, EXPLICIT, Grid, Group, compiled_keys, explicit_slots, program_key, system_seeds
from .measures import measure
from .plan import Chunk, Devices, Planner, shapes_by_group, where
from .plan import Plan, chunk_estimate  # noqa: F401  (re-exported: engine.Plan, engine.chunk_estimate)
from .spec import Spec
from .store import jsonable, stored
from .systems import (Static, Systems, call_builder, check_model, concat, model_systems, spec_builder,
                      synthetic_builder, synthetic_systems)


@dataclasses.dataclass
class SweepResult:
    """What :func:`run_sweep` did. ``table`` is set on process 0 only (None elsewhere);
    ``non_finite`` counts its rows whose run went non-finite (their measures are null)."""

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
    non_finite: Optional[int] = None
    recomputed: int = 0


def static_of(spec: Spec, group: Group) -> Static:
    s = group.static
    return Static(d=s["d"], tokens=s["tokens"], heads=s["heads"], kind=s["kind"], spectrum=s["spectrum"],
                  init=s["init"], steps=s["steps"], attention=s["attention"], rule=s["rule"], order=s["order"],
                  keep_bias=s["keep_bias"], x64=s["x64"], series=tuple(spec.measure["series"]))


def _platform() -> str:
    return jax.local_devices()[0].platform


def _micro(spec: Spec) -> Optional[int]:
    """Systems per vmap step (None: the device's whole share at once)."""
    return micro_size(spec.run["micro_batch"], _platform())


def _device_memory() -> Optional[int]:
    """An accelerator's memory in bytes (None on a CPU: the host's memory is the limit)."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


HOST_BUILT = ("d", "tokens", "heads", "kind", "spectrum", "init")
"""Static keys that host-built systems (a model's, a builder's) bring with their arrays: they
key no program (nor does ``order``: the references are built on the host)."""


def program_static(st: Static, device_built: bool) -> Static:
    """What the compiled program of a group depends on: its static keys, with an explicit
    spectrum as :data:`~powerlens._src.sweeps.grid.EXPLICIT` (its slots are an argument,
    :func:`shared_input`); host-built systems bring their shapes with them, so only the
    dynamics' settings count."""
    if not device_built:
        return dataclasses.replace(st, **{k: None for k in HOST_BUILT}, order="shifted")
    return dataclasses.replace(st, spectrum=program_key("spectrum", st.spectrum))


def shared_input(st: Static, device_built: bool):
    """The argument every system of a chunk shares: an explicit spectrum's slots "float[d 2]"
    (None otherwise). Not batched over the systems, so that a row is computed exactly as in a
    program with its spectrum compiled in (the same operations on the same shapes)."""
    if not device_built or program_key("spectrum", st.spectrum) != EXPLICIT:
        return None
    return explicit_slots(st.spectrum, st.d, np.float64 if st.x64 else np.float32)


def _chunk_fn(st: Static, device_built: bool) -> Callable:
    """One system of a group -> its measures (one function object per compiled program,
    :func:`program_static`: it keys the compiled program of
    :func:`~powerlens._src.dynamics.execution.map_systems`); with an explicit spectrum it takes
    the slots first, ``fn(slots, seed, values)``."""
    return _measured(program_static(st, device_built), device_built)


@functools.lru_cache(maxsize=64)
def _measured(st: Static, device_built: bool) -> Callable:
    # the system is built inside each micro-batch (LAPACK-free, :mod:`powerlens._src.sweeps.linalg`),
    # so every device runs the same program on the same micro-batch shape
    if device_built and st.spectrum == EXPLICIT:
        return lambda slots, seed, p: measure(synthetic_systems(seed, {**p, "eigenvalues": slots}, st), st)
    if device_built:
        return lambda seed, p: measure(synthetic_systems(seed, p, st), st)
    return lambda sy: measure(sy, st)


class Engine:
    """Runs the chunks of one spec on this process (see the module docstring).

    Constructing it checks everything that can be checked before a chunk runs and plans the
    chunks (a ValueError naming the spec's key when refused); nothing is compiled and no
    file is written. ``log`` receives the one-line notes of a run (a stored chunk that does
    not match and is recomputed); default: standard error.
    """

    def __init__(self, spec: Spec, store=None, *, mode: str = "local", progress: bool = True, desc: str = "",
                 prefix: str = "", log: Optional[Callable[[str], None]] = None):
        if mode not in ("local", "global"):
            raise ValueError(f"unknown distribution mode {mode!r}; expected 'local' or 'global'")
        self.spec, self.store, self.mode = spec, store, mode
        self.progress, self.desc, self.prefix = progress, desc, prefix
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.grid = Grid(spec)
        self.groups = self.grid.groups()
        self.statics = [static_of(spec, g) for g in self.groups]
        self.rank, self.nproc = jax.process_index(), jax.process_count()
        self.mesh = execution.device_mesh("global" if mode == "global" else None)
        self.micro = _micro(spec)
        builder = spec.system.get("builder", "synthetic")
        self.device_built = spec.model is None and builder == "synthetic"
        self.build = model_systems if spec.model is not None else (
            None if self.device_built else spec_builder(spec))
        self._built: Dict[int, Systems] = {}       # host-built points kept from the checks, by point
        self.checkpoint = (provenance.checkpoint_identity(spec.model["name"], progress=progress)
                           if spec.model is not None else None)
        self.shapes = self._check_systems()
        self.planner = Planner(
            spec, self.groups, self.statics, shapes_by_group(self.statics, self.shapes),
            device_built=self.device_built, host=available_bytes(),
            devices=Devices(self.mesh.size, self.micro, _platform(), _device_memory()), pad=padded_size,
            width=len(self.grid.columns(np.zeros(1, np.int64))) + len(columns.MEASURED))
        self.plan = self.planner.plan()           # a ValueError naming the key when refused
        self.hash = provenance.spec_hash(spec, self.checkpoint, prefix)
        self._stale: Dict[str, str] = {}

    # ------------------------------------------------------------------ checks and plan

    def _check_systems(self) -> Optional[Dict[str, int]]:
        """The shapes of host-built systems (None for synthetic ones, whose group fixes them),
        after the checks that need the model or the builder: a model's layers and prompts, a
        builder's first point (its type, its rule)."""
        spec = self.spec
        if self.device_built:
            return None
        if spec.model is not None:
            return check_model(spec)
        with jax.enable_x64(self.statics[0].x64):       # in its group's precision, as when its chunk runs
            sy = self._built[0] = self._host_systems(np.array([0]))    # kept for that chunk
        cfg = sy.layers.config
        if "full" in {st.rule for st in self.statics} and (sy.layers.W_in is None or cfg.ffn_activation is None):
            raise ValueError(f"{where(spec, 'rule')}: \"full\" runs the model's own block, FFN included, and the "
                             f"systems of builder {spec.system['builder']!r} have none; use paper, post_ln or pre_ln")
        n, d = np.shape(sy.x0)[-2:]
        return {"d": int(d), "tokens": int(n), "heads": int(cfg.n_heads), "d_head": int(cfg.d_head),
                "kv_heads": int(cfg.n_kv_heads)}

    def _shapes(self, st: Static) -> Dict[str, int]:
        """The shapes of the systems of the group of ``st`` (:func:`~powerlens._src.sweeps.plan.shapes_by_group`)."""
        return shapes_by_group([st], self.shapes)[0]

    def estimate(self, group: int, systems: int) -> Estimate:
        """The memory of a chunk of ``systems`` systems of ``group``, padded as it will run
        (:func:`~powerlens._src.sweeps.plan.chunk_estimate`)."""
        return self.planner.estimate(group, systems)

    def describe(self) -> str:
        """What will run, in one line: systems, groups (one compilation each) and the grid keys
        that split them, chunks, memory per chunk."""
        spec, plan = self.spec, self.plan
        per = (f"{len(spec.model['prompts'])} prompts" if spec.model is not None
               else f"{self.grid.replicates} replicates")
        biggest = max(range(len(plan.groups)), key=lambda g: plan.estimates[g].total)
        return (f"{self.grid.n_systems:,} systems ({self.grid.n_points:,} points x {per}) in {len(self.groups)} "
                f"group{'s' * (len(self.groups) != 1)}, {len(plan):,} chunk{'s' * (len(plan) != 1)} of up to "
                f"{max(plan.sizes):,} systems, about {format_bytes(plan.estimates[biggest].total)} per chunk "
                f"({format_bytes(plan.limit)} available) on {self.mesh.size} {_platform()} "
                f"device{'s' * (self.mesh.size != 1)}; {self.splits()}")

    @property
    def programs(self) -> int:
        """How many programs the sweep compiles: one per distinct :func:`program_static` and
        chunk size (the groups of every explicit spectrum share one)."""
        return len({(program_static(st, self.device_built), size) for st, size in zip(self.statics, self.plan.sizes)})

    def splits(self) -> str:
        """The compilations and the grid keys that split them, e.g. ``4 compilations (by heads;
        explicit spectra are dynamic values)``."""
        keys = [k for k in compiled_keys(self.grid.axes) if self.device_built or k not in HOST_BUILT + ("order",)]
        notes = [f"by {' x '.join(keys)}"] if keys else []
        if self.device_built and "spectrum" in self.grid.axes and any(
                program_key("spectrum", st.spectrum) == EXPLICIT for st in self.statics):
            notes.append("explicit spectra are dynamic values")
        n = self.programs
        return f"{n} compilation{'s' * (n != 1)}" + (f" ({'; '.join(notes)})" if notes else "")

    # ------------------------------------------------------------------ inputs

    def _inputs(self, chunk: Chunk):
        """(global ids, program inputs (host arrays, unpadded), host facts): the host facts are
        the float64 lam/dim/v1 of host-built systems (kept off the device)."""
        group, st = self.groups[chunk.group], self.statics[chunk.group]
        ids = group.systems(chunk.start, chunk.stop)
        R = self.grid.replicates
        if self.device_built:
            inputs, facts = self._seeds_and_values(ids, st), {}
        else:
            sy = self._host_systems(ids[::R] // R)
            facts = {"lam": np.asarray(sy.lam), "dim": np.asarray(sy.dim), "v1": np.asarray(sy.v1)}
            inputs = (sy.replace(lam=None, dim=None, v1=None),)
        return ids, jax.tree_util.tree_map(np.asarray, inputs), facts

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
            if p in self._built:                    # built by the checks
                batches.append(self._built.pop(p))
                continue
            point = {**self.spec.system, **self.spec.run,
                     **{k: self.grid.values(k, [p])[0] for k in self.grid.axes}, "point": p}
            seeds = system_seeds(self.spec.seed, np.full(R, p), np.arange(R))
            if self.spec.model is not None:
                batches.append(self.build(point, seeds, self.spec))
            else:
                batches.append(call_builder(self.build, point, seeds, self.spec))
        return concat(batches)

    def systems_of(self, ids) -> Systems:
        """The systems with global ids ``ids`` (one group), as host arrays: exactly what their
        rows were computed from (synthetic ones are rebuilt from their seeds)."""
        ids = np.asarray(ids, np.int64)
        R = self.grid.replicates
        group = next(g for g in self.groups if g.contains(ids[:1] // R)[0])
        if not group.contains(ids // R).all():
            raise ValueError("systems_of: the systems must belong to one group (equal static keys)")
        st = self.statics[group.index]
        with jax.enable_x64(st.x64):
            if not self.device_built:
                sy = self._host_systems(np.unique(ids // R))
                pos = np.searchsorted(np.unique(ids // R), ids // R) * R + ids % R
                return jax.tree_util.tree_map(lambda a: np.asarray(a)[pos], sy)
            build = synthetic_builder(program_static(st, True).synthetic)
            sy, _ = build(shared_input(st, True), *self._seeds_and_values(ids, st))
            return jax.tree_util.tree_map(np.asarray, sy)

    def _gather(self, out):
        if self.mode == "local":
            return jax.device_get(out)
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(out, tiled=True)

    # ------------------------------------------------------------------ stored chunks

    def mismatch(self, chunk: Chunk, value) -> Optional[str]:
        """Why a stored ``value`` is not chunk ``chunk`` of this sweep (None: it is):
        :func:`powerlens._src.sweeps.provenance.mismatch` with this sweep's spec hash, the chunk's
        systems and the columns its rows have."""
        ids = self.groups[chunk.group].systems(chunk.start, chunk.stop)
        return provenance.mismatch(
            value, spec=self.hash, chunk=chunk, ids=ids.tolist(), measured=columns.MEASURED,
            made=set(self.grid.columns(ids[:1])) | set(columns.MEASURED),          # every chunk's columns ...
            series={columns.series_column(k) for k in self.statics[chunk.group].series})   # ... and these

    def load(self, chunk: Chunk):
        """The stored chunk if it matches this sweep, else None (noting why: it is recomputed)."""
        if self.store is None:
            return None
        name = self.prefix + chunk.name
        value = stored(self.store, name)
        if value is None:                           # absent (or a stored null: noted when it is replaced)
            return None
        why = self.mismatch(chunk, value)
        if why is None:
            return value
        self._stale[name] = why
        self.log(f"powerlens sweep: stored chunk {name} {why}; recomputing it")
        return None

    # ------------------------------------------------------------------ one chunk

    def launch(self, chunk: Chunk):
        """Dispatch a chunk (asynchronously): (chunk, ids, device outputs)."""
        st = self.statics[chunk.group]
        with jax.enable_x64(st.x64):                 # host builders make their arrays in the group's precision
            ids, inputs, facts = self._inputs(chunk)
            # padded to the chunk's size (every chunk of a group runs one program), kept padded
            shared = shared_input(st, self.device_built)
            if shared is not None and self.mode == "global":      # replicated over every process's devices
                shared = execution.put(shared, execution.axis_sharding(self.mesh, np.ndim(shared)))
            out = map_systems(_chunk_fn(st, self.device_built), inputs, devices=self.mesh, micro=self.micro,
                              size=chunk.size, spread=self.mode, trim=False, shared=shared)
        return chunk, ids, out, facts

    def finish(self, launched) -> dict:
        """Wait for a dispatched chunk, reduce it to columns and store it with its provenance
        (its owner only)."""
        chunk, ids, out, facts = launched
        st = self.statics[chunk.group]
        with jax.enable_x64(st.x64):
            raw = jax.tree_util.tree_map(lambda a: np.asarray(a)[: chunk.n], self._gather(out))
        raw.update(facts)
        eps = float(np.finfo(np.float64 if st.x64 else np.float32).eps)
        cols = columns.reduce(raw, self.spec.measure, eps, st.series)
        rows = jsonable({"system": ids.tolist(), "columns": {**self.grid.columns(ids), **cols}})
        value = provenance.stamp(rows, self.hash, chunk)
        if self.mode == "local" or self.rank == 0:
            name = self.prefix + chunk.name
            if name not in self._stale:
                kept = self.store.cached(name, lambda: value)
                why = self.mismatch(chunk, kept)
                if why is None:
                    return kept
                self._stale[name] = why                  # a stored null: cached() returned it
                self.log(f"powerlens sweep: stored chunk {name} {why}; recomputed it")
            value = self.store.replace(name, value)
        return value

    # ------------------------------------------------------------------ the whole sweep

    def mine(self) -> List[Chunk]:
        if self.mode == "global":
            return list(self.plan)
        return self.plan.of_process(self.rank, self.nproc)

    def run(self, store=None) -> SweepResult:
        """Every chunk of this process (matching stored ones loaded), a barrier, the merge on
        process 0 (which computes any chunk still missing or not matching)."""
        from tqdm.auto import tqdm
        self.store = store if store is not None else self.store
        t0 = time.time()
        mine = self.mine()
        values = {c.name: self.load(c) for c in mine}
        todo = [c for c in mine if values[c.name] is None]
        total = sum(c.n for c in mine)
        bar = tqdm(total=total, initial=total - sum(c.n for c in todo), unit=" systems", unit_scale=True,
                   desc=self.desc or self.spec.name, disable=not self.progress, leave=True, dynamic_ncols=True)
        t1 = time.time()
        self._compute(todo, values, bar.update)
        bar.close()
        compute = time.time() - t1
        barrier("powerlens-sweep-done")
        table, late = None, []
        if self.rank == 0:
            for c in self.plan:                         # the other processes' chunks
                if values.get(c.name) is None:
                    values[c.name] = self.load(c)
                    if values[c.name] is None:
                        late.append(c)
            if late:
                if self.mode == "global":
                    raise ValueError(f"chunk {late[0].name} of the sweep is missing: run the sweep again to resume")
                self._compute(late, values, lambda n: None)
            table = columns.to_frame([values[c.name] for c in self.plan])
        groups = [{"static": g.static, "systems": g.n_systems, "chunks": self.plan.counts[g.index]}
                  for g in self.groups]
        done = todo + late
        return SweepResult(table=table, chunks=len(self.plan), computed=len(done),
                           resumed=len(mine) - len(todo), systems_computed=sum(c.n for c in done),
                           seconds=time.time() - t0, compute_seconds=compute,
                           devices=[str(d) for d in jax.devices()], processes=self.nproc, groups=groups,
                           non_finite=None if table is None else int((~table["finite"]).sum()),
                           recomputed=len(self._stale))

    def _compute(self, chunks: List[Chunk], values: dict, update: Callable[[int], Any]) -> None:
        """Compute ``chunks`` into ``values``: launch chunk k+1, then reduce chunk k."""
        pending = None
        for c in list(chunks) + [None]:
            launched = None if c is None else self.launch(c)
            if pending is not None:
                values[pending[0].name] = self.finish(pending)
                update(pending[0].n)
            pending = launched


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
