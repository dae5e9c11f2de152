"""Values derived from concrete JAX arrays, computed once and kept while those arrays live.

The jitted entry points (``run_batch``, ``simulate_batch``) pass such values into their
compiled programs, which would otherwise rebuild them on every call from weights that did not
change: the (in, out) copies of the attention weights, the fused q/k/v weight among them
(:func:`~powerlens._src.dynamics.projections.prepared_projections`), and the
complex-pair planes of the alignment observer (:func:`~powerlens._src.dynamics.observers.rotation_planes`).
JAX arrays are immutable, so the identity of the arrays names their contents; NumPy arrays
(mutable) and traced values are never cached.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import jax

_CACHE: "dict[tuple, tuple]" = {}        # (tag, ids of the arrays) -> (weak refs to them, value)


def is_concrete(arrays: Sequence[Any]) -> bool:
    """Every entry a JAX array that is not traced (inside jit or grad)."""
    return all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in arrays)


def per_arrays(tag: str, arrays: Sequence[Any], build: Callable[[], Any]) -> Optional[Any]:
    """``build()``, computed once per (``tag``, ``arrays``) and dropped with the first of the
    arrays to go; None (nothing built) unless :func:`is_concrete` holds for ``arrays``."""
    arrays = tuple(arrays)
    if not is_concrete(arrays):
        return None
    key = (tag,) + tuple(id(a) for a in arrays)
    hit = _CACHE.get(key)
    if hit is not None and all(r() is a for r, a in zip(hit[0], arrays)):
        return hit[1]
    value = build()
    _CACHE[key] = (tuple(weakref.ref(a) for a in arrays), value)
    for a in arrays:
        weakref.finalize(a, _CACHE.pop, key, None)
    return value
