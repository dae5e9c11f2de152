"""A step's attention weights laid out for a plain X @ W, built once outside the program.

The layers store each projection as the model does, rows of (out, in): W_q "float[H e d]",
W_o "float[d He]". A step multiplies its tokens X "float[n d]" by them, X @ W^T. On the CPU,
for few tokens, the same product from a weight stored (in, out), X @ W, is faster: the
matmul then reads the weight in the order it packs it. Measured on this project's 2-core CPU
machine, jitted 200-step loops of one product, timed in turns:

    tokens x (in, out)     X @ W^T (rows)   X @ W (columns)
    32 x (384, 384)        110-115 us       95-99 us
    16 x (576, 576)        140-144 us       102-104 us
    1024 x (384, 384)      2.36-2.60 ms     2.35-2.57 ms    (equal: many tokens)

For the fused q/k/v weight, MiniLM's 1,000-step shared layer on 32 tokens took 427 against
450 ms, and 16 x 576 x 960 alone 100 against 137 us.

:class:`Projections` holds those (in, out) copies for every unique layer, stacked:

    qkv   "float[U d (H+2G)e]"   W_q, W_k, W_v rows stacked, then transposed: one fused projection
    out   "float[U He d]"        W_o^T

The FFN weights of rule ``full`` are read in place: at SmolLM2's 16 tokens its FFN steps are
bound by reading the weights from memory (10.6 MB a layer), and copies of them in this layout
were no faster (a 30-layer scan of the gated FFN, timed in turns: 41-68 ms against 48-60 ms)
while they would double the FFN's memory.

:func:`prepared_projections` builds them once per set of weights (one more copy of the
attention weights, kept while they live: :func:`~powerlens._src.dynamics.cache.per_arrays`); the
jitted entry points pass them into their compiled program, and each step reads its layer's
slice. A step given none (weights traced by the caller's jit or grad) reads the layer's rows
in place, X @ W^T, so no transposed copy of every layer is built inside a differentiated
program; :func:`~powerlens._src.dynamics.run.run` builds the copies of a single unique layer (a
shared-weight system, traced or not) once before its scan, with :func:`build_projections`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .attention import qkv_rows
from .cache import per_arrays
from jaxtyping import Array, ArrayLike, Float


class Projections(NamedTuple):
    """(in, out) copies of a step's attention weights (module docstring): ``qkv`` None for an
    attention mode other than softmax, or layers without W_q and W_k."""

    qkv: Optional[jax.Array] = None
    out: Optional[jax.Array] = None

    def layer(self, u) -> "Projections":
        """Unique layer ``u``'s slice of every copy (leading axis removed)."""
        return jax.tree_util.tree_map(lambda a: a[u], self)


def columns(W: Float[ArrayLike, "*batch d_out d_in"]) -> Float[Array, "*batch d_in d_out"]:
    """W with its last two axes swapped: the (in, out) layout of a plain X @ W."""
    return jnp.swapaxes(W, -1, -2)


def qkv_weight(layers) -> Float[Array, "*U d qkv"]:
    """W_q, W_k, W_v stacked and transposed for one fused projection X @ qkv:
    "float[d (H+2G)e]" for one layer, or "float[U d (H+2G)e]" for stacked layers."""
    return columns(qkv_rows(layers.W_q, layers.W_k, layers.W_v))


def _needs_qkv(layers, attention: str) -> bool:
    return attention == "softmax" and layers.W_q is not None and layers.W_k is not None


def build_projections(layers, attention: str = "softmax") -> Projections:
    """:class:`Projections` of ``layers`` (stacked "float[U ...]", or one layer with the leading
    axis removed) for ``attention``, built now: no cache, so traced weights too. ``qkv`` only for
    softmax attention on layers with W_q and W_k."""
    qkv = qkv_weight(layers) if _needs_qkv(layers, attention) else None
    return Projections(qkv=qkv, out=columns(layers.W_o))


_build = jax.jit(build_projections, static_argnames="attention")


def prepared_projections(layers, attention: str = "softmax") -> Optional[Projections]:
    """:class:`Projections` of concrete stacked layers for ``attention``, built once per set
    of weights and kept while they live; None for weights that are traced (inside jit or
    grad) or NumPy arrays (mutable: never cached)."""
    qkv = _needs_qkv(layers, attention)
    tag, arrays = (("projections/softmax", (layers.W_q, layers.W_k, layers.W_v, layers.W_o)) if qkv
                   else ("projections/out", (layers.W_o,)))
    return per_arrays(tag, arrays, lambda: _build(layers, attention))
