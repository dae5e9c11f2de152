"""The grid of a spec: points, their systems, seeds, and groups of equal static shape.

A point is one combination of grid values (the last grid key varies fastest; a model
sweep adds a leading ``layer`` axis); each point has ``replicates`` systems. System ``s``
is replicate ``s % R`` of point ``s // R``: that index orders the table. Nothing here
loops over points in Python: values are read off index arrays.

Keys split in two:

* **static** keys change shapes or code (d, tokens, heads, kind, spectrum, init, steps,
  attention, rule, order, keep_bias, x64): the points of one combination form a *group*,
  compiled once;
* **dynamic** keys (beta, top, rest, imag, pair, nonnormality, cone, noise) are arrays
  with one entry per system, inside one compiled program.

Seeds: system (point p, replicate r) of a spec with seed S gets
``seed = splitmix64(splitmix64(splitmix64(S) ^ p) ^ r) >> 33`` (31 bits), so that a system
is reproducible from its row alone and no two systems share a stream.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List

import numpy as np

from .spec import Spec

STATIC = ("d", "tokens", "heads", "kind", "spectrum", "init", "steps", "attention", "rule", "order",
          "keep_bias", "x64")
DYNAMIC = ("beta", "top", "rest", "imag", "pair", "nonnormality", "cone", "noise")

_M = np.uint64(0xFFFFFFFFFFFFFFFF)


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
    """Points of one static combination.

    Attributes:
      static: every static key's value for these points (and ``layer`` for none).
      points: "int64[P]" the point indices, increasing.
      replicates: systems per point.
    """

    index: int
    static: Dict[str, Any]
    points: np.ndarray
    replicates: int

    @property
    def n_systems(self) -> int:
        return int(self.points.size) * self.replicates

    def systems(self, start: int = 0, stop: int = None) -> np.ndarray:
        """"int64[S]" global system ids of this group's systems [start, stop)."""
        stop = self.n_systems if stop is None else stop
        local = np.arange(start, stop, dtype=np.int64)
        return self.points[local // self.replicates] * self.replicates + local % self.replicates


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
        """The points split by static combination, in order of their first point."""
        static_axes = [k for k in self.axes if k in STATIC]
        points = np.arange(self.n_points, dtype=np.int64)
        if static_axes:
            codes = np.ravel_multi_index([self.indices(k, points) for k in static_axes],
                                         [len(self.axes[k]) for k in static_axes])
        else:
            codes = np.zeros(self.n_points, np.int64)
        _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        out = []
        for g, u in enumerate(order):
            pts = points[inverse == u]
            p0 = int(pts[0])
            static = {k: (self.values(k, [p0])[0] if k in self.axes else self._fixed(k)) for k in STATIC}
            out.append(Group(index=g, static=static, points=pts, replicates=self.replicates))
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
