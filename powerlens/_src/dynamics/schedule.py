"""``Schedule``: which unique layer each step applies, stored in O(1) when it can be.

    Schedule.repeat(u, T)            u, u, ..., u         a shared-weight system (T steps)
    Schedule.range(U)                0, 1, ..., U-1       a layer-varying model
    Schedule.of((0, 1, 0, 1, 2, 3))  explicit indices     ALBERT's layer groups

An arithmetic schedule (layer of step t = start + stride * t; every constant or evenly
spaced sequence is stored so, whatever built it) is three integers however long it is;
only an irregular one keeps its tuple. A Schedule is an immutable, hashable sequence of
ints with the semantics of a tuple: ``len``, indexing, slicing (a Schedule again), iteration,
equality with tuples, ``np.asarray``. :meth:`array` gives one chunk "int32[stop - start]"
without expanding the rest, and :meth:`steps_of` the steps of one layer (a ``range`` for
an arithmetic schedule). So a jit-static config that holds a schedule of T = 10⁹ steps
costs nothing to build, hash or compare.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class Schedule(Sequence):
    """Unique-layer index of each of ``length`` steps: ``start + stride * t``, or ``steps[t]``
    when ``steps`` is not None (an irregular schedule). Build with :meth:`of`, :meth:`repeat`,
    :meth:`range`: they keep the representation canonical, so equal schedules compare and
    hash equal."""

    start: int = 0
    stride: int = 0
    length: int = 0
    steps: Optional[Tuple[int, ...]] = None

    # ------------------------------------------------------------ constructors

    @classmethod
    def repeat(cls, layer: int, length: int) -> "Schedule":
        return cls._arith(int(layer), 0, int(length))

    @classmethod
    def range(cls, n: int) -> "Schedule":
        return cls._arith(0, 1, int(n))

    @classmethod
    def of(cls, seq) -> "Schedule":
        """A Schedule from any sequence of ints (a Schedule is returned as is)."""
        if isinstance(seq, Schedule):
            return seq
        steps = tuple(int(s) for s in np.asarray(seq, dtype=object).reshape(-1))
        strides = {b - a for a, b in zip(steps, steps[1:])}
        if len(strides) <= 1:                                   # empty, one step, or evenly spaced
            return cls._arith(steps[0] if steps else 0, strides.pop() if strides else 0, len(steps))
        return cls(steps=steps, length=len(steps))

    @classmethod
    def _arith(cls, start: int, stride: int, length: int) -> "Schedule":
        if length < 0:
            raise ValueError(f"a schedule cannot have {length} steps")
        if length <= 1:
            stride = 0
        if length == 0:
            start = 0
        return cls(start=start, stride=stride, length=length)

    # ------------------------------------------------------------ sequence protocol

    @property
    def arithmetic(self) -> bool:
        return self.steps is None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        if isinstance(i, slice):
            if self.steps is not None:
                return Schedule.of(self.steps[i])
            r = range(self.length)[i]
            return Schedule._arith(self.start + self.stride * r.start if len(r) else 0, self.stride * r.step, len(r))
        i = int(i)
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"step {i} out of range for a schedule of {self.length} steps")
        return self.steps[i] if self.steps is not None else self.start + self.stride * i

    def __iter__(self):
        if self.steps is not None:
            return iter(self.steps)
        return iter(range(self.start, self.start + self.stride * self.length, self.stride) if self.stride
                    else (self.start for _ in range(self.length)))

    def __eq__(self, other) -> bool:
        if isinstance(other, Schedule):
            return (self.start, self.stride, self.length, self.steps) == \
                (other.start, other.stride, other.length, other.steps)
        if isinstance(other, (tuple, list)):
            return len(other) == self.length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.start, self.stride, self.length, self.steps))

    def __repr__(self) -> str:
        if self.steps is not None:
            return f"Schedule.of({self.steps})"
        if self.stride == 0:
            return f"Schedule.repeat({self.start}, {self.length})"
        if (self.start, self.stride) == (0, 1):
            return f"Schedule.range({self.length})"
        return f"Schedule(start={self.start}, stride={self.stride}, length={self.length})"

    def __array__(self, dtype=None, copy=None):
        return self.array().astype(dtype or np.int32, copy=False)

    # ------------------------------------------------------------ compact queries

    def array(self, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Steps ``start .. stop-1`` as "int32[stop - start]" (only that chunk is built)."""
        r = range(self.length)[start:stop]
        if self.steps is not None:
            return np.asarray(self.steps[r.start:r.stop], np.int32)
        return (self.start + self.stride * np.arange(r.start, r.stop, dtype=np.int64)).astype(np.int32)

    def bounds(self) -> Tuple[int, int]:
        """(smallest, largest) layer index; the schedule must not be empty."""
        if not self.length:
            raise ValueError("schedule must contain at least one step")
        if self.steps is not None:
            return min(self.steps), max(self.steps)
        last = self.start + self.stride * (self.length - 1)
        return min(self.start, last), max(self.start, last)

    def steps_of(self, layer: int):
        """The steps that apply unique layer ``layer`` (a tuple, or a ``range``)."""
        layer = int(layer)
        if self.steps is not None:
            return tuple(t for t, s in enumerate(self.steps) if s == layer)
        if self.stride == 0:
            return range(self.length) if layer == self.start and self.length else range(0)
        t, rem = divmod(layer - self.start, self.stride)
        return range(t, t + 1) if rem == 0 and 0 <= t < self.length else range(0)

    def renumbered(self) -> Tuple[Tuple[int, ...], "Schedule"]:
        """(the layers used, ascending; the schedule renumbered onto them)."""
        if self.steps is not None:
            used = tuple(sorted(set(self.steps)))
            return used, Schedule.of(tuple(used.index(s) for s in self.steps))
        lo, hi = self.bounds()
        if self.stride == 0:
            return (lo,), Schedule.repeat(0, self.length)
        used = tuple(range(lo, hi + 1, abs(self.stride)))
        return used, Schedule._arith(0 if self.stride > 0 else self.length - 1, 1 if self.stride > 0 else -1,
                                     self.length)
