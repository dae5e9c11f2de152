"""OPT converter (Hugging Face ``model_type`` ``opt``).

Block, LayerNorm (eps 1e-5), one of two placements chosen by ``do_layer_norm_before``::

    True  (pre-LN: opt-125m, 1.3b, …)   h = x + attn(ln_1 x);      out = h + fc2(relu(fc1(ln_2 h)))
    False (post-LN: opt-350m)           h = ln_1(x + attn x);      out = ln_2(h + fc2(relu(fc1 h)))
    ln_1 = self_attn_layer_norm, ln_2 = final_layer_norm (of the layer)

    final: decoder.final_layer_norm only when do_layer_norm_before and not _remove_final_layer_norm

Weights are ``nn.Linear`` (out, in): ``self_attn.{q,k,v}_proj`` (d, d) -> W_{q,k,v} (H, e, d),
``out_proj`` (d, d) -> W_o, biases when ``enable_bias``. HF multiplies q_proj(x) (bias included) by
1/√e before the product with k; powerlens scales the product, the same number.

Embeddings. Learned positions with offset 2, counted from the attention mask as HF does
(``cumsum(mask) · mask − 1 + 2``): a valid token's position is 1 + its index among the valid
tokens, a pad's is 1, so a left-padded prompt embeds exactly like the unpadded one. That is
:func:`~powerlens._src.models.embed.embed_ids` with ``position_offset = 2`` (the RoBERTa rule), and
``max_positions`` = the rows of ``embed_positions`` = ``max_position_embeddings`` + 2::

    x0 = P_in word[ids] + position[1 + cumsum(valid) · valid]       (d,)

``word_embed_proj_dim`` E ≠ d (opt-350m: E = 512, d = 1024): the word embeddings (V, E) go
through ``project_in`` P_in (d, E) and the last state through ``project_out`` P_out (E, d) before
the (tied) LM head (V, E). powerlens folds both projections at load time, so everything it holds
lives in the d-wide residual stream::

    embeddings['word'] = word · P_inᵀ   (V, d)        lm_head = W_head · P_out   (V, d)

**What powerlens reports as OPT's last hidden state.** The states are the d-wide residual
stream. ``hidden_states(model, …).hf[k]`` equals HF's ``hidden_states[k]`` for every k < L; the last
one is the residual stream after the final LayerNorm (if any), *before* ``project_out`` —
1024 wide for opt-350m, where HF's last hidden state is ``P_out`` times it (512 wide).
``logits`` reads that state through the folded head W_head · P_out, so the logits are HF's.
Without a projection (E = d) every hidden state is HF's.

F_t = W_o · concat_h(W_v,h) (d, d) as for every family; projections never enter it.
"""
from __future__ import annotations

import numpy as np

from .base import Model, ModelInfo, register
from .convert import (Stack, activation, check_config, check_layer_count, config_file, head_size, lm_head,
                      read_tensors, require, require_all, to_device, tokenizer_folder)
from .gpt_neox import decoder_model, flag
from .layout import LINEAR
from .reader import CheckpointError

OPT_HANDLED = frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "ffn_dim", "vocab_size",
                         "max_position_embeddings", "do_layer_norm_before", "_remove_final_layer_norm",
                         "word_embed_proj_dim", "activation_function", "enable_bias", "tie_word_embeddings",
                         "pad_token_id", "bos_token_id"})
# dropout and LayerDrop (training only), the initialisation std
OPT_NEUTRAL = frozenset({"dropout", "attention_dropout", "activation_dropout", "layerdrop", "init_std"})
# LayerNorms without a learned scale and shift are not supported
OPT_ONLY = {"layer_norm_elementwise_affine": (True,)}

OPT_EPS = 1e-5          # nn.LayerNorm's default: OPT has no eps attribute

# stacked key -> tensor name inside ``decoder.layers.N.``
OPT_NAMES = {
    "W_o": "self_attn.out_proj.weight", "b_o": "self_attn.out_proj.bias",
    "norm_scale": "self_attn_layer_norm.weight", "norm_bias": "self_attn_layer_norm.bias",
    "ffn_norm_scale": "final_layer_norm.weight", "ffn_norm_bias": "final_layer_norm.bias",
    "W_in": "fc1.weight", "b_in": "fc1.bias", "W_out": "fc2.weight", "b_out": "fc2.bias",
}


@register("opt", output_layout=LINEAR)
def convert_opt(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "opt", handled=OPT_HANDLED, neutral=OPT_NEUTRAL, only=OPT_ONLY)
    d, H, L, f, V, P = require_all(config, src, d="hidden_size", H="num_attention_heads", L="num_hidden_layers",
                                   f="ffn_dim", V="vocab_size", P="max_position_embeddings")
    E = require(config, "word_embed_proj_dim", src, default=d)
    e = head_size(d, H, src)
    act = activation(config, "activation_function", src, "relu")
    pre_ln = flag(config, "do_layer_norm_before", src, True)
    final_ln = pre_ln and not flag(config, "_remove_final_layer_norm", src, False)
    bias = flag(config, "enable_bias", src, True)
    check_layer_count(L, "num_hidden_layers", reader.names(), "decoder.layers.", src)

    shapes = {"W_q": (H, e, d), "W_k": (H, e, d), "W_v": (H, e, d), "W_o": (d, d),
              "norm_scale": (d,), "norm_bias": (d,), "ffn_norm_scale": (d,), "ffn_norm_bias": (d,),
              "W_in": (f, d), "W_out": (d, f)}
    if bias:
        shapes.update({"b_q": (H, e), "b_k": (H, e), "b_v": (H, e), "b_o": (d,), "b_in": (f,), "b_out": (d,)})
    st = Stack(L, dtype, shapes, reader.folder)
    for i in range(L):
        p = f"decoder.layers.{i}."
        for w in "qkv":
            st.read(f"W_{w}", i, reader, f"{p}self_attn.{w}_proj.weight", (d, d))
            if bias:
                st.read(f"b_{w}", i, reader, f"{p}self_attn.{w}_proj.bias", (d,))
        for key, tensor in OPT_NAMES.items():
            if key in shapes:
                st.read(key, i, reader, p + tensor)
    if not bias and reader.has("decoder.layers.0.self_attn.q_proj.bias"):
        raise CheckpointError(f"{reader.folder}: enable_bias is false but the checkpoint has "
                              f"decoder.layers.0.self_attn.q_proj.bias")

    word = reader.get("decoder.embed_tokens.weight", (V, E))
    tied = flag(config, "tie_word_embeddings", src, True)
    if E == d:
        embeddings = {"word": to_device(word)}
        head = lm_head(config, reader, (V, d), default_tied=True)
    else:
        P_in = reader.get("decoder.project_in.weight", (d, E))
        P_out = reader.get("decoder.project_out.weight", (E, d))
        W_head = word if tied else reader.get("lm_head.weight", (V, E))
        head = to_device(np.ascontiguousarray(W_head @ P_out))      # (V, d): project_out, then the head
        del W_head
        embeddings = {"word": to_device(np.ascontiguousarray(word @ P_in.T))}
    del word
    embeddings.update(read_tensors(reader, {"position": "decoder.embed_positions.weight"},
                                   {"position": (P + 2, d)}))
    final = read_tensors(reader, {"scale": "decoder.final_layer_norm.weight", "bias": "decoder.final_layer_norm.bias"},
                         {"scale": (d,), "bias": (d,)}) if final_ln else {"scale": None, "bias": None}
    info = ModelInfo(family="opt", source=reader.folder, tokenizer=tokenizer_folder(reader.folder),
                     max_positions=P + 2, decoder=True, final_norm_in_hidden_states=final_ln,
                     pad_token_id=config.get("pad_token_id"), bos_token_id=config.get("bos_token_id"),
                     position_offset=2, name=name)
    return decoder_model(st, d=d, H=H, e=e, norm="layernorm", eps=OPT_EPS, theta=None, rope_dim=None,
                         act=act, info=info, embeddings=embeddings, final_scale=final["scale"],
                         final_bias=final["bias"], head=head, placement="pre" if pre_ln else "post")
