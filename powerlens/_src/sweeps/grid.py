"""The grid of a spec: points, their systems, seeds, and groups of equal static shape.

A point is one combination of grid values (the last grid key varies fastest; a model
sweep adds a leading ``layer`` axis); each point has ``replicates`` systems. System ``s``
is replicate ``s % R`` of point ``s // R``: that index orders the table. Nothing here
loops over points in Python: values are read off index arrays.

Keys split in two:

* **static** keys (d, tokens, heads, kind, spectrum, init, steps, attention, rule, order,
  keep_bias, x64): the points of one combination form a *group*, run in chunks of their
  own. All but ``spectrum`` change shapes or code: each combination of them is compiled
  once. An explicit spectrum changes neither: its slots (:func:`explicit_slots`, zeros
  fill up to d) are "float[d 2]" whatever its text, an argument that every system of a
  chunk shares, so the groups of every explicit spectrum run one compiled program (the
  ``spectrum`` axis splits compilations only between ``"random"`` and explicit values:
  :func:`program_key`). The spectrum is not batched over systems, so each row is computed
  exactly as by a program with its spectrum compiled in as a constant, byte for byte;
* **dynamic** keys (beta, top, rest, imag, pair, nonnormality, cone, noise) are arrays
  with one entry per system, inside one compiled program.

Seeds: system (point p, replicate r) of a spec with seed S gets
``seed = splitmix64(splitmix64(splitmix64(S) ^ p) ^ r) >> 33`` (31 bits), so that a system
is reproducible from its row alone and no two systems share a stream.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, List, Tuple

import numpy as np

from ..dynamics.synthetic import parse_spectrum, spectrum_slots
from .spec import DYNAMIC, STATIC, Spec  # noqa: F401  (DYNAMIC re-exported: the engine's arguments)

EXPLICIT = "eigenvalues"
"""What is compiled of an explicit spectrum: ``SyntheticConfig.spectrum = "eigenvalues"``,
its slots an argument of the program."""


def program_key(key: str, value) -> Any:
    """What of a static key's value is compiled in: the value itself, except an explicit
    ``spectrum``, which is :data:`EXPLICIT` whatever its text."""
    if key == "spectrum" and value is not None and value != "random":
        return EXPLICIT
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def compiled_keys(axes: Dict[str, list]) -> List[str]:
    """The grid axes whose values compile different programs (static keys with more than one
    :func:`program_key`), in grid order: the keys that split a sweep's compilations."""
    return [k for k, v in axes.items() if k in STATIC and len({program_key(k, x) for x in v}) > 1]


def explicit_slots(text: str, d: int, dtype=np.float64) -> np.ndarray:
    """"float[d 2]" the slots (:func:`~powerlens._src.dynamics.synthetic.spectrum_slots`) of an
    explicit spectrum text in a d-wide system: the program argument of its group."""
    return spectrum_slots(parse_spectrum(text), d).astype(dtype)


def splitmix64(x) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 arrays (wrapping arithmetic)."""
    z = np.asarray(x, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def system_seeds(spec_seed: int, point, replicate) -> np.ndarray:
    """"int64[S]" 31-bit seeds of the systems (point, replicate) of a spec with seed ``spec_seed``."""
    p = np.asarray(point, np.uint64)
    r = np.asarray(replicate, np.uint64)
    z = splitmix64(splitmix64(splitmix64(np.uint64(spec_seed)) ^ p) ^ r)
    return (z >> np.uint64(33)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Group:
    """The points of one static combination: those whose static grid axes take the value
    indices ``fixed``, i.e. every combination of the other (dynamic) axes. Nothing is
    listed: a point's id is index arithmetic on the grid's ``shape``.

    Attributes:
      index: the group's number (groups are numbered in order of their first point).
      static: every static key's value for these points (and ``layer`` for none).
      replicates: systems per point.
      shape: the shape of the whole grid (one entry per axis).
      fixed: (axis position, value index) of each static grid axis.
    """

    index: int
    static: Dict[str, Any]
    replicates: int
    shape: Tuple[int, ...] = ()
    fixed: Tuple[Tuple[int, int], ...] = ()

    @property
    def n_points(self) -> int:
        pinned = dict(self.fixed)
        return math.prod(n for a, n in enumerate(self.shape) if a not in pinned)

    @property
    def n_systems(self) -> int:
        return self.n_points * self.replicates

    def point_ids(self, local) -> np.ndarray:
        """"int64[P]" the grid point ids of this group's points ``local`` (0 .. n_points-1),
        increasing with ``local``."""
        local = np.asarray(local, np.int64)
        pinned = dict(self.fixed)
        free = [a for a in range(len(self.shape)) if a not in pinned]
        idx = np.unravel_index(local, [self.shape[a] for a in free]) if free else ()
        full = dict(zip(free, idx))
        full = [full[a] if a in full else np.full(local.shape, pinned[a], np.int64) for a in range(len(self.shape))]
        return np.ravel_multi_index(full, self.shape).astype(np.int64) if self.shape else local

    @property
    def points(self) -> np.ndarray:
        """"int64[P]" every point id of the group, increasing (built on demand)."""
        return self.point_ids(np.arange(self.n_points, dtype=np.int64))

    def contains(self, points) -> np.ndarray:
        """"bool[P]" whether each grid point id belongs to this group."""
        points = np.asarray(points, np.int64)
        idx = np.unravel_index(points, self.shape) if self.shape else ()
        out = np.ones(points.shape, bool)
        for a, i in self.fixed:
            out &= idx[a] == i
        return out

    def systems(self, start: int = 0, stop: int = None) -> np.ndarray:
        """"int64[S]" global system ids of this group's systems [start, stop)."""
        stop = self.n_systems if stop is None else stop
        local = np.arange(start, stop, dtype=np.int64)
        return self.point_ids(local // self.replicates) * self.replicates + local % self.replicates


class Grid:
    """The expanded grid of a :class:`Spec` (index arithmetic only)."""

    def __init__(self, spec: Spec):
        self.spec = spec
        axes = dict(spec.grid)
        if spec.model is not None:
            axes = {"layer": list(spec.model["layers"]), **axes}
        self.axes: Dict[str, list] = axes
        self.shape = tuple(len(v) for v in axes.values())
        self.n_points = int(np.prod(self.shape, dtype=np.int64))
        self.replicates = spec.replicates
        self.n_systems = self.n_points * self.replicates

    def indices(self, key: str, points) -> np.ndarray:
        """Position of each point's value of grid axis ``key`` in that axis' list."""
        keys = list(self.axes)
        idx = np.unravel_index(np.asarray(points, np.int64), self.shape)
        return idx[keys.index(key)]

    def values(self, key: str, points) -> List[Any]:
        """The value of ``key`` (grid or fixed) for each point, as a list."""
        points = np.asarray(points, np.int64)
        if key in self.axes:
            vals = self.axes[key]
            return [vals[i] for i in self.indices(key, points)]
        return [self.spec.value(key)] * points.size

    def array(self, key: str, points, dtype=np.float64) -> np.ndarray:
        """A dynamic key's values for each point: "float[P]" (scalars) or "float[P 2]" (ranges)."""
        points = np.asarray(points, np.int64)
        if key in self.axes:
            table = np.asarray(self.axes[key], dtype)
            return table[self.indices(key, points)]
        v = np.asarray(self.spec.value(key), dtype)
        return np.broadcast_to(v, points.shape + v.shape).copy()

    def groups(self) -> List[Group]:
        """The points split by static combination, in order of their first point (the static
        axes' value indices in C order: no point is listed)."""
        keys = list(self.axes)
        static_axes = [a for a, k in enumerate(keys) if k in STATIC]
        static_shape = [self.shape[a] for a in static_axes]
        out = []
        for g in range(math.prod(static_shape)):
            idx = [int(i) for i in np.unravel_index(g, static_shape)] if static_axes else []
            fixed = tuple(zip(static_axes, idx))
            pinned = {keys[a]: self.axes[keys[a]][i] for a, i in fixed}
            static = {k: (pinned[k] if k in pinned else self._fixed(k)) for k in STATIC}
            out.append(Group(index=g, static=static, replicates=self.replicates, shape=self.shape, fixed=fixed))
        return out

    def _fixed(self, key):
        try:
            return self.spec.value(key)
        except KeyError:          # a synthetic key in a model sweep
            return None

    def columns(self, systems) -> Dict[str, list]:
        """The identifying columns of systems (global ids): every grid axis, replicate, seed."""
        systems = np.asarray(systems, np.int64)
        points, reps = systems // self.replicates, systems % self.replicates
        out: Dict[str, list] = {"point": points.tolist()}
        for key in self.axes:
            vals = self.values(key, points)
            out[key] = [json.dumps(v) if isinstance(v, list) else v for v in vals]
        out["replicate"] = reps.tolist()
        out["seed"] = system_seeds(self.spec.seed, points, reps).tolist()
        if self.spec.model is not None:
            prompts = self.spec.model["prompts"]
            out["prompt"] = [prompts[r] for r in reps]
        return out
