"""GPT-2 converter (Hugging Face ``model_type`` ``gpt2``).

GPT-2 stores its projections as ``Conv1D`` weights of shape (in, out) and applies
them as ``y = x @ W + b``. In the column-vector convention of powerlens
(``y = W x``) every Conv1D weight is therefore transposed once::

    c_attn.weight (d, 3d) = [W_q^T | W_k^T | W_v^T]   ->  W_q = c_attn[:, :d].T.reshape(H, e, d)
    attn.c_proj.weight (H*e, d)                        ->  W_o = c_proj.T            (d, H*e)
    mlp.c_fc.weight (d, f)                             ->  W_in = c_fc.T             (f, d)
    mlp.c_proj.weight (f, d)                           ->  W_out = c_proj.T          (d, f)

A wrong transpose keeps the eigenvalues of F = W_o V_cat (F and F^T share them) but
not its eigenvectors, so the tests compare F with the torch weights directly. Because
``c_proj.weight`` stores W_o^T, the family registers ``output_layout=CONV1D``: a change
ΔO of W_o is written back into the checkpoint as ΔO^T (:mod:`powerlens._src.models.layout`).

Block (pre-LN): h = x + attn(ln_1 x); out = h + mlp(ln_2 h); final ``ln_f``. Softmax
scale: 1/sqrt(e) if ``scale_attn_weights`` (else 1), divided by (layer_idx + 1) when
``scale_attn_by_inverse_layer_idx``. ``reorder_and_upcast_attn`` only changes the
numerics of half-precision runs (the scores are computed in float32), so it is
accepted for float32/float64 models.
"""
from __future__ import annotations

import numpy as np

from ..dynamics.params import LayerConfig, make_layers
from ..dynamics.parts import FFN, Attention, Norms
from .base import Model, ModelInfo, register
from .convert import (Stack, activation, check_config, check_layer_count, config_file, given_key, head_size,
                      lm_head, read_tensors, require, require_all, tokenizer_folder)
from .layout import CONV1D

# ---------------------------------------------------------------------- config allow-lists
# read by both pre-LN decoders (GPT-2 and GPT-Neo)
DECODER_HANDLED = frozenset({"vocab_size", "activation_function", "layer_norm_epsilon", "tie_word_embeddings",
                             "pad_token_id", "bos_token_id"})
# the sequence-summary head of the ...DoubleHeads / classification models, never run
SUMMARY_HEAD = frozenset({"summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                          "summary_first_dropout"})
GPT2_HANDLED = DECODER_HANDLED | {"n_embd", "hidden_size", "n_head", "num_attention_heads", "n_layer",
                                  "num_hidden_layers", "n_positions", "max_position_embeddings", "n_inner",
                                  "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                                  "reorder_and_upcast_attn"}
# dropout; ``n_ctx`` is the pre-4.0 name of the context size, unused by the forward pass
GPT2_NEUTRAL = SUMMARY_HEAD | {"resid_pdrop", "embd_pdrop", "attn_pdrop", "n_ctx"}


# the size attributes of a config: (key, alias) pairs, and the FFN width key
GPT2_SIZES = dict(width=("n_embd", "hidden_size"), heads=("n_head", "num_attention_heads"),
                  layers=("n_layer", "num_hidden_layers"), positions=("n_positions", "max_position_embeddings"),
                  ffn="n_inner")


def decoder_config(config: dict, reader, family: str, handled, neutral, *, width, heads, layers, positions, ffn: str):
    """Check a pre-LN decoder config (GPT-2, GPT-Neo) against its allow-list and read its sizes.

    ``width``, ``heads``, ``layers``, ``positions``: the family's key and its alias (see
    :func:`~powerlens._src.models.convert.require_all`); ``ffn``: the FFN width key (absent or
    null: 4 d). Returns (config.json path, (d, H, e, L, P, V, f, activation, eps)).
    """
    src = config_file(reader)
    check_config(config, src, family, handled=handled, neutral=neutral)
    d, H, L, P, V = require_all(config, src, d=width, H=heads, L=layers, P=positions, V="vocab_size")
    e = head_size(d, H, src, d_key=width[0], h_key=heads[0])
    check_layer_count(L, given_key(config, *layers), reader.names(), "h.", src)
    f = require(config, ffn, src, default=4 * d)
    act = activation(config, "activation_function", src, "gelu_new")
    return src, (d, H, e, L, P, V, f, act, require(config, "layer_norm_epsilon", src, kind=float, default=1e-5))


# ---------------------------------------------------------------------- converter
@register("gpt2", output_layout=CONV1D)
def convert_gpt2(config: dict, reader, dtype, name: str) -> Model:
    _, (d, H, e, L, P, V, f, act, eps) = decoder_config(config, reader, "gpt2", GPT2_HANDLED, GPT2_NEUTRAL,
                                                        **GPT2_SIZES)

    scale = np.full((L,), e ** -0.5 if config.get("scale_attn_weights", True) else 1.0, np.float64)
    if config.get("scale_attn_by_inverse_layer_idx", False):
        scale = scale / (np.arange(L) + 1.0)

    st = Stack(L, dtype, {
        "W_q": (H, e, d), "W_k": (H, e, d), "W_v": (H, e, d), "W_o": (d, d),
        "b_q": (H, e), "b_k": (H, e), "b_v": (H, e), "b_o": (d,),
        "norm_scale": (d,), "norm_bias": (d,), "ffn_norm_scale": (d,), "ffn_norm_bias": (d,),
        "W_in": (f, d), "b_in": (f,), "W_out": (d, f), "b_out": (d,),
    }, reader.folder)
    for i in range(L):
        p = f"h.{i}."
        c = reader.get(p + "attn.c_attn.weight", (d, 3 * d))           # (in, out)
        cb = reader.get(p + "attn.c_attn.bias", (3 * d,))
        for j, w in enumerate(("q", "k", "v")):
            st[f"W_{w}"][i] = c[:, j * d:(j + 1) * d].T.reshape(H, e, d)
            st[f"b_{w}"][i] = cb[j * d:(j + 1) * d].reshape(H, e)
        del c
        st["W_o"][i] = reader.get(p + "attn.c_proj.weight", (d, d)).T
        st["b_o"][i] = reader.get(p + "attn.c_proj.bias", (d,))
        st["norm_scale"][i] = reader.get(p + "ln_1.weight", (d,))
        st["norm_bias"][i] = reader.get(p + "ln_1.bias", (d,))
        if not st.wants("W_in"):                 # a load without the FFN never reads it
            continue
        st["ffn_norm_scale"][i] = reader.get(p + "ln_2.weight", (d,))
        st["ffn_norm_bias"][i] = reader.get(p + "ln_2.bias", (d,))
        st["W_in"][i] = reader.get(p + "mlp.c_fc.weight", (d, f)).T
        st["b_in"][i] = reader.get(p + "mlp.c_fc.bias", (f,))
        st["W_out"][i] = reader.get(p + "mlp.c_proj.weight", (f, d)).T
        st["b_out"][i] = reader.get(p + "mlp.c_proj.bias", (d,))

    return pre_ln_decoder("gpt2", config, reader, st, d=d, H=H, e=e, eps=eps, act=act, V=V, P=P,
                          scale=scale, window=0, name=name)


def pre_ln_decoder(family, config, reader, st, *, d, H, e, eps, act, V, P, scale, window, name) -> Model:
    """The part GPT-2 and GPT-Neo share: a causal pre-LN stack with word + position
    embeddings (wte, wpe), a final LayerNorm (ln_f) and a tied or separate LM head."""
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=True, norm="layernorm", norm_eps=eps,
                      norm_placement="pre", ffn_activation=act)
    a = st.finish()     # attention with biases, LN1/LN2 with biases, FFN (absent from an attention-only load)
    layers = make_layers(attn=Attention.take(a, scale=scale, window=np.asarray(window, np.int32)),
                         norms=Norms.take(a), ffn=FFN.take(a), config=cfg, **a)
    embeddings = read_tensors(reader, {"word": "wte.weight", "position": "wpe.weight"},
                              {"word": (V, d), "position": (P, d)})
    final = read_tensors(reader, {"scale": "ln_f.weight", "bias": "ln_f.bias"}, {"scale": (d,), "bias": (d,)})
    src = reader.folder
    info = ModelInfo(family=family, source=src, tokenizer=tokenizer_folder(src), max_positions=P, decoder=True,
                     final_norm_in_hidden_states=True, pad_token_id=config.get("pad_token_id"),
                     bos_token_id=config.get("bos_token_id"), name=name)
    return Model(layers=layers, embeddings=embeddings, final_norm_scale=final["scale"],
                 final_norm_bias=final["bias"], lm_head=lm_head(config, reader, (V, d)), info=info)
