"""A decoder's forward pass (rule ``full``) with a key/value cache: prefill once, then one token a step.

The cache holds, for every step t of the schedule (a decoder applies each layer once), the
keys and values of every token seen so far, per key/value head, after the q/k norms and RoPE::

    k, v   "float[T B G N e]"     N = n + K - 1: the longest prompt n and K - 1 tokens fed back (a fixed size)

Prompt b (L_b tokens, right-padded to n) keeps positions 0 .. L_b - 1, and its j-th new token
is written at cache index = position L_b + j, so every row counts positions from its own first
token, as transformers does with a left-padded batch and its attention mask.

    prefill   the prompts through every step of the schedule (the model's own attention, by
              query blocks for long prompts), recording each step's k and v:
              :func:`prefill` -> (h "float[B d]" at each prompt's last token, the cache)
    decode_step  one token per row at its position p_b: each step forms its q, k, v, writes k, v
              at index p_b, and attends over the cache's keys j with
              j <= p_b and (window == 0 or j > p_b - window)      (local layers: the window)
              :func:`decode_step` -> (h "float[B d]", the cache with index p_b written); one
              ``lax.scan`` over the stacked layers, or, on a CPU, each layer's own buffers
              read by a step written out layer by layer (:func:`decode_layers`)

Cache indices above p_b are never read (a prompt's padding there is overwritten before any
query can see it), so the attention of each new token is that of the whole sequence run again,
to float rounding: the same numbers as :func:`powerlens._src.dynamics.run` on the grown prompt.

Activation addition: ``add`` "float[d]" is added to every token of the output of schedule step
``add_step`` (the last step applying the edited layer), in prefill and in decode alike.

Dtypes, as in :func:`powerlens._src.dynamics.run`: the tokens, keys and values are held in
``layers.dtype`` (the compute dtype); each step casts its own layer's weights to it when they
are stored in another (:func:`~powerlens._src.dynamics.params.cast_layer`, one layer at a time, and
then no prepared (in, out) copies: ``projections`` None); the callers trace under the layers'
matmul precision.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from ..dynamics.attention import softmax_qkv, dense_softmax_mix, softmax_mix
from ..dynamics.layer import full_attention_input, full_block, head_output
from ..dynamics.params import cast_layer
from ..dynamics.projections import Projections
from ..dynamics.run import inert_padding
from .base import Model
from jaxtyping import ArrayLike, Bool, Float, Int


class KVCache(NamedTuple):
    """Keys and values of every schedule step t, row b, key/value head g, cache index j:
    k, v "float[T B G N e]" (module docstring)."""

    k: jax.Array
    v: jax.Array


def _schedule(model: Model):
    """The unique layer of each step "int32[T]" and the step numbers "int32[T]"."""
    steps = jnp.asarray(model.layers.schedule.array(), jnp.int32)
    return steps, jnp.arange(steps.shape[0], dtype=jnp.int32)


def _layer_of(model: Model, projections):
    """(held, the step's fetch): ``fetch(X, held, u)`` -> (X, held, unique layer u's parameters
    in the compute dtype, its prepared projections or none). ``held`` rides in the scan's carry.

    Weights stored in another dtype than the compute dtype are the stack ``held``, passed with
    the step's tokens X through an optimization barrier before layer u is cast (as in
    :func:`powerlens._src.dynamics.run`): XLA's compiler otherwise hoists the cast of the loop-invariant
    stack out of the scan, a float32 copy of every layer at once, instead of the one layer each
    step reads. Weights in the compute dtype: ``held`` is None and nothing is cast."""
    layers = model.layers
    dtype = layers.dtype
    proj = (lambda u: Projections()) if projections is None else projections.layer
    if dtype == layers.storage_dtype:
        return None, lambda X, held, u: (X, held, layers.layer(u), proj(u))

    def fetch(X, held, u):
        X, held = jax.lax.optimization_barrier((X, held))
        return X, held, cast_layer(held.layer(u), dtype), proj(u)
    return layers, fetch


def _added(Y, t, add, add_step):
    """Y plus ``add`` at schedule step ``add_step`` (no addition when ``add`` is None)."""
    return Y if add is None else Y + jnp.where(t == add_step, add, jnp.zeros_like(add)).astype(Y.dtype)


def prefill_one(model: Model, x0: Float[ArrayLike, "n d"], valid: Bool[ArrayLike, "n"], projections, add=None,
                add_step=None):
    """One right-padded prompt through rule ``full``: (its last valid token's state "float[d]",
    keys "float[T G n e]", values "float[T G n e]"). Each step is
    :func:`~powerlens._src.dynamics.layer.layer_step`'s rule ``full`` with the model's own softmax
    attention (the same schedule of dense or query-blocked attention), its k and v kept."""
    n = x0.shape[0]
    positions = jnp.arange(n)
    x0 = inert_padding(x0.astype(model.layers.dtype), valid)
    held, layer_of = _layer_of(model, projections)

    def step(carry, tu):
        u, t = tu
        X, held, lp, proj = layer_of(*carry, u)
        q, k, v = softmax_qkv(lp, full_attention_input(lp, X), positions, proj.qkv)
        M = softmax_mix(lp, q, k, v, valid)                                  # (n, H, e)
        Y = full_block(lp, X, head_output(lp, M.reshape(n, -1), keep_bias=True, out=proj.out))
        return (inert_padding(_added(Y, t, add, add_step), valid), held), (k, v)

    (Y, _), (k, v) = jax.lax.scan(step, (x0, held), _schedule(model))
    last = jnp.sum(valid.astype(jnp.int32)) - 1
    return Y[last], k, v


def prefill(model: Model, x0: Float[ArrayLike, "B n d"], valid: Bool[ArrayLike, "B n"], projections, *, size: int,
            chunk=None, add=None, add_step=None):
    """:func:`prefill_one` over the prompts (chunked on a CPU, :func:`~powerlens._src.dynamics.run.map_prompts`):
    (h "float[B d]" at each prompt's last valid token, a :class:`KVCache` of ``size`` >= n indices,
    the prompts' keys and values at 0 .. n-1, zeros after)."""
    from ..dynamics.run import map_prompts
    one = lambda x, vb: prefill_one(model, x, vb, projections, add, add_step)
    h, k, v = map_prompts(one, x0, valid, chunk, out_axes=(0, 1, 1))        # k, v (T, B, G, n, e)
    pad = [(0, 0)] * 3 + [(0, size - x0.shape[1]), (0, 0)]
    return h, KVCache(jnp.pad(k, pad), jnp.pad(v, pad))


def _decode_layer(lp, proj, x: Float[ArrayLike, "d"], pos: Int[ArrayLike, ""], ck: Float[ArrayLike, "G N e"],
                  cv: Float[ArrayLike, "G N e"]):
    """One step for one token x at position ``pos``: (its output "float[d]", its key and value
    "float[G e]"), attending over the cache's keys 0 .. pos (the new one written at pos) within
    the layer's window."""
    X = x[None]
    q, k, v = softmax_qkv(lp, full_attention_input(lp, X), pos[None], proj.qkv)     # (H, 1, e), (G, 1, e)
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, pos, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, pos, 0))
    j = jnp.arange(ck.shape[1])
    ok = (j <= pos) & ((lp.window <= 0) | (j > pos - lp.window))
    bias = jnp.where(ok, 0, jnp.finfo(q.dtype).min).astype(q.dtype)[None]            # (1, N)
    M = dense_softmax_mix(lp, q, ck, cv, bias)                                       # (H, 1, e)
    Y = full_block(lp, X, head_output(lp, M.reshape(1, -1), keep_bias=True, out=proj.out))
    return Y[0], k[:, 0], v[:, 0]


UNROLL_BYTES = 1 << 30
"""The most bytes of layer weights for which :func:`decode_layers` keeps each layer's own
buffers (CPU only): a second copy of every layer's weights, kept while they live."""

UNROLL_MIN_TOKENS = 64
"""``generate(unroll=None)`` writes the decoding step out layer by layer (:func:`decode_layers`)
from this many new tokens on: the step is faster, its program slower to compile (SmolLM2,
one thread, on a loaded 2-core machine: 41 against 55 ms a token, about twice the compile time)."""


def decode_layers(model: Model, projections, force: bool = False):
    """Each unique layer's weights as its own buffers, for a decoding step written out layer by
    layer (:func:`decode_step`'s ``unrolled``), or None where the scan over the stacked layers is used.

    On the CPU a step of one token per row is bound by reading the weights, and XLA reads a
    layer's slice of a stacked array through a copy, and the FFN's (out, in) rows through a
    transposed one: on SmolLM2 (30 layers, one thread) the scan took 55-56 ms a token, this
    41 ms. So, on the CPU only (any platform with ``force``), for weights held in their compute
    dtype with prepared ``projections`` and at most :data:`UNROLL_BYTES` of them (any amount with
    ``force``), each unique layer u is
    (its parameters without the FFN matrices, its projections, (W_in, W_gate, W_out) held
    (in, out)), built once per set of weights (:func:`~powerlens._src.dynamics.cache.per_arrays`).
    The price is a second copy of the layers' weights while they live, and a compiled program
    that grows with the number of layers."""
    from ..dynamics.cache import per_arrays
    from ..dynamics.run import platform_of
    layers = model.layers
    leaves = jax.tree_util.tree_leaves(layers)
    if (projections is None or layers.dtype != layers.storage_dtype or layers.W_in is None
            or not force and (platform_of(layers.W_v) != "cpu" or sum(a.nbytes for a in leaves) > UNROLL_BYTES)):
        return None
    return per_arrays("decode_layers", leaves + jax.tree_util.tree_leaves(projections),
                      lambda: _split_layers(layers, projections))


@jax.jit
def _split_layers(layers, projections):
    cols = lambda a: None if a is None else jnp.swapaxes(a, -1, -2)
    out = []
    for u in range(layers.n_unique):
        lp = layers.layer(u)
        out.append((lp.replace(W_in=None, W_gate=None, W_out=None), projections.layer(u),
                    (cols(lp.W_in), cols(lp.W_gate), cols(lp.W_out))))
    return tuple(out)


def decode_step(model: Model, x: Float[ArrayLike, "B d"], positions: Int[ArrayLike, "B"], cache: KVCache, projections, *,
           add=None, add_step=None, unrolled=None):
    """One new token per row, x "float[B d]" (embedded) at ``positions`` "int[B]": (its final
    state "float[B d]", the cache with each row's keys and values written at its position).
    The cache is read by the steps, then written once, in place. ``unrolled``: the layers of
    :func:`decode_layers`, one traced step each; None: one ``lax.scan`` over the stacked layers."""
    decode_rows = jax.vmap(_decode_layer, in_axes=(None, None, 0, 0, 0, 0))
    held, layer_of = _layer_of(model, projections)

    def step(carry, xs):
        u, t, ck, cv = xs
        X, held, lp, proj = layer_of(*carry, u)
        Y, k, v = decode_rows(lp, proj, X, positions, ck, cv)
        return (_added(Y, t, add, add_step), held), (k, v)

    if unrolled is not None:        # one traced step per schedule step, each reading its layer's own buffers
        X, ks, vs = x.astype(model.layers.dtype), [], []
        for t, u in enumerate(model.layers.schedule):
            lp, proj, (W_in, W_gate, W_out) = unrolled[u]
            rows = lambda a: None if a is None else jnp.swapaxes(a, 0, 1)      # ffn's own X @ W^T undoes it
            lp = lp.replace(W_in=rows(W_in), W_gate=rows(W_gate), W_out=rows(W_out))
            X, k, v = decode_rows(lp, proj, X, positions, cache.k[t], cache.v[t])
            X = _added(X, t, add, add_step)
            ks.append(k)
            vs.append(v)
        h, k, v = X, jnp.stack(ks), jnp.stack(vs)
    else:
        (h, _), (k, v) = jax.lax.scan(step, (x.astype(model.layers.dtype), held),
                                      (*_schedule(model), cache.k, cache.v))
    rows = jnp.arange(x.shape[0])
    # cache.k[:, rows, :, positions] is "float[B T G e]" (the advanced indices first)
    put = lambda c, new: c.at[:, rows, :, positions].set(jnp.swapaxes(new, 0, 1).astype(c.dtype))
    return h, KVCache(put(cache.k, k), put(cache.v, v))
