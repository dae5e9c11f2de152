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
from .convert import WINDOW_MAX, Stack, require
from .gpt2 import DECODER_HANDLED, SUMMARY_HEAD, decoder_config, pre_ln_decoder
from .layout import LINEAR
from .reader import CheckpointError

GPT_NEO_HANDLED = DECODER_HANDLED | {"hidden_size", "n_embd", "num_heads", "num_attention_heads", "num_layers",
                                     "num_hidden_layers", "max_position_embeddings", "intermediate_size",
                                     "attention_types", "attention_layers", "window_size"}
# dropout, and the summary head that GPT-Neo configs of transformers 4.x still carried
GPT_NEO_NEUTRAL = SUMMARY_HEAD | {"resid_dropout", "embed_dropout", "attention_dropout", "classifier_dropout"}

GPT_NEO_SIZES = dict(width=("hidden_size", "n_embd"), heads=("num_heads", "num_attention_heads"),
                     layers=("num_layers", "num_hidden_layers"), positions=("max_position_embeddings",),
                     ffn="intermediate_size")

# stacked field -> tensor name inside block ``h.{i}.`` (besides the q/k/v projections)
GPT_NEO_NAMES = {
    "W_o": "attn.attention.out_proj.weight", "b_o": "attn.attention.out_proj.bias",
    "norm_scale": "ln_1.weight", "norm_bias": "ln_1.bias", "ffn_norm_scale": "ln_2.weight", "ffn_norm_bias": "ln_2.bias",
    "W_in": "mlp.c_fc.weight", "b_in": "mlp.c_fc.bias", "W_out": "mlp.c_proj.weight", "b_out": "mlp.c_proj.bias",
}


def attention_layers(config: dict, n_layers: int, source: str):
    """Per-layer ``global``/``local`` list expanded from ``attention_types``, as Hugging Face
    does (it recomputes ``attention_layers`` from ``attention_types`` when loading a config).
    The layers are counted before the list is expanded, so a huge count costs nothing."""
    types = config.get("attention_types")
    if types is None:
        layers = config.get("attention_layers")
        if layers is None:
            types = [[["global", "local"], 12]]
    if types is not None:
        layers = _expand_attention_types(types, n_layers, source)
    if not isinstance(layers, list):
        raise CheckpointError(f"{source}: attention_layers must be a list of 'global'/'local', got {layers!r}")
    bad = sorted({repr(t) for t in layers} - {"'global'", "'local'"})
    if bad:
        raise CheckpointError(f"{source}: unsupported GPT-Neo attention type(s) [{', '.join(bad)}] in "
                              f"attention_types (expected 'global' or 'local')")
    if len(layers) != n_layers:
        raise CheckpointError(
            f"{source}: attention_types give {len(layers)} layer types but num_layers={n_layers}")
    return layers


def _expand_attention_types(types, n_layers: int, source: str):
    """``[[kinds, count], ...]`` -> the per-layer list, once its length is known to be ``n_layers``."""
    try:
        groups = [(list(kinds), count) for kinds, count in types]
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: cannot read attention_types={types!r} ({exc})") from exc
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for _, c in groups):
        raise CheckpointError(f"{source}: attention_types={types!r}: each count must be a non-negative integer")
    total = sum(len(kinds) * count for kinds, count in groups)
    if total != n_layers:
        raise CheckpointError(f"{source}: attention_types give {total} layer types but num_layers={n_layers}")
    return [t for kinds, count in groups for _ in range(count) for t in kinds]


@register("gpt_neo", output_layout=LINEAR)
def convert_gpt_neo(config: dict, reader, dtype, name: str) -> Model:
    src, (d, H, e, L, P, V, f, act, eps) = decoder_config(config, reader, "gpt_neo", GPT_NEO_HANDLED,
                                                          GPT_NEO_NEUTRAL, **GPT_NEO_SIZES)
    kinds = attention_layers(config, L, src)
    window_size = require(config, "window_size", src, default=256, maximum=WINDOW_MAX) if "local" in kinds else 0
    window = np.array([window_size if k == "local" else 0 for k in kinds], np.int32)

    st = Stack(L, dtype, {
        "W_q": (H, e, d), "W_k": (H, e, d), "W_v": (H, e, d), "W_o": (d, d), "b_o": (d,),
        "norm_scale": (d,), "norm_bias": (d,), "ffn_norm_scale": (d,), "ffn_norm_bias": (d,),
        "W_in": (f, d), "b_in": (f,), "W_out": (d, f), "b_out": (d,),
    }, reader.folder)
    for i in range(L):    # nn.Linear (out, in) is powerlens's layout: every tensor goes straight into its slot
        for w in ("q", "k", "v"):
            st.read(f"W_{w}", i, reader, f"h.{i}.attn.attention.{w}_proj.weight", (d, d))
        for key, tensor in GPT_NEO_NAMES.items():
            st.read(key, i, reader, f"h.{i}.{tensor}")
    for w in ("q", "k", "v"):
        if reader.has(f"h.0.attn.attention.{w}_proj.bias"):
            raise CheckpointError(f"{reader.folder}: unexpected tensor h.0.attn.attention.{w}_proj.bias "
                                  f"(GPT-Neo's q/k/v projections have no bias)")

    return pre_ln_decoder("gpt_neo", config, reader, st, d=d, H=H, e=e, eps=eps, act=act, V=V, P=P,
                          scale=1.0, window=window, name=name)
