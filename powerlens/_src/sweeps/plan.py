"""The plan of a sweep: what one chunk costs in memory, how many systems each chunk holds,
and why a sweep is refused. Plain Python over plain values: no JAX (the engine passes in the
device facts, :class:`Devices`, and the bytes the host has).

    chunk_estimate(st, shapes, systems, width)   -> Estimate     the memory model of one chunk
    Planner(spec, groups, statics, shapes, ...)  .plan() -> Plan  chunk sizes, or a refusal
    Plan                                         every chunk as index arithmetic (no list)

* The memory of a chunk (:func:`chunk_estimate`) is the parts of ``simulate``'s own estimate
  (:func:`powerlens._src.analysis.budget.run_estimate`) plus the sweep's: it is affine in the
  systems S and in the vmap width A (the systems run at once over every device).
* The chunk size of a group (:meth:`Planner.chunk_size`) is the spec's ``chunk_size``, else
  the most systems that fit the budget (``min(budget of a device x devices, host)``; a
  device's budget is 40 % of an accelerator's memory, :data:`CPU_BUDGET` on a CPU), at most
  :data:`MAX_CHUNK` (fine-grained progress and resumption), balanced over the group (the last
  chunk is not mostly padding) and rounded to the micro-batch; whole points for host-built
  systems (a model's, a custom builder's: a chunk holds every replicate of its points).
* A group whose smallest chunk exceeds the limit (the host's memory, and the devices' on
  accelerators) is refused with one line naming the key that makes it large
  (:meth:`Planner.refusal`); so is a sweep of more than :data:`MAX_CHUNKS` chunks, or whose
  table does not fit the host (:meth:`Planner.check_table`).

The padding of a chunk (every device an equal share, a whole number of micro-batches) is
the execution's rule, :func:`powerlens._src.dynamics.execution.padded_size`; the engine passes
it in as ``pad(systems, devices, micro)``.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from ..analysis.budget import Estimate, format_bytes, run_estimate

CPU_BUDGET = 1 << 30           # bytes per CPU device for one chunk
MAX_CHUNK = {"cpu": 1024}      # systems per chunk at most (accelerators: 16384)
MAX_CHUNKS = 1_000_000         # chunks a sweep may have (one file each)
REFERENCES = 3                 # principal, random control, other layer (powerlens._src.dynamics.subspaces)
LIST_BYTES = 56
"""Host bytes of one number of a chunk's columns: a Python float, its list slot and its JSON
text (the columns are JSON-ready lists until the table is built)."""
ACCELERATOR_SHARE = 0.4
"""The share of an accelerator's memory a chunk is sized to."""


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every chunk of a sweep, group after group, as index arithmetic (the same on every
    process): group g has ``counts[g]`` chunks of ``sizes[g]`` systems (the last one shorter);
    chunk j of the sweep is chunk j - first[g] of its group. ``estimates[g]``: the memory of
    one of its chunks (padded), ``limit``: the memory a chunk can have (the host's, and the
    devices' on accelerators). A group is anything with ``n_systems``."""

    groups: tuple
    sizes: tuple
    estimates: tuple
    limit: float

    @functools.cached_property
    def counts(self) -> tuple:
        return tuple(-(-g.n_systems // s) for g, s in zip(self.groups, self.sizes))

    @functools.cached_property
    def first(self) -> tuple:
        return (0,) + tuple(itertools.accumulate(self.counts))[:-1]

    def __len__(self) -> int:
        return int(sum(self.counts))

    def __getitem__(self, j: int) -> Chunk:
        if not 0 <= j < len(self):
            raise IndexError(j)
        g = bisect.bisect_right(self.first, j) - 1
        k, size, n = j - self.first[g], self.sizes[g], self.groups[g].n_systems
        return Chunk(g, k, k * size, min((k + 1) * size, n), size)

    def __iter__(self):
        return (self[j] for j in range(len(self)))

    def of_process(self, rank: int, nproc: int) -> List[Chunk]:
        """The chunks j with j mod nproc == rank."""
        return [self[j] for j in range(rank, len(self), nproc)]


def chunk_estimate(st, shapes: Mapping[str, int], systems: int, attention_batch: int) -> Estimate:
    """The memory of one chunk of ``systems`` (padded) systems of T steps, n tokens, width d,
    H heads of size e, floats of s bytes, ``attention_batch`` of them in one vmap step at once
    (over every device). ``st``: the group's steps, x64 and series (a
    :class:`~powerlens._src.sweeps.systems.Static`, or anything with those attributes); ``shapes``:
    d, tokens, heads, d_head (and kv_heads). The parts of ``simulate``'s estimate
    (:func:`~powerlens._src.analysis.budget.run_estimate`: the chunk's initial tokens, its
    per-step measures, kept for all T + 1 steps since one scan runs them, and the attention of
    what runs at once), and the sweep's own::

        systems       S (12 d² + 4 n d + 16 d) s      weights (built in the program or placed),
                                                      the build's d x d temporaries, subspaces
        host copies   S (T+1) (4m+5+k) 8              the raw series on the host, float64 for
                                                      the columns (k: requested series per step)
        series        S (T+1) k (s + LIST_BYTES)      the requested series as JSON-ready lists

    with m = :data:`REFERENCES` and k = 1 per requested series (n for ``plane_angle``).
    """
    T, S = int(st.steps), int(systems)
    d, n = int(shapes["d"]), int(shapes["tokens"])
    s = 8 if st.x64 else 4
    base = run_estimate(steps=T, batch=S, tokens=n, d=d, heads=int(shapes["heads"]), d_head=int(shapes["d_head"]),
                        kv_heads=shapes.get("kv_heads"), itemsize=s, orders=0, references=REFERENCES,
                        steps_per_chunk=T + 1, attention_batch=attention_batch)
    k = sum(n if name == "plane_angle" else 1 for name in st.series)
    parts = {**base.parts,
             "systems": S * (12 * d * d + 4 * n * d + 16 * d) * s,
             "host copies": S * (T + 1) * (4 * REFERENCES + 5 + k) * 8,
             "series": S * (T + 1) * k * (s + LIST_BYTES)}
    return Estimate(parts={name: v for name, v in parts.items() if v}, advice="")


@dataclasses.dataclass(frozen=True)
class Devices:
    """What a chunk runs on: ``count`` devices (the mesh's size), ``micro`` systems per vmap
    step on each (None: a device's whole share at once), their ``platform`` ("cpu", "gpu",
    "tpu") and ``memory``, the bytes of one accelerator (None on a CPU: the host's memory is
    the limit)."""

    count: int
    micro: Optional[int]
    platform: str
    memory: Optional[int] = None

    @property
    def budget(self) -> int:
        """Bytes one device should spend on a chunk (what chunks are sized to):
        :data:`ACCELERATOR_SHARE` of an accelerator's memory, :data:`CPU_BUDGET` on a CPU."""
        return int(ACCELERATOR_SHARE * self.memory) if self.memory else CPU_BUDGET


def where(spec, key: str) -> str:
    """Where ``key`` is set in the spec, for a message: ``SOURCE: [grid] steps``."""
    if key in spec.grid:
        table = "grid"
    elif key == "prompts":
        table = "model"
    else:
        table = "run" if key in spec.run else "system"
    return f"{spec.source}: [{table}] {key}"


def static_text(static: Mapping) -> str:
    """A group's static keys that are set, for a message: ``d=4, tokens=4, steps=1000000000``."""
    keys = ("d", "tokens", "heads", "steps", "rule")
    return ", ".join(f"{k}={static[k]}" for k in keys if static.get(k) is not None)


_OWN = object()       # Planner.estimate: the devices' own micro-batch


class Planner:
    """The chunks of one sweep, from plain facts.

    Args:
      spec: the sweep's :class:`~powerlens._src.sweeps.spec.Spec` (read: ``source``, ``grid``,
        ``run["chunk_size"]``, ``run["micro_batch"]``, ``model``).
      groups: its groups (each with ``index``, ``n_systems``, ``replicates`` and ``static``,
        :class:`~powerlens._src.sweeps.grid.Group`).
      statics: per group, its steps, x64 and series (:func:`chunk_estimate`).
      shapes: per group, d, tokens, heads, d_head (and kv_heads).
      device_built: synthetic systems, built inside the program (a chunk may hold any count);
        else host-built (a chunk holds whole points: its group's ``replicates`` at a time).
      devices: :class:`Devices`.
      host: the bytes the host can still allocate
        (:func:`~powerlens._src.analysis.budget.available_bytes`).
      width: the table's columns per row besides the series (grid columns and measured ones).
      pad: ``pad(systems, devices, micro) -> padded count``, the execution's padding rule
        (:func:`powerlens._src.dynamics.execution.padded_size`).
    """

    def __init__(self, spec, groups: Sequence, statics: Sequence, shapes: Sequence[Mapping[str, int]], *,
                 device_built: bool, devices: Devices, host: float, width: int,
                 pad: Callable[[int, int, Optional[int]], int]):
        self.spec, self.groups, self.statics, self.shapes = spec, list(groups), list(statics), list(shapes)
        self.device_built, self.devices, self.host, self.width, self.pad = device_built, devices, host, width, pad

    @property
    def micro(self) -> Optional[int]:
        return self.devices.micro

    def estimate(self, group: int, systems: int, micro=_OWN) -> Estimate:
        """The memory of a chunk of ``systems`` systems of ``group``, padded as it will run:
        with the devices' micro-batch, or ``micro`` systems per vmap step when given."""
        m = self.micro if micro is _OWN else micro
        ndev = self.devices.count
        padded = self.pad(systems, ndev, m)
        return chunk_estimate(self.statics[group], self.shapes[group], padded, ndev * (m or padded // ndev))

    def chunk_size(self, group, budget: float) -> int:
        """Systems per chunk for ``group``: the spec's ``chunk_size``, else the most that fit
        ``budget`` (at most :data:`MAX_CHUNK`), balanced over the group and rounded to the
        micro-batch; whole points for host-built systems."""
        G, R = group.n_systems, group.replicates
        micro, ndev = self.micro or 1, self.devices.count
        if self.spec.run["chunk_size"]:
            size = self.spec.run["chunk_size"]
        else:
            st, shapes = self.statics[group.index], self.shapes[group.index]
            at = lambda systems, width: chunk_estimate(st, shapes, systems, width).total
            c0 = at(0, 0)                                   # the estimate is affine in both counts
            per_system, per_width = at(1, 0) - c0, at(0, 1) - c0
            fixed = c0 + (per_width * ndev * self.micro if self.micro else 0)
            fit = max(int((budget - fixed) // max(per_system + (0 if self.micro else per_width), 1)), 1)
            size = max(1, min(MAX_CHUNK.get(self.devices.platform, 16384), fit, G))
            size = -(-G // -(-G // size))                      # balanced: the last chunk is not mostly padding
            if size > micro:
                up = -(-size // micro) * micro
                size = up if self.pad(up, ndev, self.micro) <= fit else size // micro * micro
        if not self.device_built:
            size = max(R, size // R * R)
        return min(size, G)

    def refusal(self, group, size: int, est: Estimate, limit: float) -> str:
        """Why the smallest chunk of ``group`` does not fit, naming the key that makes it large."""
        spec, R, micro = self.spec, group.replicates, self.micro
        fits = lambda n, m=_OWN: self.estimate(group.index, n, m).total <= limit
        if spec.run["chunk_size"] and fits(R if not self.device_built else 1):
            key, advice = "chunk_size", "use a smaller chunk_size, or 0 to size the chunks from this estimate"
        elif isinstance(spec.run["micro_batch"], int) and micro > 1 and fits(1, 1):   # set, not "auto"
            key, advice = "micro_batch", "use a smaller micro_batch, or \"auto\""
        elif not self.device_built and R > 1 and fits(1):
            key = "prompts" if spec.model is not None else "replicates"
            advice = f"use fewer {key} (a chunk of host-built systems holds whole points)"
        else:
            big = max(est.parts, key=est.parts.get)
            key = {"attention": "tokens", "initial tokens": "tokens", "systems": "d", "series": "series"}.get(
                big, "steps")
            if spec.model is not None and key in ("tokens", "d"):
                key = "prompts" if key == "tokens" else "name"
            smaller = (micro or 1) > 1 and fits(1, 1)
            advice = {"steps": "use fewer steps" + (f" (or micro_batch = 1: {micro} systems run at once "
                                                    f"by default)" if smaller else ""),
                      "tokens": "use fewer tokens", "d": "use a smaller d",
                      "series": "ask for fewer series or fewer steps", "prompts": "use shorter prompts",
                      "name": "use a smaller model"}[key]
        at = f"{spec.source}: [measure] series" if key == "series" else (
            f"{spec.source}: [model] {key}" if key in ("prompts", "name") else where(spec, key))
        return (f"{at}: one chunk of {self.pad(size, self.devices.count, micro):,} systems "
                f"(group {group.index}: {static_text(group.static)}) needs {est.describe()}, more than the "
                f"{format_bytes(limit)} available; {advice}")

    def plan(self) -> Plan:
        """Chunks sized to the budget (the devices' share, at most the host's memory); a
        ValueError (:meth:`refusal`) when the smallest (or the spec's) chunk exceeds the
        memory there is, when the sweep has more than :data:`MAX_CHUNKS` chunks, or when its
        table does not fit the host (:meth:`check_table`)."""
        ndev, host, memory = self.devices.count, self.host, self.devices.memory
        budget = float(min(self.devices.budget * ndev, host))
        limit = float(min(memory * ndev, host) if memory else host)
        sizes, estimates = [], []
        for g in self.groups:
            size = self.chunk_size(g, budget)
            est = self.estimate(g.index, size)
            smallest = 1 if self.device_built else g.replicates
            while est.total > budget and size > smallest and not self.spec.run["chunk_size"]:
                size = max(smallest, size // 2 // smallest * smallest)     # padding made it too large
                est = self.estimate(g.index, size)
            if est.total > limit:
                raise ValueError(self.refusal(g, size, est, limit))
            sizes.append(size)
            estimates.append(est)
        plan = Plan(tuple(self.groups), tuple(sizes), tuple(estimates), limit)
        if len(plan) > MAX_CHUNKS:
            key = "chunk_size" if self.spec.run["chunk_size"] else "steps"
            raise ValueError(f"{where(self.spec, key)}: the sweep would run in {len(plan):,} chunks (one file "
                             f"each); at most {MAX_CHUNKS:,}: use larger chunks or fewer systems")
        self.check_table()
        return plan

    def table_bytes(self) -> int:
        """Host bytes of the whole table (every row's columns and series, as JSON-ready lists
        until the DataFrame is built): :data:`LIST_BYTES` per number."""
        cells = sum(g.n_systems * (self.width + (st.steps + 1) * sum(
            (shapes["tokens"] if k == "plane_angle" else 1) for k in st.series))
            for g, st, shapes in zip(self.groups, self.statics, self.shapes))
        return cells * LIST_BYTES

    def check_table(self) -> None:
        """The whole table must fit the host's memory (:meth:`table_bytes`)."""
        spec = self.spec
        need, avail = self.table_bytes(), self.host
        if need > avail:
            key = ("[measure] series" if any(st.series for st in self.statics) else
                   "[model] prompts" if spec.model is not None else "[system] replicates")
            n = sum(g.n_systems for g in self.groups)
            raise ValueError(f"{spec.source}: {key}: the table of {n:,} systems needs about "
                             f"{format_bytes(need)}, more than the {format_bytes(avail)} available; "
                             f"use fewer systems{' or series' if 'series' in key else ''}")


def shapes_by_group(statics: Sequence, host_shapes: Optional[Dict[str, int]]) -> List[Dict[str, int]]:
    """The shapes of each group's systems: host-built ones bring theirs (``host_shapes``, one
    for the whole sweep), synthetic ones have their group's d, tokens and heads."""
    if host_shapes is not None:
        return [host_shapes for _ in statics]
    return [{"d": st.d, "tokens": st.tokens, "heads": st.heads, "d_head": st.d // st.heads} for st in statics]
