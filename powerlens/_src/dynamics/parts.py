"""The parts a stack of layers is built from: :class:`Attention`, :class:`Norms` and an optional
:class:`FFN`, each a pytree of stacked arrays (leading axis U, the unique layers) with its own
shapes and its own rule for splitting over a mesh's ``model`` axis.

Shapes (U = unique layers, H = query heads, G = key/value heads, e = d_head, d = model
width, f = FFN width) are given in each class's docstring; one unique layer
(``layers.layer(u)``) has the same parts with the leading U removed.

Sharding rule (``SPLIT``, one entry per field; read by :func:`powerlens._src.models.shard.placements`):
``(axis, count)`` names the axis of the stacked array that is split over ``model`` and what it
counts (``n_heads``, ``n_kv_heads``: a config attribute, the split made in whole heads;
``ffn``: the FFN width f, the axis's own length); ``None`` replicates the array. A count that
the ``model`` axis's size does not divide leaves the array replicated (2 KV heads over 8
devices, while the 8 query heads are split). The leading U is never split: a scan step reads
one whole layer.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

import jax

from . import struct


class _Part:
    """What every part shares: its field names and building it from a dict of named arrays."""

    SPLIT: Mapping[str, Optional[Tuple[int, str]]] = {}

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        """The part's field names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def take(cls, arrays: Dict[str, object], **given):
        """The part built from the entries of ``arrays`` named after its fields (removed from
        ``arrays``) and ``given``; None when none of its fields is given (an absent part)."""
        values = {k: arrays.pop(k) for k in cls.names() if k in arrays}
        values.update(given)
        if all(v is None for v in values.values()):
            return None
        return cls(**values)

    def arrays(self) -> Dict[str, jax.Array]:
        """The part's arrays that are present, by field name."""
        return {k: getattr(self, k) for k in self.names() if getattr(self, k) is not None}


@struct.dataclass
class Attention(_Part):
    """The attention sub-layer of U unique layers.

    Column-vector maths: a token x maps to ``F x`` with ``F = sum_h O_h V_h = W_o @ concat_h(V_h)``;
    with grouped-query attention query head h uses key/value head ``h // (H // G)``::

        W_q "float[U H e d]"   b_q "float[U H e]"      (W_q, W_k None: a spectrum-only load,
        W_k "float[U G e d]"   b_k "float[U G e]"       or uniform/identity attention)
        W_v "float[U G e d]"   b_v "float[U G e]"
        W_o "float[U d H*e]"   b_o "float[U d]"
        scale  "float[U]"   softmax scale of each layer (1/sqrt(e) for most families)
        window "int32[U]"   local attention window (0 = global)
        q_norm_scale / k_norm_scale "float[U e]"   per-head norm of q and k before RoPE, of the
        q_norm_bias / k_norm_bias   "float[U e]"   config's ``norm`` kind (RMSNorm: Qwen3, Gemma 3;
                                                   LayerNorm with the biases: Phi's ``qk_layernorm``)
        rope_base "float[U]"   per-layer RoPE base (Gemma 3: 1e4 local, 1e6 global layers);
                               absent = ``config.rope_theta`` on every layer

    Sharding: W_q, b_q on their H query heads, W_o on its H*e columns in whole heads; W_k, W_v,
    b_k, b_v on their G key/value heads; everything else replicated.
    """

    W_v: jax.Array
    W_o: jax.Array
    W_q: Optional[jax.Array] = None
    W_k: Optional[jax.Array] = None
    scale: Optional[jax.Array] = None
    window: Optional[jax.Array] = None
    b_q: Optional[jax.Array] = None
    b_k: Optional[jax.Array] = None
    b_v: Optional[jax.Array] = None
    b_o: Optional[jax.Array] = None
    q_norm_scale: Optional[jax.Array] = None
    k_norm_scale: Optional[jax.Array] = None
    q_norm_bias: Optional[jax.Array] = None
    k_norm_bias: Optional[jax.Array] = None
    rope_base: Optional[jax.Array] = None

    SPLIT = {
        "W_q": (1, "n_heads"), "b_q": (1, "n_heads"), "W_o": (2, "n_heads"),
        "W_k": (1, "n_kv_heads"), "b_k": (1, "n_kv_heads"), "W_v": (1, "n_kv_heads"), "b_v": (1, "n_kv_heads"),
        **{name: None for name in ("scale", "window", "b_o", "q_norm_scale", "k_norm_scale", "q_norm_bias",
                                   "k_norm_bias", "rope_base")},
    }


@struct.dataclass
class Norms(_Part):
    """The norms of U unique layers (kind and eps: the config's ``norm``, ``norm_eps``)::

        norm_scale / norm_bias "float[U d]"           the attention sub-layer's norm (LN1)
        ffn_norm_scale / ffn_norm_bias "float[U d]"   the FFN sub-layer's norm (LN2; absent in a
                                                      parallel block that shares LN1, as Phi)
        post_attn_norm_scale / post_ffn_norm_scale "float[U d]"   sandwich norms (Gemma 2/3):
            each sub-layer's output is normed before it joins the residual

    Any of them may be absent (None): an ``l2`` synthetic system has none. Sharding: all replicated.
    """

    norm_scale: Optional[jax.Array] = None
    norm_bias: Optional[jax.Array] = None
    ffn_norm_scale: Optional[jax.Array] = None
    ffn_norm_bias: Optional[jax.Array] = None
    post_attn_norm_scale: Optional[jax.Array] = None
    post_ffn_norm_scale: Optional[jax.Array] = None

    SPLIT = {name: None for name in ("norm_scale", "norm_bias", "ffn_norm_scale", "ffn_norm_bias",
                                     "post_attn_norm_scale", "post_ffn_norm_scale")}


@struct.dataclass
class FFN(_Part):
    """The feed-forward network of U unique layers (activation: the config's ``ffn_activation``)::

        W_in   "float[U f d]"   b_in  "float[U f]"
        W_gate "float[U f d]"   (gated activations ``silu_glu``, ``gelu_glu``: act(W_gate x) * W_in x)
        W_out  "float[U d f]"   b_out "float[U d]"

    FFN(x) = W_out act(W_in x + b_in) + b_out. A validated part has W_in and W_out
    (:func:`~powerlens._src.dynamics.params.make_layers`). Sharding: W_in, W_gate, b_in on f, W_out on
    its f columns; b_out replicated.
    """

    W_in: Optional[jax.Array] = None
    W_out: Optional[jax.Array] = None
    b_in: Optional[jax.Array] = None
    W_gate: Optional[jax.Array] = None
    b_out: Optional[jax.Array] = None

    SPLIT = {"W_in": (1, "ffn"), "b_in": (1, "ffn"), "W_gate": (1, "ffn"), "W_out": (2, "ffn"), "b_out": None}


PARTS = {"attn": Attention, "norms": Norms, "ffn": FFN}
"""The field of :class:`~powerlens._src.dynamics.params.Layers` that holds each part, and its class."""
