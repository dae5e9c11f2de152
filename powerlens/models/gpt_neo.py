"""GPT-Neo converter (Hugging Face ``model_type`` ``gpt_neo``).

Pre-LN blocks like GPT-2 but with ``nn.Linear`` weights (out, in), so no transpose::

    attn.attention.{q,k,v}_proj.weight (H*e, d), no bias  ->  W_{q,k,v} = w.reshape(H, e, d)
    attn.attention.out_proj.weight (d, H*e) + bias        ->  W_o, b_o
    mlp.c_fc (f, d) + bias, mlp.c_proj (d, f) + bias      ->  W_in, b_in, W_out, b_out

The attention scores are NOT scaled (scale = 1). Layer types come from
``attention_types`` (expanded as Hugging Face does: ``[[["global", "local"], 12]]`` ->
global, local, global, ...); a ``local`` layer gets ``window = window_size``, so that
query i sees keys j with ``i - window_size < j <= i`` — HF's mask
``tril(ones) xor tril(ones, -window_size)``.
"""
from __future__ import annotations

import numpy as np

from .base import Model, register
from .gpt2 import Stack, activation, pre_ln_decoder, require
from .reader import CheckpointError


def attention_layers(config: dict, n_layers: int, source: str):
    """Per-layer ``global``/``local`` list expanded from ``attention_types``, as Hugging Face
    does (it recomputes ``attention_layers`` from ``attention_types`` when loading a config)."""
    types = config.get("attention_types")
    if types is None:
        layers = config.get("attention_layers")
        if layers is None:
            types = [[["global", "local"], 12]]
    if types is not None:
        try:
            layers = [t for kinds, count in types for _ in range(int(count)) for t in kinds]
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: cannot read attention_types={types!r} ({exc})") from exc
    layers = list(layers)
    bad = sorted(set(layers) - {"global", "local"})
    if bad:
        raise CheckpointError(f"{source}: unsupported GPT-Neo attention type(s) {bad} in attention_types "
                              f"(expected 'global' or 'local')")
    if len(layers) != n_layers:
        raise CheckpointError(
            f"{source}: attention_types give {len(layers)} layer types but num_layers={n_layers}")
    return layers


@register("gpt_neo")
def convert_gpt_neo(config: dict, reader, dtype, name: str) -> Model:
    src = reader.folder
    d = int(require(config, "hidden_size", src, "n_embd"))
    H = int(require(config, "num_heads", src, "num_attention_heads"))
    L = int(require(config, "num_layers", src, "num_hidden_layers"))
    P = int(require(config, "max_position_embeddings", src))
    V = int(require(config, "vocab_size", src))
    if d % H:
        raise CheckpointError(f"{src}: hidden_size={d} is not a multiple of num_heads={H}")
    e = d // H
    f = int(config.get("intermediate_size") or 4 * d)
    act = activation(config, "activation_function", src)
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    kinds = attention_layers(config, L, src)
    window_size = int(config.get("window_size", 256))
    if window_size <= 0 and "local" in kinds:
        raise CheckpointError(f"{src}: window_size={window_size} must be positive for local attention layers")
    window = np.array([window_size if k == "local" else 0 for k in kinds], np.int32)

    st = Stack(L, dtype, {
        "W_q": (H, e, d), "W_k": (H, e, d), "W_v": (H, e, d), "W_o": (d, d), "b_o": (d,),
        "norm_scale": (d,), "norm_bias": (d,), "ffn_norm_scale": (d,), "ffn_norm_bias": (d,),
        "W_in": (f, d), "b_in": (f,), "W_out": (d, f), "b_out": (d,),
    })
    for i in range(L):
        p = f"h.{i}."
        a = p + "attn.attention."
        for w in ("q", "k", "v"):
            st[f"W_{w}"][i] = reader.get(a + f"{w}_proj.weight", (d, d)).reshape(H, e, d)
        st["W_o"][i] = reader.get(a + "out_proj.weight", (d, d))
        st["b_o"][i] = reader.get(a + "out_proj.bias", (d,))
        st["norm_scale"][i] = reader.get(p + "ln_1.weight", (d,))
        st["norm_bias"][i] = reader.get(p + "ln_1.bias", (d,))
        st["ffn_norm_scale"][i] = reader.get(p + "ln_2.weight", (d,))
        st["ffn_norm_bias"][i] = reader.get(p + "ln_2.bias", (d,))
        st["W_in"][i] = reader.get(p + "mlp.c_fc.weight", (f, d))
        st["b_in"][i] = reader.get(p + "mlp.c_fc.bias", (f,))
        st["W_out"][i] = reader.get(p + "mlp.c_proj.weight", (d, f))
        st["b_out"][i] = reader.get(p + "mlp.c_proj.bias", (d,))
    for w in ("q", "k", "v"):
        if reader.has(f"h.0.attn.attention.{w}_proj.bias"):
            raise CheckpointError(f"{src}: unexpected tensor h.0.attn.attention.{w}_proj.bias "
                                  f"(GPT-Neo's q/k/v projections have no bias)")

    return pre_ln_decoder("gpt_neo", config, reader, st, d=d, H=H, e=e, eps=eps, act=act, V=V, P=P,
                          scale=1.0, window=window, src=src, name=name)
