"""Phi and Phi-3 converters (Hugging Face ``model_type`` ``phi`` and ``phi3``).

**Phi** (phi-1, phi-1.5, phi-2): a parallel block with ONE LayerNorm shared by both branches,
biases everywhere, ``gelu_new`` FFN, a final LayerNorm and an LM head with a bias::

    out = x + dense(attn(ln x)) + fc2(gelu_new(fc1(ln x)))        ln = input_layernorm
    logits = lm_head(final_layernorm h) + lm_head.bias            (V,)

    self_attn.{q,k,v}_proj (H e, d) / (G e, d) + bias -> W_q, W_k, W_v, b_q, b_k, b_v (GQA as Llama)
    self_attn.dense (d, H e) + bias -> W_o, b_o;   mlp.fc1 (f, d), fc2 (d, f) + biases

The layers carry no ``ffn_norm``: the parallel ``full`` rule then feeds the FFN the same
``norm`` as the attention (``LayerConfig.parallel_residual``). Partial rotary: r = int(e ·
``partial_rotary_factor``) (``rope_parameters`` or the top-level key; 0.5 when absent, the
PhiConfig default) leading coordinates of each head rotated (HF ``rotate_half``), base
``rope_theta``. ``qk_layernorm`` True (an ``nn.LayerNorm(head_dim)``, with bias, on each head's q
and k before RoPE) is read into ``q_norm_scale``/``q_norm_bias`` (and k), applied as the config's
``layernorm``; False, the published default, is the plain attention.

**Phi-3** (Phi-3-mini, …): the sequential pre-RMSNorm block of Llama with fused projections::

    h = x + o_proj(attn(rms_1 x));  out = h + down(up ⊙ silu(gate))(rms_2 h)
    self_attn.qkv_proj (H e + 2 G e, d): rows [q (H e) | k (G e) | v (G e)]
    mlp.gate_up_proj (2 f, d): rows [gate (f) | up (f)]  (HF ``chunk(2)``: gate first)

``sliding_window`` (Phi-3-mini-4k: 2047) applies to every layer whenever it is set:
Phi3Model builds ``create_sliding_window_causal_mask`` when ``config.sliding_window`` is not
None, and that mask lets query i see keys j with i − window < j ≤ i (powerlens's ``window``).
Scaled RoPE (``rope_scaling`` / ``rope_parameters`` of type ``longrope``, ``su``, ``yarn``, …:
the 128k models) is rejected by name; ``partial_rotary_factor`` is read as for Phi (default 1).

F_t = W_o · concat_h(W_v,g(h)) (d, d) for both, with query head h reading key/value head
g(h) = h // (H/G).
"""
from __future__ import annotations

from .base import Model, register
from .convert import (WINDOW_MAX, Stack, activation, check_config, check_layer_count, config_file, lm_head,
                      read_tensors, require, short_repr, tokenizer_folder, to_device)
from .gpt_neox import decoder_model, flag, partial_rotary
from .layout import LINEAR
from .llama import GLU_ACTIVATIONS, HF_TENSORS, hf_sizes, llama_info, llama_shapes
from .reader import CheckpointError

# what both read (sizes as Llama's: head_dim defaults to d / H, num_key_value_heads to H)
PHI_COMMON = frozenset({"hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                        "intermediate_size", "vocab_size", "head_dim", "hidden_act", "max_position_embeddings",
                        "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
                        "partial_rotary_factor", "pad_token_id", "bos_token_id"})
PHI_HANDLED = PHI_COMMON | {"layer_norm_eps", "qk_layernorm"}
PHI3_HANDLED = PHI_COMMON | {"rms_norm_eps", "sliding_window"}
# dropout; ``auto_map`` points at the remote code of the first hub uploads (the same model);
# ``original_max_position_embeddings`` only enters longrope, which is rejected
PHI_NEUTRAL = frozenset({"resid_pdrop", "embd_pdrop", "attention_dropout", "auto_map"})
PHI3_NEUTRAL = PHI_NEUTRAL | {"original_max_position_embeddings"}
# some Phi-3 configs carry the Llama switch at its default
PHI3_ONLY = {"attention_bias": (False,)}

# stacked key -> tensor name after ``layers.N.`` (Phi)
PHI_NAMES = {
    "W_q": "self_attn.q_proj.weight", "W_k": "self_attn.k_proj.weight", "W_v": "self_attn.v_proj.weight",
    "b_q": "self_attn.q_proj.bias", "b_k": "self_attn.k_proj.bias", "b_v": "self_attn.v_proj.bias",
    "W_o": "self_attn.dense.weight", "b_o": "self_attn.dense.bias",
    "norm_scale": "input_layernorm.weight", "norm_bias": "input_layernorm.bias",
    "W_in": "mlp.fc1.weight", "b_in": "mlp.fc1.bias", "W_out": "mlp.fc2.weight", "b_out": "mlp.fc2.bias",
}


def _info(config, reader, src, name, family):
    return llama_info(source=reader.folder, tokenizer=tokenizer_folder(reader.folder),
                      max_positions=require(config, "max_position_embeddings", src, default=None),
                      pad=config.get("pad_token_id"), bos=config.get("bos_token_id"), name=name, family=family)


@register("phi", output_layout=LINEAR)
def convert_phi(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "phi", handled=PHI_HANDLED, neutral=PHI_NEUTRAL)
    qk_norm = flag(config, "qk_layernorm", src, False)
    s = hf_sizes(config, src)
    theta, rope_dim = partial_rotary(config, src, s.e, default_factor=0.5)
    act = activation(config, "hidden_act", src, "gelu_new")
    eps = require(config, "layer_norm_eps", src, kind=float, default=1e-5)
    check_layer_count(s.L, "num_hidden_layers", reader.names(), "layers.", src)
    shapes = llama_shapes(s.d, s.H, s.G, s.e, s.f, biases=("b_q", "b_k", "b_v", "b_o", "b_in", "b_out"))
    for k in ("ffn_norm_scale", "W_gate"):
        shapes.pop(k)
    shapes["norm_bias"] = (s.d,)
    names = dict(PHI_NAMES)
    if qk_norm:          # nn.LayerNorm(head_dim) on every head's q and k, before the partial RoPE
        for qk in ("q", "k"):
            shapes[f"{qk}_norm_scale"] = shapes[f"{qk}_norm_bias"] = (s.e,)
            names[f"{qk}_norm_scale"] = f"self_attn.{qk}_layernorm.weight"
            names[f"{qk}_norm_bias"] = f"self_attn.{qk}_layernorm.bias"
    st = Stack(s.L, dtype, shapes, reader.folder)
    for key in shapes:
        stored = HF_TENSORS[key][1](s) if key in HF_TENSORS and key in PHI_NAMES else None
        for i in range(s.L):
            st.read(key, i, reader, f"layers.{i}.{names[key]}", stored)
    tensors = read_tensors(reader, {"word": "embed_tokens.weight", "scale": "final_layernorm.weight",
                                    "bias": "final_layernorm.bias"},
                           {"word": (s.V, s.d), "scale": (s.d,), "bias": (s.d,)})
    head = lm_head(config, reader, (s.V, s.d), default_tied=False)
    head_bias = to_device(reader.get("lm_head.bias", (s.V,))) if reader.has("lm_head.bias") else None
    return decoder_model(st, d=s.d, H=s.H, G=s.G, e=s.e, norm="layernorm", eps=eps, theta=theta,
                         rope_dim=rope_dim, act=act, info=_info(config, reader, src, name, "phi"),
                         embeddings={"word": tensors["word"]}, final_scale=tensors["scale"],
                         final_bias=tensors["bias"], head=head, head_bias=head_bias, parallel=True)


def phi3_window(config: dict, src: str) -> int:
    """The window of every Phi-3 layer: ``sliding_window`` when set (Phi3Model applies it), else 0."""
    return require(config, "sliding_window", src, default=0, maximum=WINDOW_MAX)


@register("phi3", output_layout=LINEAR)
def convert_phi3(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "phi3", handled=PHI3_HANDLED, neutral=PHI3_NEUTRAL, only=PHI3_ONLY)
    s = hf_sizes(config, src)
    theta, rope_dim = partial_rotary(config, src, s.e, default_factor=1.0)
    act = activation(config, "hidden_act", src, "silu", GLU_ACTIVATIONS)
    eps = require(config, "rms_norm_eps", src, kind=float, default=1e-5)
    window = phi3_window(config, src)
    check_layer_count(s.L, "num_hidden_layers", reader.names(), "layers.", src)
    st = Stack(s.L, dtype, llama_shapes(s.d, s.H, s.G, s.e, s.f), reader.folder)
    q, k = s.H * s.e, s.G * s.e
    for i in range(s.L):
        p = f"layers.{i}."
        w = reader.get(p + "self_attn.qkv_proj.weight", (q + 2 * k, s.d))
        st["W_q"][i] = w[:q].reshape(s.H, s.e, s.d)
        st["W_k"][i] = w[q:q + k].reshape(s.G, s.e, s.d)
        st["W_v"][i] = w[q + k:].reshape(s.G, s.e, s.d)
        w = reader.get(p + "mlp.gate_up_proj.weight", (2 * s.f, s.d))
        st["W_gate"][i], st["W_in"][i] = w[:s.f], w[s.f:]
        del w
        for key in ("W_o", "norm_scale", "ffn_norm_scale", "W_out"):
            st.read(key, i, reader, p + HF_TENSORS[key][0], HF_TENSORS[key][1](s))
    tensors = read_tensors(reader, {"word": "embed_tokens.weight", "norm": "norm.weight"},
                           {"word": (s.V, s.d), "norm": (s.d,)})
    return decoder_model(st, d=s.d, H=s.H, G=s.G, e=s.e, norm="rmsnorm", eps=eps, theta=theta,
                         rope_dim=rope_dim, act=act, info=_info(config, reader, src, name, "phi3"),
                         embeddings={"word": tensors["word"]}, final_scale=tensors["norm"],
                         head=lm_head(config, reader, (s.V, s.d), default_tied=False), window=window)
