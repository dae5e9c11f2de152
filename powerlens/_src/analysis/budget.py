"""The memory a run will need, estimated from the shapes before anything is allocated.

    estimate = run_estimate(**shapes_of(layers), steps=T, batch=B, tokens=n, save_states=...)
    check(estimate)       MemoryBudgetError (a ValueError: exit 2, one line) when it exceeds
                          available_bytes(), naming the estimate and its largest parts

Used by the commands (``powerlens simulate``, ``align``, ``steer``: through
:mod:`powerlens._src.commands.budget`) and by the sweeps, which size and bound each chunk with
the same parts.

The parts of a run of T steps on B prompts of n tokens, width d, H query heads and G
key/value heads of size e, floats of s bytes (``itemsize``):

    initial tokens      B n d (8 + s)             the float64 draw and its device copy
    states              2 (T+1) B n d s           --save-states: the chunks and their concatenation
    per-step measures   T R orders + c B (4m+5) s the rows written to JSON/CSV (R bytes each, measured)
                                                  and one chunk of c steps of per-prompt outputs
                                                  (c = ``steps_per_chunk``, default chunk_steps(T);
                                                  one scan over every step keeps c = T + 1)
    attention           A (3 H n² + 2 n (H+2G) e + 4 n d) s   scores, softmax and q/k/v of one step
                                                  for the A = ``attention_batch`` prompts run at
                                                  once (default B; a sweep's micro-batch)
    projection weights  the (in, out) copies the scan is given of W_q, W_k, W_v (fused) and W_o
    gradients           T x attention             --optimize differentiates through every step

Available memory is the least of the kernel's MemAvailable (or free pages), the cgroup's
limit and the address-space limit of this process, whichever apply.
"""
from __future__ import annotations

import dataclasses
import os
import resource
from typing import Dict, Optional

import numpy as np

ROW_BYTES = 4096
"""Peak bytes per state of one ordering's rows: a dict of 15 numbers, its JSON and CSV text."""

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


class MemoryBudgetError(ValueError):
    """The estimated memory of a command exceeds the memory available."""


def format_bytes(n: float) -> str:
    """512 -> "512 B", 1.2 * 2**40 -> "1.2 TiB"."""
    n = float(n)
    i = 0
    while n >= 1024 and i < len(_UNITS) - 1:
        n /= 1024
        i += 1
    return f"{int(n)} B" if i == 0 else f"{n:.1f} {_UNITS[i]}"


@dataclasses.dataclass
class Estimate:
    """Bytes per named part (see the module docstring) and the advice for a refusal."""

    parts: Dict[str, float]
    advice: str = "use fewer steps, tokens or prompts"

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def describe(self) -> str:
        big = sorted(((v, k) for k, v in self.parts.items() if v > 0), reverse=True)
        return f"about {format_bytes(self.total)} (" + ", ".join(f"{k} {format_bytes(v)}" for v, k in big) + ")"


def shapes_of(layers) -> dict:
    """The sizes of ``layers`` that :func:`run_estimate` needs."""
    cfg = layers.config
    copied = (layers.W_q, layers.W_k, layers.W_v, layers.W_o)         # powerlens._src.dynamics.projections
    same = layers.dtype == layers.W_v.dtype          # weights of another dtype are cast a layer at a time, not copied
    weights = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in copied if a is not None) if same else 0
    return dict(d=cfg.d_model, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, d_head=cfg.d_head,
                itemsize=np.dtype(layers.dtype).itemsize, weights=weights)


def run_estimate(*, steps: int, batch: int, tokens: int, d: int, heads: int, d_head: int, itemsize: int,
                 kv_heads: Optional[int] = None, weights: float = 0, save_states: bool = False, orders: int = 1,
                 references: int = 3, gradients: bool = False, steps_per_chunk: Optional[int] = None,
                 attention_batch: Optional[int] = None) -> Estimate:
    """The parts of a measured run (module docstring); Python ints, so 10⁹ steps never overflow."""
    T, B, n, s = int(steps), int(batch), int(tokens), int(itemsize)
    A = B if attention_batch is None else int(attention_batch)
    if steps_per_chunk is None:
        from .experiment import chunk_steps      # here, not at the top: this module stays free of JAX
        c = chunk_steps(max(T, 1))
    else:
        c = int(steps_per_chunk)
    G = heads if kv_heads is None else kv_heads
    attention = A * (3 * heads * n * n + 2 * n * (heads + 2 * G) * d_head + 4 * n * d) * s
    parts = {
        "initial tokens": B * n * d * (8 + s),
        "states": 2 * (T + 1) * B * n * d * s if save_states else 0,
        "per-step measures": T * ROW_BYTES * orders + c * B * (4 * references + 5) * s,
        "attention": attention,
        "projection weights": weights,
        "gradients": T * attention if gradients else 0,
    }
    advice = "use fewer steps, tokens or prompts" + (" (or drop --save-states)" if save_states else "")
    return Estimate(parts=parts, advice=advice)


def spectra_estimate(n_layers: int, d: int) -> Estimate:
    """Eigen-decompositions of U matrices (d, d) in float64: F, its complex eigenvectors,
    the Schur workspace and the bases of both orderings."""
    return Estimate(parts={"eigen-decompositions": 64 * int(n_layers) * int(d) ** 2},
                    advice="use a model with fewer or narrower layers")


def _meminfo_available() -> Optional[float]:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _read_number(path: str) -> Optional[float]:
    try:
        with open(path) as fh:
            text = fh.read().strip()
        return None if text == "max" else float(text)
    except (OSError, ValueError):
        return None


def _cgroup_available() -> Optional[float]:
    limit = _read_number("/sys/fs/cgroup/memory.max")
    used = _read_number("/sys/fs/cgroup/memory.current")
    return None if limit is None or used is None else limit - used


def _address_space_available() -> Optional[float]:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as fh:
            size = next(float(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))
    except (OSError, StopIteration):
        size = 0.0
    return soft - size


def available_bytes() -> float:
    """The memory this process can still allocate: the least of the limits that apply."""
    limits = [v for v in (_meminfo_available(), _cgroup_available(), _address_space_available()) if v is not None]
    return max(min(limits), 0.0) if limits else float("inf")


def check(estimate: Estimate, available: Optional[float] = None) -> Estimate:
    """Refuse (MemoryBudgetError, naming the estimate) when it exceeds the ``available`` memory
    (default :func:`available_bytes`)."""
    avail = available_bytes() if available is None else available
    if estimate.total > avail:
        raise MemoryBudgetError(f"needs {estimate.describe()}, more than the {format_bytes(avail)} available; "
                                f"{estimate.advice}")
    return estimate
