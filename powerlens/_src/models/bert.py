"""BERT, RoBERTa and DistilBERT checkpoints -> :class:`~powerlens._src.models.base.Model`.

All three are post-LN encoders. Layer t (Hugging Face torch ``nn.Linear`` weights are
stored (out, in), so a token x maps to ``W x + b``)::

    h  = LN_1(X + Attn(X))            Attn(X)_i = sum_h W_o[:, h] (A_h X W_vh^T + b_vh)_i + b_o
    X' = LN_2(h + W_out act(W_in h + b_in) + b_out)

with per-head slices of the fused projections: head h of ``query.weight`` (H*e, d) is
rows ``h*e:(h+1)*e``, so ``W_q = query.weight.reshape(H, e, d)`` (the same for k, v and
the biases, (H*e,) -> (H, e)); ``W_o = output.dense.weight`` (d, H*e) as stored.

Embeddings: ``x0 = LN_emb(word[ids] + position[pos] + token_type[0])`` (DistilBERT has no
token types); RoBERTa counts positions from ``pad_token_id + 1`` over non-padding
tokens, so it can embed at most ``max_position_embeddings - pad_token_id - 1`` tokens.

Tensor names (prefixes ``bert.``/``roberta.``/``distilbert.``/``transformer.`` stripped
by the reader)::

    BERT/RoBERTa  encoder.layer.{i}.attention.self.{query,key,value}.{weight,bias}
                  encoder.layer.{i}.attention.output.{dense,LayerNorm}.{weight,bias}
                  encoder.layer.{i}.intermediate.dense / output.dense / output.LayerNorm
    DistilBERT    layer.{i}.attention.{q_lin,k_lin,v_lin,out_lin}, layer.{i}.sa_layer_norm,
                  layer.{i}.ffn.{lin1,lin2}, layer.{i}.output_layer_norm

The encoder helpers here (:func:`read_layers`, the shared allow-lists) are used by the
ALBERT converter too; what every converter shares is in :mod:`powerlens._src.models.convert`.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

from ..dynamics.params import LayerConfig, Layers, make_layers
from ..dynamics.parts import FFN, Attention, Norms
from .base import Model, ModelInfo, register
from .convert import (Stack, activation, check_config, check_layer_count, config_file, head_size, read_tensors,
                      require, require_all, tokenizer_folder)
from .layout import LINEAR
from .reader import CheckpointError, TensorReader

# ---------------------------------------------------------------------- config allow-lists
# read by every encoder converter (BERT, RoBERTa, ALBERT)
ENCODER_HANDLED = frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                             "vocab_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
                             "hidden_act", "pad_token_id", "bos_token_id"})
# no effect on the encoder's forward pass: dropout, and the tied MLM head powerlens never runs
ENCODER_NEUTRAL = frozenset({"hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
                             "tie_word_embeddings"})
# accepted only at the default: relative position scores change the attention logits
ENCODER_ONLY = {"position_embedding_type": ("absolute",)}
DISTILBERT_HANDLED = frozenset({"dim", "n_heads", "n_layers", "hidden_dim", "vocab_size", "max_position_embeddings",
                                "activation", "pad_token_id", "sinusoidal_pos_embds"})
DISTILBERT_NEUTRAL = frozenset({"dropout", "attention_dropout", "qa_dropout", "seq_classif_dropout", "tie_weights_",
                                "tie_word_embeddings"})

# field -> (stored per-layer shape, target per-layer shape) as functions of (H, e, d, f)
_SHAPES: Dict[str, Callable[[int, int, int, int], Tuple[Tuple[int, ...], Tuple[int, ...]]]] = {
    "W_q": lambda H, e, d, f: ((H * e, d), (H, e, d)),
    "W_k": lambda H, e, d, f: ((H * e, d), (H, e, d)),
    "W_v": lambda H, e, d, f: ((H * e, d), (H, e, d)),
    "b_q": lambda H, e, d, f: ((H * e,), (H, e)),
    "b_k": lambda H, e, d, f: ((H * e,), (H, e)),
    "b_v": lambda H, e, d, f: ((H * e,), (H, e)),
    "W_o": lambda H, e, d, f: ((d, H * e), (d, H * e)),
    "b_o": lambda H, e, d, f: ((d,), (d,)),
    "norm_scale": lambda H, e, d, f: ((d,), (d,)),
    "norm_bias": lambda H, e, d, f: ((d,), (d,)),
    "W_in": lambda H, e, d, f: ((f, d), (f, d)),
    "b_in": lambda H, e, d, f: ((f,), (f,)),
    "W_out": lambda H, e, d, f: ((d, f), (d, f)),
    "b_out": lambda H, e, d, f: ((d,), (d,)),
    "ffn_norm_scale": lambda H, e, d, f: ((d,), (d,)),
    "ffn_norm_bias": lambda H, e, d, f: ((d,), (d,)),
}

BERT_NAMES = {
    "W_q": "encoder.layer.{i}.attention.self.query.weight",
    "b_q": "encoder.layer.{i}.attention.self.query.bias",
    "W_k": "encoder.layer.{i}.attention.self.key.weight",
    "b_k": "encoder.layer.{i}.attention.self.key.bias",
    "W_v": "encoder.layer.{i}.attention.self.value.weight",
    "b_v": "encoder.layer.{i}.attention.self.value.bias",
    "W_o": "encoder.layer.{i}.attention.output.dense.weight",
    "b_o": "encoder.layer.{i}.attention.output.dense.bias",
    "norm_scale": "encoder.layer.{i}.attention.output.LayerNorm.weight",
    "norm_bias": "encoder.layer.{i}.attention.output.LayerNorm.bias",
    "W_in": "encoder.layer.{i}.intermediate.dense.weight",
    "b_in": "encoder.layer.{i}.intermediate.dense.bias",
    "W_out": "encoder.layer.{i}.output.dense.weight",
    "b_out": "encoder.layer.{i}.output.dense.bias",
    "ffn_norm_scale": "encoder.layer.{i}.output.LayerNorm.weight",
    "ffn_norm_bias": "encoder.layer.{i}.output.LayerNorm.bias",
}

DISTILBERT_NAMES = {
    "W_q": "layer.{i}.attention.q_lin.weight",
    "b_q": "layer.{i}.attention.q_lin.bias",
    "W_k": "layer.{i}.attention.k_lin.weight",
    "b_k": "layer.{i}.attention.k_lin.bias",
    "W_v": "layer.{i}.attention.v_lin.weight",
    "b_v": "layer.{i}.attention.v_lin.bias",
    "W_o": "layer.{i}.attention.out_lin.weight",
    "b_o": "layer.{i}.attention.out_lin.bias",
    "norm_scale": "layer.{i}.sa_layer_norm.weight",
    "norm_bias": "layer.{i}.sa_layer_norm.bias",
    "W_in": "layer.{i}.ffn.lin1.weight",
    "b_in": "layer.{i}.ffn.lin1.bias",
    "W_out": "layer.{i}.ffn.lin2.weight",
    "b_out": "layer.{i}.ffn.lin2.bias",
    "ffn_norm_scale": "layer.{i}.output_layer_norm.weight",
    "ffn_norm_bias": "layer.{i}.output_layer_norm.bias",
}

EMBEDDING_NAMES = {
    "word": "embeddings.word_embeddings.weight",
    "position": "embeddings.position_embeddings.weight",
    "token_type": "embeddings.token_type_embeddings.weight",
    "norm_scale": "embeddings.LayerNorm.weight",
    "norm_bias": "embeddings.LayerNorm.bias",
}


# ---------------------------------------------------------------------- tensors
def read_layers(reader: TensorReader, names: Dict[str, str], indices, config: LayerConfig,
                f: int, dtype) -> Layers:
    """Read every field of ``names`` for the unique layers ``indices`` into :class:`Layers` of ``dtype``.

    ``names``: field -> tensor-name template, formatted with each dict of ``indices`` (one
    per unique layer). Each tensor is read straight into its slot of a stacked (U, ...)
    array (:class:`~powerlens._src.models.convert.Stack`), which goes to JAX when full.
    """
    H, e, d = config.n_heads, config.d_head, config.d_model
    shapes = {field: _SHAPES[field](H, e, d, f) for field in names}     # (stored, target)
    st = Stack(len(indices), dtype, {field: target for field, (_, target) in shapes.items()}, reader.folder)
    for field, template in names.items():
        for u, idx in enumerate(indices):
            st.read(field, u, reader, template.format(**idx), shapes[field][0])
        st.done(field)
    try:
        a = st.finish()     # attention with q/k/v/o biases, post-LN norms with biases, FFN with biases
        return make_layers(attn=Attention.take(a), norms=Norms.take(a), ffn=FFN.take(a), config=config, **a)
    except ValueError as exc:  # pragma: no cover - the reader already checks shapes/finiteness
        raise CheckpointError(f"{reader.folder}: {exc}") from exc


# ---------------------------------------------------------------------- converters
def encoder_sizes(config: dict, source: str):
    """(d, H, e, L, f, V, P, T, eps) of a BERT-like config (BERT, RoBERTa, ALBERT)."""
    d, H, L, f, V, P = require_all(config, source, d="hidden_size", H="num_attention_heads", L="num_hidden_layers",
                                   f="intermediate_size", V="vocab_size", P="max_position_embeddings")
    T = require(config, "type_vocab_size", source, default=2)
    eps = require(config, "layer_norm_eps", source, kind=float, default=1e-12)
    return d, H, head_size(d, H, source), L, f, V, P, T, eps


@register("bert", "roberta", output_layout=LINEAR)
def convert_bert(config: dict, reader: TensorReader, dtype, name: str = "") -> Model:
    """BERT or RoBERTa (``model_type`` decides the position offset) -> Model."""
    family = config.get("model_type", "bert")
    src = config_file(reader)
    check_config(config, src, family, handled=ENCODER_HANDLED, neutral=ENCODER_NEUTRAL, only=ENCODER_ONLY)
    d, H, e, L, f, V, P, T, eps = encoder_sizes(config, src)
    check_layer_count(L, "num_hidden_layers", reader.names(), "encoder.layer.", src)
    act = activation(config, "hidden_act", src, "gelu")
    pad = config.get("pad_token_id", 1 if family == "roberta" else 0)
    offset = 0
    if family == "roberta":
        if pad is None:
            raise CheckpointError(f"{src}: RoBERTa needs pad_token_id (its positions start after it)")
        offset = int(pad) + 1
        if offset >= P:
            raise CheckpointError(f"{src}: pad_token_id={pad} leaves no positions out of max_position_embeddings={P}")
    # embeddings first, while nothing else is resident (keeps peak memory low)
    emb = read_tensors(reader, EMBEDDING_NAMES, {"word": (V, d), "position": (P, d), "token_type": (T, d),
                                                 "norm_scale": (d,), "norm_bias": (d,)}, dtype)
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=False, norm="layernorm", norm_eps=eps,
                      norm_placement="post", ffn_activation=act)
    layers = read_layers(reader, BERT_NAMES, [dict(i=i) for i in range(L)], cfg, f, dtype)
    info = ModelInfo(family=family, source=reader.folder, tokenizer=tokenizer_folder(reader.folder),
                     max_positions=P, pad_token_id=pad, bos_token_id=config.get("bos_token_id"),
                     position_offset=offset, name=name)
    return Model(layers=layers, embeddings=emb, info=info)


@register("distilbert", output_layout=LINEAR)
def convert_distilbert(config: dict, reader: TensorReader, dtype, name: str = "") -> Model:
    """DistilBERT -> Model (LayerNorm eps fixed at 1e-12 as in Hugging Face; no token types).

    With ``sinusoidal_pos_embds`` the sinusoidal table is stored in the checkpoint like a
    learned one, so it is simply read.
    """
    src = config_file(reader)
    check_config(config, src, "distilbert", handled=DISTILBERT_HANDLED, neutral=DISTILBERT_NEUTRAL,
                 only=ENCODER_ONLY)
    d, H, L, f, V, P = require_all(config, src, d="dim", H="n_heads", L="n_layers", f="hidden_dim", V="vocab_size",
                                   P="max_position_embeddings")
    e = head_size(d, H, src, d_key="dim", h_key="n_heads")
    check_layer_count(L, "n_layers", reader.names(), "layer.", src)
    act = activation(config, "activation", src, "gelu")
    eps = 1e-12
    names = {k: v for k, v in EMBEDDING_NAMES.items() if k != "token_type"}
    emb = read_tensors(reader, names, {"word": (V, d), "position": (P, d), "norm_scale": (d,), "norm_bias": (d,)},
                       dtype)
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=False, norm="layernorm", norm_eps=eps,
                      norm_placement="post", ffn_activation=act)
    layers = read_layers(reader, DISTILBERT_NAMES, [dict(i=i) for i in range(L)], cfg, f, dtype)
    info = ModelInfo(family="distilbert", source=reader.folder, tokenizer=tokenizer_folder(reader.folder),
                     max_positions=P, pad_token_id=config.get("pad_token_id", 0), name=name)
    return Model(layers=layers, embeddings=emb, info=info)
