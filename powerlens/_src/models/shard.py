"""One model over several devices: ``shard(model, mesh)`` places every weight with a
``NamedSharding`` over the mesh's ``model`` axis, Megatron-style.

    shard(model | layers, mesh=None) -> the same pytree, each array placed on ``mesh``
    placements(model | layers, mesh) -> the same pytree of ``NamedSharding``s (what ``shard`` uses)
    host_staging()                   -> a context in which a load reads into host memory
    shard_prompts(x, mesh)           -> prompts "[B ...]" split over the mesh's ``data`` axis

What is split over ``model`` (size m):

* each layer's attention heads: W_q "float[U H e d]" and b_q on H, W_o "float[U d H*e]" on its
  H*e columns in whole heads, W_k, W_v, b_k, b_v on the G key/value heads when m divides G
  (else replicated: grouped-query attention with fewer KV heads than devices);
* the FFN width f: W_in, W_gate "float[U f d]", b_in on f, W_out "float[U d f]" on f;
* the vocabulary: the word embeddings "float[V E]", the LM head "float[V d]" and its bias on V;

one rule per field: each part of the layers carries its own (``SPLIT`` of
:class:`~powerlens._src.dynamics.parts.Attention`, :class:`~powerlens._src.dynamics.parts.Norms`,
:class:`~powerlens._src.dynamics.parts.FFN`), and :data:`MODEL_SPLIT` here holds those of the rest
of a :class:`~powerlens._src.models.base.Model`. A count that m does not divide leaves that field replicated; norms, width-d biases, scales and position
embeddings are replicated. Each device then holds 1/m of the attention, FFN and vocabulary
weights (plus the replicated ones).

Nothing else changes: every compiled call of powerlens (``run_states``, ``hidden_states``,
``logits``, ``trace``, ``generate``, ``optimize_steering``, a ``[model]`` sweep) takes the placed
arrays as they are, and XLA's SPMD partitioner inserts the collectives (an all-reduce after
W_o and W_out per layer, Megatron's pattern). Prompts may be split over the mesh's ``data``
axis (:func:`shard_prompts`); the mesh itself is built by
:func:`powerlens._src.dynamics.execution.model_mesh`, across hosts after ``jax.distributed`` has
started (docs/large_models.md).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Union

import jax
import numpy as np

from ..dynamics import execution
from ..dynamics.params import Layers
from ..dynamics.parts import PARTS
from .base import Model

MODEL_SPLIT = {"word": 0, "lm_head": 0, "lm_head_bias": 0}
"""The vocabulary axis of the :class:`~powerlens._src.models.base.Model` arrays outside its layers
that are split over ``model``: ``embeddings["word"]`` "float[V E]", ``lm_head`` "float[V d]",
``lm_head_bias`` "float[V]"; every other array (position and token-type embeddings, embedding
norms and projections, the final norm) is replicated."""


def _mesh(mesh):
    mesh = execution.model_mesh() if mesh is None else mesh
    if execution.MODEL not in getattr(mesh, "axis_names", ()):
        raise ValueError(f"shard: the mesh {mesh!r} has no {execution.MODEL!r} axis; build one with "
                         f"powerlens._src.dynamics.execution.model_mesh(model=, data=)")
    return mesh


def _split(a, axis: Optional[int], count: Optional[int], size: int) -> Optional[int]:
    """``axis`` when ``size`` divides ``count`` (default: the axis's own length), else None."""
    if axis is None or a is None or np.ndim(a) <= axis:
        return None
    count = np.shape(a)[axis] if count is None else count
    return axis if count % size == 0 else None


def _layer_placements(layers: Layers, mesh) -> Layers:
    """Each part's arrays placed by the part's own rule (its ``SPLIT``: :mod:`powerlens._src.dynamics.parts`)."""
    cfg, size = layers.config, mesh.shape[execution.MODEL]
    out = {}
    for field in PARTS:
        part = getattr(layers, field)
        if part is None:                        # no FFN
            continue
        placed = {}
        for name, rule in type(part).SPLIT.items():
            a = getattr(part, name)
            if a is None:
                continue
            axis, what = rule if rule is not None else (None, None)
            count = None if what in (None, "ffn") else getattr(cfg, what)
            placed[name] = execution.axis_sharding(mesh, np.ndim(a), _split(a, axis, count, size))
        out[field] = part.replace(**placed)
    return layers.replace(**out)


def placements(model: Union[Model, Layers], mesh=None):
    """The placement of every array of ``model`` (a :class:`Model` or :class:`Layers`) on
    ``mesh`` (default :func:`~powerlens._src.dynamics.execution.model_mesh` over every device): the
    same pytree with a ``NamedSharding`` at each array (module docstring's rules)."""
    mesh = _mesh(mesh)
    if isinstance(model, Layers):
        return _layer_placements(model, mesh)
    if not isinstance(model, Model):
        raise TypeError(f"shard: expected a powerlens Model or Layers, got {type(model).__name__}")
    size = mesh.shape[execution.MODEL]
    place = lambda name, a: None if a is None else execution.axis_sharding(
        mesh, np.ndim(a), _split(a, MODEL_SPLIT.get(name), None, size))
    return model.replace(
        layers=_layer_placements(model.layers, mesh),
        embeddings={k: place(k, v) for k, v in model.embeddings.items()},
        final_norm_scale=place("final_norm_scale", model.final_norm_scale),
        final_norm_bias=place("final_norm_bias", model.final_norm_bias),
        lm_head=place("lm_head", model.lm_head), lm_head_bias=place("lm_head_bias", model.lm_head_bias))


def shard(model: Union[Model, Layers], mesh=None):
    """``model`` (a :class:`Model` or :class:`Layers`) with every array placed on ``mesh`` by the
    rules of :func:`placements` (default mesh: every device on the ``model`` axis). Each array
    is placed, and its previous copy released, one at a time, so the peak is one array more
    than the model. Every call that takes the model runs unchanged on the result; its numbers
    equal the unsharded model's to float rounding (XLA may sum a split contraction in
    another order)."""
    target = placements(model, mesh)
    return jax.tree_util.tree_map(execution.put, model, target)


@contextlib.contextmanager
def host_staging():
    """Arrays created inside go to the host (the CPU backend's device) rather than to the first
    accelerator: ``load(mesh=)`` reads the checkpoint there (aliasing the read buffers on the
    CPU), then :func:`shard` places each array over the mesh, so no single accelerator ever
    holds the whole model. Where JAX has no CPU backend, arrays go to the default device."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        cpu = None
    with (jax.default_device(cpu) if cpu is not None else contextlib.nullcontext()):
        yield


def shard_prompts(x, mesh=None):
    """Prompts ``x`` "[B ...]" (tokens, masks, ids) split over the ``data`` axis of ``mesh`` along
    B, replicated over ``model``; replicated whole when the ``data`` axis does not divide B."""
    mesh = _mesh(mesh)
    size = mesh.shape.get(execution.DATA, 1)
    axis = 0 if np.ndim(x) and np.shape(x)[0] % size == 0 and size > 1 else None
    return execution.put(x, execution.axis_sharding(mesh, np.ndim(x), axis, execution.DATA))
