"""Frozen dataclasses that are JAX pytrees: the two names of ``flax.struct`` that powerlens
uses, on ``jax.tree_util.register_dataclass`` alone (importing flax costs a tenth of a
second at every start of the command line).

    @struct.dataclass
    class Layers:
        W_v: jax.Array                                              # a leaf (traced, vmapped)
        config: LayerConfig = struct.field(pytree_node=False, default=None)   # static

A field is a pytree child unless declared with ``pytree_node=False``; such a field is part
of the tree's structure (compared, and hashed by jit), so its value must be hashable. The
class is a frozen dataclass with a ``replace(**changes)`` method (``dataclasses.replace``).
Flattening and unflattening are JAX's own (``register_dataclass``): unflattening calls the
class with every field by keyword, as flax does.
"""
from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax

_T = TypeVar("_T")


def field(pytree_node: bool = True, *, metadata=None, **kwargs):
    """``dataclasses.field(**kwargs)``, marked static when ``pytree_node`` is False."""
    return dataclasses.field(metadata={**(metadata or {}), "pytree_node": pytree_node}, **kwargs)


def _replace(self, **changes):
    """A copy with the given fields replaced (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)


def dataclass(cls: type[_T], **kwargs) -> type[_T]:
    """``cls`` as a frozen dataclass (``kwargs`` go to ``dataclasses.dataclass``) registered
    as a pytree: children the fields with ``pytree_node`` True (the default), static the others."""
    kwargs.setdefault("frozen", True)
    cls = dataclasses.dataclass(**kwargs)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if f.metadata.get("pytree_node", True)]
    meta = [f.name for f in fields if not f.metadata.get("pytree_node", True)]
    cls.replace = _replace
    jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
    return cls
