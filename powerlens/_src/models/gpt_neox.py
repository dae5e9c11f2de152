"""GPT-NeoX / Pythia converter (Hugging Face ``model_type`` ``gpt_neox``), and the pieces the
other parallel-block and partial-rotary families share (:func:`partial_rotary`,
:func:`decoder_model`, :func:`flag`).

Block (pre-LN, LayerNorm with ``layer_norm_eps``, one of two shapes)::

    use_parallel_residual = True  (Pythia, the default)
        out = x + attn(ln_1 x) + mlp(ln_2 x)             ln_1 = input_layernorm
    use_parallel_residual = False                         ln_2 = post_attention_layernorm
        h = x + attn(ln_1 x);  out = h + mlp(ln_2 h)
    mlp(x) = dense_4h_to_h(act(dense_h_to_4h x)),  act = hidden_act (gelu)
    final: final_layer_norm; logits: embed_out (the name in the files, transformers 5's too;
           its module is lm_head, read under that name as well), tied when tie_word_embeddings

The fused projection ``attention.query_key_value`` (3d, d), ``nn.Linear`` (out, in), is laid
out per head: HF views its output as (…, H, 3 e) and chunks the last axis into q, k, v, so the
rows are [head 0: q k v, head 1: q k v, …]::

    query_key_value.weight.reshape(H, 3, e, d)[:, 0] = W_q (H, e, d)   [:, 1] = W_k   [:, 2] = W_v
    query_key_value.bias.reshape(H, 3, e)[:, j]      = b_q, b_k, b_v   (attention_bias)
    attention.dense (d, d) + bias -> W_o, b_o

Partial rotary: RoPE (HF ``rotate_half`` on the first r coordinates of each head, the rest
passed through) with r = int(e · factor), factor = ``rope_parameters.partial_rotary_factor``
(transformers 5) or ``rotary_pct`` (older files; 0.25 when absent, the GPTNeoXConfig default),
base ``rope_parameters.rope_theta`` or ``rotary_emb_base`` (10000). Positions are 0 … n−1 over
the whole padded row, as HF counts them without explicit ``position_ids``. Softmax scale 1/√e.

F_t = W_o · concat_h(W_v,h) (d, d), formed from the rows [:, 2] of the fused weight.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

from ..dynamics.params import LayerConfig, make_layers
from ..dynamics.parts import FFN, Attention, Norms
from .base import Model, ModelInfo, register
from .convert import (Stack, activation, check_config, check_layer_count, config_file, head_size, lm_head,
                      read_tensors, require, require_all, short_repr, to_device, tokenizer_folder, left_out, wanted)
from .layout import LINEAR
from .llama import check_rope_head_size, llama_info, rope_theta
from .reader import CheckpointError

GPT_NEOX_HANDLED = frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                              "vocab_size", "hidden_act", "layer_norm_eps", "max_position_embeddings",
                              "tie_word_embeddings", "use_parallel_residual", "attention_bias", "rotary_pct",
                              "partial_rotary_factor", "rotary_emb_base", "rope_scaling", "rope_parameters",
                              "pad_token_id", "bos_token_id"})
# dropout (the GPT-NeoX-20B config has the *_prob names); the classification head's dropout
GPT_NEOX_NEUTRAL = frozenset({"attention_dropout", "hidden_dropout", "attention_probs_dropout_prob",
                              "hidden_dropout_prob", "classifier_dropout"})


def flag(config: Mapping, key: str, source: str, default: bool) -> bool:
    """``config[key]`` as a bool (``default`` when absent or null); anything else names the key."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: {key}={short_repr(value)} must be true or false")
    return value


def partial_rotary(config: Mapping, source: str, e: int, *, default_factor: float,
                   factor_keys: Sequence[str] = ("partial_rotary_factor",),
                   theta_keys: Sequence[str] = ("rope_theta",)) -> Tuple[float, Optional[int]]:
    """(RoPE base θ, rotated dimensions per head r or None for all e) of a partial-rotary config.

    ``rope_parameters`` (transformers 5) wins; then the first of ``theta_keys`` /
    ``factor_keys`` that the file sets (older names: ``rotary_emb_base``, ``rotary_pct``);
    then 10000 and ``default_factor``. r = int(e · factor) as transformers computes it; it must be
    even and positive. Scaled RoPE (a ``rope_type`` other than ``default``) is rejected by name.
    """
    rope_theta(config, source)                 # rejects rope_scaling / rope_parameters of a scaled type
    params = config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: rope_parameters={short_repr(params)} must be a mapping")

    def first(inner: str, keys: Sequence[str], default: float) -> Tuple[str, float]:
        if params.get(inner) is not None:
            return f"rope_parameters.{inner}", params[inner]
        for k in keys:
            if config.get(k) is not None:
                return k, config[k]
        return inner, default

    key, theta = first("rope_theta", theta_keys, 10000.0)
    theta = require({key: theta}, key, source, kind=float)
    key, factor = first("partial_rotary_factor", factor_keys, default_factor)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"{source}: {key}={short_repr(factor)} must be a number in (0, 1]")
    r = int(e * factor)
    if r <= 0:
        raise CheckpointError(f"{source}: {key}={factor!r} rotates no dimension of the head size {e}")
    check_rope_head_size(r, source, f"{key}={factor!r} (times the head size {e})")
    return theta, (None if r == e else r)


def decoder_model(st: Stack, *, d: int, H: int, e: int, G: Optional[int] = None, norm: str, eps: float,
                  theta: float, rope_dim: Optional[int], act: str, info: ModelInfo, embeddings,
                  final_scale=None, final_bias=None, head=None, head_bias=None, placement: str = "pre",
                  parallel: bool = False, window=0) -> Model:
    """A causal decoder :class:`Model` from filled stacked arrays (GPT-NeoX, OPT, Phi, Phi-3):
    softmax scale 1/√e, RoPE (θ, ``rope_dim``) unless ``theta`` is None, per-layer ``window``."""
    cfg = LayerConfig(d_model=d, n_heads=H, n_kv_heads=G or H, d_head=e, causal=True, norm=norm, norm_eps=eps,
                      norm_placement=placement, rope_theta=theta, rope_dim=rope_dim, ffn_activation=act,
                      parallel_residual=parallel)
    a = st.finish()     # the family's attention (biases, q/k norms), norms (Phi: LN1 only) and FFN
    layers = make_layers(attn=Attention.take(a, scale=e ** -0.5, window=np.asarray(window, np.int32)),
                         norms=Norms.take(a), ffn=FFN.take(a), config=cfg, **a)
    return Model(layers=layers, embeddings=embeddings, final_norm_scale=final_scale, final_norm_bias=final_bias,
                 lm_head=head, lm_head_bias=head_bias, info=info)


@register("gpt_neox", output_layout=LINEAR)
def convert_gpt_neox(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "gpt_neox", handled=GPT_NEOX_HANDLED, neutral=GPT_NEOX_NEUTRAL)
    d, H, L, f, V = require_all(config, src, d="hidden_size", H="num_attention_heads", L="num_hidden_layers",
                                f="intermediate_size", V="vocab_size")
    e = head_size(d, H, src)
    theta, rope_dim = partial_rotary(config, src, e, default_factor=0.25, factor_keys=("rotary_pct",),
                                     theta_keys=("rotary_emb_base",))
    act = activation(config, "hidden_act", src, "gelu")
    eps = require(config, "layer_norm_eps", src, kind=float, default=1e-5)
    parallel = flag(config, "use_parallel_residual", src, True)
    bias = flag(config, "attention_bias", src, True)
    pre = "gpt_neox." if reader.has("gpt_neox.embed_in.weight") else ""     # a GPTNeoXModel has no prefix
    check_layer_count(L, "num_hidden_layers", reader.names(), pre + "layers.", src)

    shapes = {"W_q": (H, e, d), "W_k": (H, e, d), "W_v": (H, e, d), "W_o": (d, d),
              "norm_scale": (d,), "norm_bias": (d,), "ffn_norm_scale": (d,), "ffn_norm_bias": (d,),
              "W_in": (f, d), "b_in": (f,), "W_out": (d, f), "b_out": (d,)}
    if bias:
        shapes.update({"b_q": (H, e), "b_k": (H, e), "b_v": (H, e), "b_o": (d,)})
    st = Stack(L, dtype, shapes, reader.folder)
    names = {"W_o": "attention.dense.weight", "b_o": "attention.dense.bias",
             "norm_scale": "input_layernorm.weight", "norm_bias": "input_layernorm.bias",
             "ffn_norm_scale": "post_attention_layernorm.weight", "ffn_norm_bias": "post_attention_layernorm.bias",
             "W_in": "mlp.dense_h_to_4h.weight", "b_in": "mlp.dense_h_to_4h.bias",
             "W_out": "mlp.dense_4h_to_h.weight", "b_out": "mlp.dense_4h_to_h.bias"}
    for i in range(L):
        p = f"{pre}layers.{i}."
        w = reader.get(p + "attention.query_key_value.weight", (3 * d, d)).reshape(H, 3, e, d)
        b = reader.get(p + "attention.query_key_value.bias", (3 * d,)).reshape(H, 3, e) if bias else None
        for j, k in enumerate("qkv"):
            st[f"W_{k}"][i] = w[:, j]
            if bias:
                st[f"b_{k}"][i] = b[:, j]
        del w, b
        for key, tensor in names.items():
            if key in shapes:
                st.read(key, i, reader, p + tensor)
    if not bias and reader.has(pre + "layers.0.attention.query_key_value.bias"):
        raise CheckpointError(f"{reader.folder}: attention_bias is false but the checkpoint has "
                              f"{pre}layers.0.attention.query_key_value.bias")

    tensors = read_tensors(reader, {"word": pre + "embed_in.weight", "scale": pre + "final_layer_norm.weight",
                                    "bias": pre + "final_layer_norm.bias"},
                           {"word": (V, d), "scale": (d,), "bias": (d,)})
    if reader.has("embed_out.weight") and not flag(config, "tie_word_embeddings", src, False):
        head = to_device(reader.get("embed_out.weight", (V, d))) if wanted("lm_head") else None   # save_pretrained's name
        if head is None:
            left_out("lm_head", "embed_out.weight")
    else:
        head = lm_head(config, reader, (V, d), default_tied=False)
    info = llama_info(source=reader.folder, tokenizer=tokenizer_folder(reader.folder),
                      max_positions=require(config, "max_position_embeddings", src, default=None),
                      pad=config.get("pad_token_id"), bos=config.get("bos_token_id"), name=name, family="gpt_neox")
    return decoder_model(st, d=d, H=H, e=e, norm="layernorm", eps=eps, theta=theta,
                         rope_dim=rope_dim, act=act, info=info, embeddings={"word": tensors["word"]},
                         final_scale=tensors["scale"], final_bias=tensors["bias"], head=head, parallel=parallel)
