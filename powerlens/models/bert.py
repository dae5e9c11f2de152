"""BERT, RoBERTa and DistilBERT checkpoints -> :class:`~powerlens.models.base.Model`.

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

The encoder helpers here (:func:`read_layers`, :func:`ffn_activation`,
:func:`reject_unhandled`, :func:`tokenizer_folder`) are shared with the ALBERT converter.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Tuple

import jax
import numpy as np

from ..dynamics.params import LayerConfig, Layers, make_layers
from .base import Model, ModelInfo, register
from .reader import CheckpointError, TensorReader, aligned_empty, to_device

# Hugging Face ``hidden_act`` -> powerlens ffn_activation. ``gelu_pytorch_tanh`` is the
# same tanh approximation as ``gelu_new``.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "relu": "relu"}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model")

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


# ---------------------------------------------------------------------- config checks
def where(reader: TensorReader) -> str:
    return os.path.join(reader.folder, "config.json")


def require(config: dict, key: str, reader: TensorReader, *, kind=int):
    """``config[key]`` as ``kind``; a CheckpointError naming the key when absent or invalid."""
    if key not in config or config[key] is None:
        raise CheckpointError(f"{where(reader)}: required attribute {key!r} is missing")
    value = config[key]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{where(reader)}: {key}={value!r} must be a positive integer")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
            raise CheckpointError(f"{where(reader)}: {key}={value!r} must be a positive number")
    return value


def ffn_activation(config: dict, reader: TensorReader, key: str = "hidden_act") -> str:
    """Map the checkpoint's activation name to a powerlens ``ffn_activation``."""
    act = config.get(key, "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise CheckpointError(
            f"{where(reader)}: unsupported activation {key}={act!r} "
            f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[act]


def reject_unhandled(config: dict, reader: TensorReader, *, extra: Dict[str, object] = ()) -> None:
    """Reject config attributes that change the maths and that the converters do not model.

    ``position_embedding_type`` other than ``absolute`` (relative position scores),
    ``is_decoder`` / ``add_cross_attention`` (causal or cross attention), and any
    ``extra`` attribute whose value differs from the given allowed value.
    """
    pet = config.get("position_embedding_type", "absolute")
    if pet not in (None, "absolute"):
        raise CheckpointError(
            f"{where(reader)}: position_embedding_type={pet!r} is not supported (only 'absolute')")
    for key in ("is_decoder", "add_cross_attention"):
        if config.get(key):
            raise CheckpointError(
                f"{where(reader)}: {key}=True is not supported (encoder self-attention only)")
    for key, allowed in dict(extra).items():
        if key in config and config[key] not in (None, allowed):
            raise CheckpointError(f"{where(reader)}: {key}={config[key]!r} is not supported (only {allowed!r})")


def tokenizer_folder(folder: str) -> Optional[str]:
    """The folder itself when it holds tokenizer files (for ``AutoTokenizer``), else None."""
    return folder if any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES) else None


def head_sizes(d: int, H: int, reader: TensorReader, *, d_key="hidden_size", h_key="num_attention_heads"):
    if d % H:
        raise CheckpointError(f"{where(reader)}: {d_key}={d} is not a multiple of {h_key}={H}")
    return d // H


# ---------------------------------------------------------------------- tensors
def read_stacked(reader: TensorReader, template: str, indices, stored, target) -> jax.Array:
    """Stack one tensor over layers: (U,) + target.

    ``indices`` is a list of format dicts, one per unique layer. Each layer's tensor is
    read straight from the file into its slot of an aligned stacked array, which JAX
    then aliases on the CPU (:func:`~powerlens.models.reader.to_device`): every weight
    is held once while loading.
    """
    out = aligned_empty((len(indices),) + tuple(target), reader.dtype)
    for u, idx in enumerate(indices):
        reader.get(template.format(**idx), stored, out=out[u].reshape(stored))
    return to_device(out)


def read_layers(reader: TensorReader, names: Dict[str, str], indices, config: LayerConfig,
                f: int) -> Layers:
    """Read every field of ``names`` for the unique layers ``indices`` into :class:`Layers`."""
    H, e, d = config.n_heads, config.d_head, config.d_model
    fields = {}
    for field, template in names.items():
        stored, target = _SHAPES[field](H, e, d, f)
        fields[field] = read_stacked(reader, template, indices, stored, target)
    try:
        return make_layers(config=config, **fields)
    except ValueError as exc:  # pragma: no cover - the reader already checks shapes/finiteness
        raise CheckpointError(f"{reader.folder}: {exc}") from exc


def read_embeddings(reader: TensorReader, names: Dict[str, str], shapes: Dict[str, Tuple[int, ...]]):
    """The embedding tables named in ``names`` (key -> tensor name) with the given shapes."""
    out = {}
    for key, name in names.items():
        out[key] = to_device(reader.get(name, shapes[key]))
    return out


# ---------------------------------------------------------------------- converters
@register("bert", "roberta")
def convert_bert(config: dict, reader: TensorReader, dtype, name: str = "") -> Model:
    """BERT or RoBERTa (``model_type`` decides the position offset) -> Model."""
    family = config.get("model_type", "bert")
    reject_unhandled(config, reader)
    d = require(config, "hidden_size", reader)
    H = require(config, "num_attention_heads", reader)
    L = require(config, "num_hidden_layers", reader)
    f = require(config, "intermediate_size", reader)
    V = require(config, "vocab_size", reader)
    P = require(config, "max_position_embeddings", reader)
    T = require(config, "type_vocab_size", reader) if "type_vocab_size" in config else 2
    eps = float(require(config, "layer_norm_eps", reader, kind=float)) if "layer_norm_eps" in config else 1e-12
    e = head_sizes(d, H, reader)
    act = ffn_activation(config, reader)
    pad = config.get("pad_token_id", 1 if family == "roberta" else 0)
    offset = 0
    if family == "roberta":
        if pad is None:
            raise CheckpointError(f"{where(reader)}: RoBERTa needs pad_token_id (its positions start after it)")
        offset = int(pad) + 1
        if offset >= P:
            raise CheckpointError(
                f"{where(reader)}: pad_token_id={pad} leaves no positions out of max_position_embeddings={P}")
    # embeddings first, while nothing else is resident (keeps peak memory low)
    emb = read_embeddings(reader, EMBEDDING_NAMES,
                          {"word": (V, d), "position": (P, d), "token_type": (T, d),
                           "norm_scale": (d,), "norm_bias": (d,)})
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=False, norm="layernorm", norm_eps=eps,
                      norm_placement="post", ffn_activation=act, family=family)
    layers = read_layers(reader, BERT_NAMES, [dict(i=i) for i in range(L)], cfg, f)
    info = ModelInfo(family=family, source=reader.folder, tokenizer=tokenizer_folder(reader.folder),
                     max_positions=P, pad_token_id=pad, bos_token_id=config.get("bos_token_id"),
                     position_offset=offset, name=name)
    return Model(layers=layers, embeddings=emb, info=info)


@register("distilbert")
def convert_distilbert(config: dict, reader: TensorReader, dtype, name: str = "") -> Model:
    """DistilBERT -> Model (LayerNorm eps fixed at 1e-12 as in Hugging Face; no token types).

    With ``sinusoidal_pos_embds`` the sinusoidal table is stored in the checkpoint like a
    learned one, so it is simply read.
    """
    reject_unhandled(config, reader)
    d = require(config, "dim", reader)
    H = require(config, "n_heads", reader)
    L = require(config, "n_layers", reader)
    f = require(config, "hidden_dim", reader)
    V = require(config, "vocab_size", reader)
    P = require(config, "max_position_embeddings", reader)
    e = head_sizes(d, H, reader, d_key="dim", h_key="n_heads")
    act = ffn_activation(config, reader, key="activation")
    eps = 1e-12
    names = {k: v for k, v in EMBEDDING_NAMES.items() if k != "token_type"}
    emb = read_embeddings(reader, names, {"word": (V, d), "position": (P, d), "norm_scale": (d,), "norm_bias": (d,)})
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=False, norm="layernorm", norm_eps=eps,
                      norm_placement="post", ffn_activation=act, family="distilbert")
    layers = read_layers(reader, DISTILBERT_NAMES, [dict(i=i) for i in range(L)], cfg, f)
    info = ModelInfo(family="distilbert", source=reader.folder, tokenizer=tokenizer_folder(reader.folder),
                     max_positions=P, pad_token_id=config.get("pad_token_id", 0), name=name)
    return Model(layers=layers, embeddings=emb, info=info)
